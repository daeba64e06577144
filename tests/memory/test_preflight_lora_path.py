"""`qie edit`'s preflight takes the user's real LoRA path: each --lora file is read on the host, cut to the blocks the
fake run builds, and attached by the LoRA manager (`Editor.set_loras`) to a DiT already on the fake GPU, as `qie edit`
and the UI attach it; then the LoRAs are switched to other files before a second edit (the UI's loop). A branch the
manager leaves on the host is caught at once (the UI checks the same after each of its switches:
tests/test_ui_handlers.py)."""
from __future__ import annotations

import re

import pytest
from PIL import Image

from edit_planting import plant


def _edit_args(tmp_path, lora, *extra):
    from diffsynth_qie.cli import build_parser

    image = tmp_path / "in.png"
    Image.new("RGB", (512, 384), (40, 90, 160)).save(image)
    return build_parser().parse_args(["edit", "--model", "2511", "--image", str(image), "--prompt", "make the sky pink",
                                      "--lora", str(lora), "--out", str(tmp_path / "out.png"), "--gpu_memory_gb", "80",
                                      *extra])


class Loaded(Exception):
    """Raised where the real model would load: the preflight has passed."""


def _run_qie_edit(monkeypatch, args):
    from diffsynth_qie.commands import edit
    from diffsynth_qie.inference import editor

    monkeypatch.setattr(editor.Editor, "from_preset", classmethod(lambda *a, **k: (_ for _ in ()).throw(Loaded())))
    with pytest.raises(Loaded):
        edit.run(args)


def test_qie_edits_preflight_attaches_the_lora_file_through_the_manager_and_switches_it(tmp_path, monkeypatch):
    """The user's file (a LoRA of blocks 30 and 31 only, as a partial LoRA is) lands on the two blocks built, through
    `LoraManager.set_loras`, first as read and then switched to another file; its branches on the fake GPU."""
    from safetensors.torch import load_file, save_file

    from diffsynth_qie.lora.manager import LoraManager
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.preflight.lora_files import standin_lora_file

    full = load_file(str(standin_lora_file(get_preset("2511"), tmp_path / "two.safetensors", rank=16, blocks=2)))
    late = {k.replace("transformer_blocks.0.", "transformer_blocks.30.").replace("transformer_blocks.1.",
                                                                                 "transformer_blocks.31."): v
            for k, v in full.items() if k.startswith("transformer_blocks.")}
    save_file(late, str(tmp_path / "late.safetensors"), metadata={"preset": "2511"})
    calls, real = [], LoraManager.set_loras

    def spy(self, loras):
        reports = real(self, loras)
        branches = [b for m in self.model.modules() for b in m._buffers.values()
                    if b is not None and m.__dict__.get("_qie_lora_adapters")]
        calls.append(([str(p) for p, _ in loras], reports, {str(b.device) for b in branches}))
        return reports

    monkeypatch.setattr(LoraManager, "set_loras", spy)
    _run_qie_edit(monkeypatch, _edit_args(tmp_path, tmp_path / "late.safetensors"))
    assert len(calls) == 2 and calls[0][0] != calls[1][0]  # the file, then another file: a switch
    for paths, reports, devices in calls:
        assert paths[0].endswith("late.safetensors")
        modules = reports[0].lora_modules
        assert len(modules) == len(late) // 2 and {m.split(".")[1] for m in modules} == {"0", "1"}
        assert devices == {"cuda:0"}


def test_a_lora_branch_registered_on_the_host_is_caught_by_qie_edits_preflight(tmp_path, monkeypatch):
    """The manager's attach planted to keep the branch on the host (the branch's forward would copy it to the GPU at
    every call): `qie edit` stops before loading, naming the module and both devices."""
    from diffsynth_qie.lora import branch, manager
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.preflight.lora_files import standin_lora_file

    lora = standin_lora_file(get_preset("2511"), tmp_path / "mine.safetensors", rank=16, blocks=2)
    for side in ("A", "B"):
        plant(monkeypatch, branch, "attach", f"lora.{side}.to(device=weight.device, dtype=dtype)",
              f"lora.{side}.to(dtype=dtype)", also=(manager,))
    with pytest.raises(ValueError) as caught:
        _run_qie_edit(monkeypatch, _edit_args(tmp_path, lora))
    line = str(caught.value)
    assert re.search(r"^preflight \(two edits on a fake CUDA device, before loading 2511\): LoRA branch off its "
                     r"layer's device: Editor\.set_loras \(mine\.safetensors\) left the branch of \S+ \(\(\d+, 16\), "
                     r"bfloat16\) on cpu while the layer's weight is on cuda:0", line), line
    assert line.endswith("pass --no_preflight to skip the check") and "\n" not in line
