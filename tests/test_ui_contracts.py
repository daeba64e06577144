"""Contracts between the UI's layout and its callbacks, and what one click may cost.

- Every event of ``build_ui`` hands its callback exactly the inputs the callback takes, and the callback uses each
  of them: an input added on one side only, or one left unused after a change, fails here (gradio itself fills a
  missing argument with None and drops an extra one without a word).
- A click on the LoRA picker (the refresh button, a picked LoRA, the second LoRA, "Stack with") or Generate's check
  reads each LoRA file's header once: the folder is looked at once per click, not once per question the click asks.
"""
from __future__ import annotations

import ast
import inspect
import json
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

from diffsynth_qie.ui.config import UIConfig
from diffsynth_qie.ui.handlers import NO_LORA, GenerateInputs, UIHandlers

gr = pytest.importorskip("gradio")


def _special(param: inspect.Parameter, hints: dict) -> bool:
    """A parameter gradio fills itself (the request, the event's data, the progress bar), not an input."""
    hint = hints.get(param.name)
    if isinstance(param.default, gr.Progress):
        return True
    return inspect.isclass(hint) and issubclass(hint, (gr.Request, gr.EventData))


def _used_names(fn) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0]
    return {n.id for stmt in body.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}


def signature_problems(demo) -> list[str]:
    """Each event whose inputs and callback disagree: a count that differs, or an input the callback ignores."""
    from gradio.utils import get_type_hints

    problems = []
    for block in demo.fns.values():
        fn = block.fn
        if fn is None:
            continue
        hints = get_type_hints(fn)
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        taken = [p.name for p in params if not _special(p, hints)]
        given = 1 if block.inputs_as_dict else len(block.inputs)
        if len(taken) != given:
            problems.append(f"{block.name}: {given} input(s), the callback takes {len(taken)} ({', '.join(taken)})")
        unused = [name for name in taken if name not in _used_names(fn)]
        if unused:
            problems.append(f"{block.name}: the callback ignores its input(s) {', '.join(unused)}")
    return problems


def _lora(path: Path, metadata: dict | None = None) -> Path:
    from diffsynth_qie.lora import save_lora

    sd = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 8),
          "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 4)}
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_lora(path, sd, metadata=metadata)


@pytest.fixture
def handlers(tmp_path):
    from diffsynth_qie.lora.frozen import TRAINED_ON_KEY
    from diffsynth_qie.models.samplers.declared import DeclaredSchedule

    root = tmp_path / "loras"
    turbo = _lora(root / "turbo.safetensors", DeclaredSchedule(6, 1.0, (1.0, 0.75, 0.5, 0.25, 0.1, 0.05),
                                                             line="a turbo line").to_metadata())
    _lora(root / "task" / "lora.safetensors", {TRAINED_ON_KEY: json.dumps(
        {"file": "turbo.safetensors", "path": str(turbo.resolve()), "scale": 0.5, "sha256": "0"}),
        "loss": "sft", "preset": "tiny"})
    _lora(root / "lbm.safetensors", {"loss": "lbm", "preset": "tiny"})
    _lora(root / "Qwen-Image-Lightning-8steps.safetensors")
    torch.save({"x": torch.zeros(1)}, root / "not-safetensors.safetensors")
    return UIHandlers(UIConfig(model="tiny", lora_dir=str(root), examples="", temp_dir=str(tmp_path / "temp"),
                               outputs_dir=str(tmp_path / "out")))


def test_every_event_gives_its_callback_exactly_the_inputs_it_uses(handlers):
    from diffsynth_qie.ui.app import build_ui

    demo = build_ui(handlers)
    assert len(demo.fns) > 20  # the whole layout, not a part of it
    assert signature_problems(demo) == []


def test_the_contract_sees_a_missing_and_an_unused_input():
    """The check must catch what it is about, or the test above proves nothing."""
    with gr.Blocks() as demo:
        a, b, out = gr.Number(), gr.Number(), gr.Number()

        def one(x, request: gr.Request):  # one input given two
            return x

        def ignores(x, y):  # y given, never read
            return x

        a.change(one, [a, b], out)
        b.change(ignores, [a, b], out)
    problems = signature_problems(demo)
    assert any("one: 2 input(s), the callback takes 1 (x)" in p for p in problems), problems
    assert any("ignores: the callback ignores its input(s) y" in p for p in problems), problems


@pytest.fixture
def header_reads(monkeypatch):
    """Every safetensors header opened, by file name."""
    import safetensors

    reads: Counter = Counter()
    real = safetensors.safe_open

    def counted(path, *args, **kwargs):
        reads[Path(str(path)).name] += 1
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counted)
    return reads


def test_a_click_on_the_lora_picker_reads_each_header_once(handlers, header_reads):
    from diffsynth_qie.ui.events import Callbacks

    cb = Callbacks(handlers)
    clicks = {
        "refresh": lambda: cb.refresh_loras("task/lora.safetensors", NO_LORA),
        "pick": lambda: cb.pick_lora("task/lora.safetensors", NO_LORA, "flow", "flow", 40, None),
        "pick LBM": lambda: cb.pick_lora("lbm.safetensors", NO_LORA, "flow", "flow", 40, None),
        "second": lambda: cb.pick_second("task/lora.safetensors", "turbo.safetensors", "flow"),
        "stack": lambda: cb.stack_frozen("task/lora.safetensors", NO_LORA, "flow"),
        "Generate's check": lambda: handlers.check(GenerateInputs(
            editor={"background": Image.new("RGB", (64, 48)), "layers": []}, prompt="x", mode="lightning",
            lora="task/lora.safetensors", lora2="turbo.safetensors")),
    }
    for click, run in clicks.items():
        header_reads.clear()
        run()
        assert header_reads and max(header_reads.values()) == 1, (click, dict(header_reads))
    # what the clicks answer is the same as before: the stack offer, the LBM sampler, the declared schedule
    assert cb.stack_frozen("task/lora.safetensors", NO_LORA, "flow")[:2] == ("turbo.safetensors", 0.5)
    assert cb.pick_lora("lbm.safetensors", NO_LORA, "flow", "flow", 40, None)[0] == "lbm"
    assert "declares its schedule" in handlers.lora_status("turbo.safetensors")
    # outside a click every question reads the folder afresh: a LoRA copied in is seen at once
    _lora(Path(handlers.config.lora_dir) / "new.safetensors")
    assert "new.safetensors" in handlers.lora_choices()
