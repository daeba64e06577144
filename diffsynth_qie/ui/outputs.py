"""What one Generate leaves behind: its files (input, "before", mask, result PNGs), history entries and status line.

``ui/handlers.py`` runs the generation; this module writes what it made and says what happened.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from .history import HistoryEntry
from .job import Job
from .results import EditSettings, qie_edit_command, save_png

if TYPE_CHECKING:
    from ..inference.editor import EditResult


@dataclass
class GenerateOutput:
    image: Image.Image
    sub_image: Image.Image | None    # LBM's sub-stream output; None in flow-matching mode
    seed: int
    status: str
    result: "EditResult"
    entries: list[HistoryEntry] = field(default_factory=list)  # one per variation, first seed first


def save_inputs(folder: Path, job: Job, size: tuple[int, int]) -> tuple[Path, Path, Path | None]:
    """The job's input, the input at the output's ``size`` (the slider's left side) and the mask, written once
    for all its variations: (input, before, mask or None)."""
    folder.mkdir(parents=True, exist_ok=True)
    input_path, before = folder / "input.png", folder / f"before-{size[0]}x{size[1]}.png"
    job.image.save(input_path)
    job.image.resize(size, Image.Resampling.LANCZOS).save(before)
    mask = folder / "mask.png" if job.mask is not None else None
    if mask is not None:
        job.mask.save(mask)
    return input_path, before, mask


def save_entry(folder: Path, job: Job, settings: EditSettings, result: "EditResult", input_path: Path, before: Path,
               mask: Path | None, *, lora_dir: str, model_dir: str | None) -> HistoryEntry:
    """One variation's files (the edit with its settings in the PNG text; LBM's sub-stream) and history entry."""
    sub = save_png(result.sub_image, folder, settings, "_sub") if result.sub_image is not None else None
    command = qie_edit_command(settings, input_path, mask, lora_dir=lora_dir, model_dir=model_dir,
                               lightning_lora=job.lightning_lora)
    return HistoryEntry(image=str(save_png(result.image, folder, settings)), before=str(before), settings=settings,
                        sub_image=str(sub) if sub else None, mask=str(mask) if mask else None, command=command)


def status_line(job: Job, result: "EditResult", seconds: float, waited: float) -> str:
    """The status under Generate: time, seeds, sampler, size, LoRAs, strength and the mask's share of the image."""
    s = job.settings
    n = len(job.seeds)
    seeds = f"seed {s.seed}" if n == 1 else f"seeds {s.seed}–{s.seed + n - 1}"
    parts = [f"Done in {seconds:.1f} s (queue wait {max(waited, 0.0):.1f} s)", seeds, s.sampler(),
             f"{result.image.width}×{result.image.height}"]
    parts += [f"LoRA `{name}` × {scale:g}" for name, scale in s.loras()] or ["no LoRA"]
    if s.strength < 1.0:
        parts.append(f"strength {s.strength:g}")
    if job.mask is None:
        parts.append("no mask painted: the whole image may change")
    else:
        parts.append(f"mask covers {float(np.asarray(job.mask).mean()) / 255.0:.0%} of the image")
    return " · ".join(parts) + "."
