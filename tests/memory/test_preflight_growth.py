"""Growth across steps: the preflights repeat their unit of work on other samples and fail when device memory is still
held after the last beyond what the one before left, naming the lines that allocated it and the object that holds it.

`qie train`'s preflight runs three steps on other rows (the on-the-fly store encoding each first); `qie edit`'s runs
two edits, the LoRAs switched between them (the UI's loop). Each leak is planted in a copy of our code; the tiny
preset runs the same preflight code as the full-size ones (tests/memory/test_verify_edit_readme.py: no false alarm
on the README's full-size commands; test_verify_train_options.py: on the launchers').
"""
from __future__ import annotations

import inspect
import os
import re

import pytest
from PIL import Image

from edit_planting import PACKAGE_ROOT, plant
from test_verify_onthefly_compile import on_the_fly
from test_verify_train_options import run_config

GROWS = r"device memory grows from one {unit} to the next: after {unit} {n} [\d.]+ MiB more is held than after {unit} {m}"
ALLOCATED = r"allocated at diffsynth_qie/\S+\.py:\d+ \(\w+\) \(\+[\d.]+ MiB\)"


def _class_line(cls) -> str:
    return f"{os.path.relpath(inspect.getsourcefile(cls), PACKAGE_ROOT)}:{inspect.getsourcelines(cls)[1]}"


def test_each_step_after_the_first_takes_other_rows_whose_sizes_an_earlier_step_took():
    from diffsynth_qie.preflight.train_batch import batch_shapes, step_rows

    shapes = batch_shapes(1024, 1, 300, 2, mixed=True, multiple=32)
    second, third = step_rows(shapes, 1, 32), step_rows(shapes, 2, 32)
    assert third == shapes and all(s != t for s, t in zip(second, shapes))
    assert all(s.height % 32 == 0 and s.width % 32 == 0 and s.prompt_tokens < t.prompt_tokens
               for s, t in zip(second, shapes))
    assert abs(second[0].height * second[0].width / (1024 * 1024) - 1) < 0.05  # about the same pixels, 4:3 turned


def test_an_on_the_fly_store_that_keeps_every_entry_on_the_gpu_is_caught_by_qie_trains_preflight(monkeypatch):
    """One step passes; from the second on, each step's encoded sample stays on the device: named by the lines
    that allocated it and by the store's attribute that holds it."""
    from diffsynth_qie.cache import live
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.preflight.train import preflight

    plant(monkeypatch, live.LiveStore, "load", "return entry",
          "self.__dict__.setdefault('_entries', {})[i] = entry; return entry")  # "so a second epoch is free"
    with pytest.raises(ValueError) as caught:
        preflight(on_the_fly(run_config(model="tiny"), max_pixels=512 * 512), get_preset("tiny"), gpu_memory_gb=80)
    line = str(caught.value)
    assert line.startswith("preflight (training steps on a fake CUDA device, before loading tiny): ")
    assert re.search(GROWS.format(unit="step", n=3, m=2) + ", " + ALLOCATED, line), line
    assert f"held by LiveStore._entries ({_class_line(live.LiveStore)})" in line, line
    assert line.endswith("pass --no_preflight to skip the check") and "\n" not in line


def _edit(tmp_path, **load):
    from diffsynth_qie.inference.editor import EditRequest
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.preflight.edit import preflight
    from diffsynth_qie.preflight.edit_step import EditLoad
    from diffsynth_qie.preflight.lora_files import standin_lora_file

    lora = standin_lora_file(get_preset("tiny"), tmp_path / "mine.safetensors", rank=4, blocks=2)
    request = EditRequest(images=[Image.new("RGB", (512, 384))], prompt="make the sky pink", steps=40, cfg=4.0)
    return preflight("tiny", request, EditLoad(lora_ranks=(4,), lora_paths=(str(lora),), **load), gpu_memory_gb=80)


def test_an_editor_that_keeps_each_result_on_the_gpu_is_caught_by_qie_edits_preflight(tmp_path, monkeypatch):
    from diffsynth_qie.inference import editor

    plant(monkeypatch, editor.Editor, "edit", "del cond, prompt_emb",
          "self.__dict__.setdefault('_results', []).append(latents); del cond, prompt_emb")
    with pytest.raises(ValueError) as caught:
        _edit(tmp_path)
    line = str(caught.value)
    assert line.startswith("preflight (two edits on a fake CUDA device, before loading tiny): ")
    assert re.search(GROWS.format(unit="edit", n=2, m=1) + ", " + ALLOCATED, line), line
    assert f"held by Editor._results ({_class_line(editor.Editor)})" in line, line


def test_a_lora_switch_that_leaves_the_old_branches_is_caught_at_the_line_that_made_them(tmp_path, monkeypatch):
    """The LoRA manager's switch planted to forget detaching the branches it replaces: after the second edit both
    sets are held, allocated where the branches are registered."""
    from diffsynth_qie.lora import branch, manager

    plant(monkeypatch, manager.LoraManager, "clear", "detach_all(module)", "pass")
    with pytest.raises(ValueError) as caught:
        _edit(tmp_path)
    registered = [f"{os.path.relpath(inspect.getsourcefile(branch), PACKAGE_ROOT)}:{n}"
                  for n, text in enumerate(inspect.getsource(branch).splitlines(), 1) if "register_buffer(" in text]
    assert re.search(GROWS.format(unit="edit", n=2, m=1), str(caught.value))
    assert len(registered) == 2 and all(f"{where} (attach)" in str(caught.value) for where in registered), \
        str(caught.value)
