"""What a picked LoRA says about how to run it: its declared schedule (the status line, Steps and CFG, the grid a
run samples on, the refusals before queueing) and the frozen LoRA it was trained on top of (the one-click stack);
and the output sizes a family takes, checked before queueing."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffsynth_qie.models.samplers.declared import DeclaredSchedule
from diffsynth_qie.ui.config import UIConfig
from diffsynth_qie.ui.handlers import MODE_FLOW, MODE_LBM, GenerateInputs, UIHandlers
from diffsynth_qie.ui.uploads import UIError

TURBO = (1.0, 0.9375, 0.875, 0.75, 0.5, 0.25)


def _lora(path: Path, metadata: dict | None = None) -> Path:
    from diffsynth_qie.lora import save_lora

    sd = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 8),
          "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 4)}
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_lora(path, sd, metadata=metadata)


def _editor(size=(64, 48)):
    rng = np.random.default_rng(0)
    return {"background": Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB"),
            "layers": []}


def _handlers(tmp_path, model="tiny", **kw) -> UIHandlers:
    return UIHandlers(UIConfig(model=model, lora_dir=str(tmp_path / "loras"), examples="",
                               temp_dir=str(tmp_path / "temp"), outputs_dir=str(tmp_path / "out")), **kw)


def _turbo(tmp_path, family=None, name="turbo.safetensors") -> Path:
    schedule = DeclaredSchedule(6, 1.0, TURBO, family=family, line="a turbo line")
    return _lora(tmp_path / "loras" / name, schedule.to_metadata())


# --- a declared schedule -------------------------------------------------------------------------
def test_a_declared_schedule_is_said_set_and_sampled(tmp_path):
    _turbo(tmp_path)
    _lora(tmp_path / "loras" / "shifted.safetensors", DeclaredSchedule(4, 1.5, shift=3.0).to_metadata())
    _lora(tmp_path / "loras" / "plain.safetensors")
    h = _handlers(tmp_path)
    status = h.lora_status("turbo.safetensors")
    assert "declares its schedule" in status and "6 sigmas 1, 0.9375, 0.875, 0.75, 0.5, 0.25 at CFG 1" in status
    assert "declares" not in h.lora_status("plain.safetensors")
    # Generate samples on the declared grid at its step count; another count is refused before queueing.
    job = h.check(GenerateInputs(editor=_editor(), prompt="x", lora="turbo.safetensors", steps=6, cfg=1.0))
    assert job.sigmas == TURBO
    with pytest.raises(UIError, match="set Steps to 6"):
        h.check(GenerateInputs(editor=_editor(), prompt="x", lora="turbo.safetensors", steps=40))
    # A shift schedule takes any step count, shifted once; no declared schedule: the model's own.
    job = h.check(GenerateInputs(editor=_editor(), prompt="x", lora="shifted.safetensors", steps=10))
    assert len(job.sigmas) == 10 and job.sigmas[0] == 1.0 and job.sigmas[5] == pytest.approx(3 * 0.5 / 2.0)
    assert h.check(GenerateInputs(editor=_editor(), prompt="x", lora="plain.safetensors")).sigmas is None
    # LBM has its own sampler: no grid.
    assert h.check(GenerateInputs(editor=_editor(), prompt="x", lora="turbo.safetensors", mode=MODE_LBM)).sigmas is None


def test_a_declared_schedule_of_another_family_is_refused_before_queueing(tmp_path):
    _turbo(tmp_path, family="qwen-image-2.1")
    h = _handlers(tmp_path, editor_factory=lambda: pytest.fail("loaded"))
    assert "⚠" in h.lora_status("turbo.safetensors") and "qwen-image-2.1" in h.lora_status("turbo.safetensors")
    with pytest.raises(UIError, match="this model is qwen-image-edit"):
        h.check(GenerateInputs(editor=_editor(), prompt="x", lora="turbo.safetensors", steps=6))


def test_generate_passes_the_declared_grid_to_the_editor(tmp_path):
    from diffsynth_qie.inference.request import EditResult

    seen = []

    class Editor:
        def set_loras(self, loras):
            pass

        def edit(self, request):
            seen.append(request)
            image = request.images[0]
            return EditResult(image=image, sub_image=None, latents=torch.zeros(1), width=image.width,
                              height=image.height, seconds=0.0)

    _turbo(tmp_path)
    h = _handlers(tmp_path, editor_factory=Editor)
    h.generate(GenerateInputs(editor=_editor(), prompt="x", lora="turbo.safetensors", steps=6, cfg=1.0))
    assert tuple(seen[0].sigmas) == TURBO and seen[0].steps == 6 and seen[0].cfg == 1.0


def test_picking_a_lora_sets_its_schedule_and_offers_its_frozen_lora(tmp_path):
    pytest.importorskip("gradio")
    from diffsynth_qie.lora.frozen import TRAINED_ON_KEY
    from diffsynth_qie.ui.events import Callbacks

    frozen = _turbo(tmp_path)
    _lora(tmp_path / "loras" / "task" / "lora.safetensors", {TRAINED_ON_KEY: json.dumps(
        {"file": "turbo.safetensors", "path": str(frozen.resolve()), "scale": 0.8, "sha256": "0"})})
    h = _handlers(tmp_path)
    cb = Callbacks(h)
    offer = h.stack_offer("task/lora.safetensors")
    assert (offer.name, offer.scale) == ("turbo.safetensors", 0.8)
    assert "trained on top of `turbo.safetensors` (scale 0.8)" in h.lora_status("task/lora.safetensors")
    out = cb.pick_lora("task/lora.safetensors", None, MODE_FLOW, MODE_FLOW, 40, None)
    assert out[-1]["visible"] is True and out[-1]["value"] == "Stack with turbo.safetensors × 0.8"
    # One click: the frozen LoRA as the second LoRA at its scale, and Steps and CFG of its declared schedule.
    lora2, scale, status, button, steps, cfg, advanced = cb.stack_frozen("task/lora.safetensors", None, MODE_FLOW)
    assert (lora2, scale, button["visible"], steps["value"], cfg["value"]) == ("turbo.safetensors", 0.8, False, 6, 1.0)
    assert "declares its schedule" in status and advanced["open"] is True
    assert h.stack_offer("task/lora.safetensors", "turbo.safetensors") is None  # already stacked
    # Picking the turbo LoRA itself sets Steps and CFG (flow matching only).
    picked = cb.pick_lora("turbo.safetensors", None, MODE_FLOW, MODE_FLOW, 40, None)
    assert picked[2]["value"] == 6 and picked[3]["value"] == 1.0


def test_a_frozen_lora_outside_the_folder_or_gone_is_said_not_offered(tmp_path):
    from diffsynth_qie.lora.frozen import TRAINED_ON_KEY

    elsewhere = _lora(tmp_path / "elsewhere" / "fast.safetensors")
    for name, path in (("a.safetensors", elsewhere), ("b.safetensors", tmp_path / "gone.safetensors")):
        _lora(tmp_path / "loras" / name, {TRAINED_ON_KEY: json.dumps(
            {"file": Path(path).name, "path": str(path), "scale": 1.0, "sha256": "0"})})
    h = _handlers(tmp_path)
    assert h.stack_offer("a.safetensors").name is None and "outside the LoRA folder" in h.lora_status("a.safetensors")
    assert h.stack_offer("b.safetensors").name is None and "no longer at" in h.lora_status("b.safetensors")


# --- sizes -------------------------------------------------------------------------------------
def test_a_21_size_off_its_multiple_is_refused_in_the_precheck(tmp_path):
    """Qwen-Image-2.1 takes multiples of 32: 1008 (a multiple of 16) was refused only by the run."""
    h = _handlers(tmp_path, model="tiny-2.1", editor_factory=lambda: pytest.fail("loaded"))
    with pytest.raises(UIError, match="width 1008 is not a multiple of 32, which Qwen-Image-2.1 needs: use 992 or 1024"):
        h.check(GenerateInputs(editor=_editor(), prompt="x", width=1008, height=704))
    h.check(GenerateInputs(editor=_editor(), prompt="x", width=992, height=704))
    _handlers(tmp_path).check(GenerateInputs(editor=_editor(), prompt="x", width=1008, height=704))  # 16 is enough


def test_keep_input_size_rounds_to_the_familys_multiple(tmp_path):
    pytest.importorskip("gradio")
    from diffsynth_qie.ui.mask_events import MaskTools

    path = tmp_path / "in.png"
    Image.new("RGB", (1010, 700)).save(path)
    value = {"background": str(path), "layers": [], "composite": str(path)}
    w, h, line = MaskTools(_handlers(tmp_path, model="tiny-2.1")).input_size(value, None)
    assert (w, h) == (1024, 704) and "rounded from 1010×700" in line and "multiples of 32" in line
    assert MaskTools(_handlers(tmp_path)).input_size(value, None)[:2] == (1008, 704)  # 16 for the Edit family
