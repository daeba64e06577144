"""The user's LoRA path and the UI's loop in ``qie edit``'s preflight (``edit_step.py``).

- **LoRAs.** Each ``--lora`` file, cut to the blocks the fake run builds (``lora_files.first_blocks_file``: the
  file's own keys, dtypes, ranks and metadata), is attached by ``Editor.set_loras``, the call ``qie edit`` and the
  UI make: ``LoraManager`` reads the file on the host, matches it against the DiT and attaches its branches to the
  DiT already on the (fake) GPU. Every branch must then sit where its layer's weight is
  (``lora_files.check_branches``).
- **The UI's loop.** After the first edit the LoRAs are switched to other files (copies of the same, so the manager
  clears the first set and attaches the second, as when a user picks another LoRA), and a second edit runs with the
  next seed, as the UI's next variation. Device memory still held after it beyond what the first edit left is a
  leak, named by the line that allocated it (``fakegpu/growth.py``).
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Sequence

from ..fakegpu.growth import check_growth, settled
from .lora_files import check_branches, first_blocks_file


def lora_pairs(load, blocks: int, folder: Path) -> list[tuple[str, float]]:
    """(the copy of each ``load.lora_paths`` file cut to ``blocks`` blocks, its scale), in order."""
    scales = list(load.lora_scales) or [1.0] * len(load.lora_paths)
    return [(str(first_blocks_file(path, blocks, folder / str(i))), float(scale))
            for i, (path, scale) in enumerate(zip(load.lora_paths, scales))]


def set_loras(editor, loras: Sequence[tuple[str, float]]) -> int:
    """``editor.set_loras(loras)`` and the branches' placement checked; returns the unmerged branches attached."""
    reports = editor.set_loras(loras)
    check_branches(editor.pipe.dit, f"Editor.set_loras ({', '.join(Path(p).name for p, _ in loras)})")
    return 0 if editor.lora_merge else sum(len(r.lora_modules) for r in reports)


def edit_again(editor, request, loras: Sequence[tuple[str, float]], fc, folder: Path) -> int:
    """The UI's next generation after ``request``'s edit: the LoRAs switched to copies of their files, then an edit
    with the next seed (:func:`next_request`); raises ``FakeRunError`` when more device memory is held after it
    than after the first. Returns the edits run in the session (2)."""
    before = settled(fc.memory)
    if loras:
        switched = []
        for i, (path, scale) in enumerate(loras):
            (folder / str(i)).mkdir(parents=True)
            switched.append((shutil.copy(path, folder / str(i)), scale))
        set_loras(editor, switched)
    editor.language_model_runs = False  # (the prompt stand-in's pass is transformers' transient, shown in edit 1)
    try:
        with fc.uncounted(), fc.phase("edit again"):
            editor.edit(next_request(request, editor.preset))
    finally:
        editor.language_model_runs = True
    check_growth(before, settled(fc.memory), "edit 2", "edit 1")
    return 2


def next_request(request, preset=None):
    """The request with the next seed (the UI's next variation); one denoising step where the schedule allows it
    (the default flow-matching schedule from the full strength, no fixed grid): every step runs the same code,
    and the edit only has to show what it leaves behind."""
    request = dataclasses.replace(request, seed=int(request.seed) + 1)
    if (request.steps or 0) > 1 and request.lbm_steps is None and request.scheduler != "lightning" \
            and not request.sigmas and not getattr(preset, "sigmas", None) and request.strength >= 1.0:
        request = dataclasses.replace(request, steps=1)
    return request
