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


@dataclass(frozen=True)
class SavedInputs:
    """The files of a job's inputs, written once for all its variations."""

    input: Path                  # the image edited
    before: Path                 # the input at the output's size (the slider's left side)
    mask: Path | None
    references: tuple[Path, ...] = ()
    mask_source: Path | None = None  # paint and mask file before invert and grow: restored as the mask file


def save_inputs(folder: Path, job: Job, size: tuple[int, int]) -> SavedInputs:
    """The job's input, the input at the output's ``size``, the mask and the reference images, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    input_path, before = folder / "input.png", folder / f"before-{size[0]}x{size[1]}.png"
    job.image.save(input_path)
    job.image.resize(size, Image.Resampling.LANCZOS).save(before)
    mask = folder / "mask.png" if job.mask is not None else None
    if mask is not None:
        job.mask.save(mask)
    references = tuple(folder / f"reference-{i}.png" for i in range(1, len(job.references) + 1))
    for image, path in zip(job.references, references):
        image.save(path)
    source = folder / "mask-source.png" if job.mask_source is not None else None
    if source is not None:
        job.mask_source.save(source)
    return SavedInputs(input_path, before, mask, references, source)


def save_entry(folder: Path, job: Job, settings: EditSettings, result: "EditResult", saved: SavedInputs, *,
               lora_dir: str, model_dir: str | None) -> HistoryEntry:
    """One variation's files (the edit with its settings, reference images and command in the PNG text; LBM's
    sub-stream) and history entry."""
    command = qie_edit_command(settings, saved.input, saved.mask, lora_dir=lora_dir, model_dir=model_dir,
                               lightning_lora=job.lightning_lora, references=saved.references)
    refs = [str(p) for p in saved.references]
    files = {"image": str(saved.input), "mask": str(saved.mask_source) if saved.mask_source else None,
             "references": refs}
    sub = (save_png(result.sub_image, folder, settings, "_sub", files, command)
           if result.sub_image is not None else None)
    return HistoryEntry(image=str(save_png(result.image, folder, settings, files=files, command=command)),
                        before=str(saved.before), settings=settings, sub_image=str(sub) if sub else None,
                        mask=str(saved.mask) if saved.mask else None, command=command,
                        input=str(saved.input), references=tuple(refs),
                        mask_source=str(saved.mask_source) if saved.mask_source else None)


def size_notice(given: tuple[int, int], made: tuple[int, int], asked: int) -> str:
    """Why the output's size is not the input's: a W×H the user asked for, or the automatic size."""
    why = "the width and height asked for" if asked else "automatic: fitted to about 1 MP, sides multiples of 16"
    return f" (the input is {given[0]}×{given[1]}; {why})"


def status_line(job: Job, result: "EditResult", seconds: float, waited: float, made: int | None = None) -> str:
    """The status under Generate: time, seeds, sampler, size, LoRAs, references, strength and the mask's share of
    the image (``made``: the variations made, when a Stop ended the run early)."""
    s = job.settings
    n = made or len(job.seeds)
    seeds = f"seed {s.seed}" if n == 1 else f"seeds {s.seed}–{s.seed + n - 1}"
    size = result.image.size
    parts = [f"Done in {seconds:.1f} s (queue wait {max(waited, 0.0):.1f} s)", seeds, s.sampler(),
             f"{size[0]}×{size[1]}" + ("" if size == job.image.size else size_notice(job.image.size, size, s.width))]
    parts += [f"LoRA `{name}` × {scale:g}" for name, scale in s.loras()] or ["no LoRA"]
    if job.references:
        parts.append(f"{len(job.references)} reference image{'s' if len(job.references) > 1 else ''}")
    if s.strength < 1.0:
        parts.append(f"strength {s.strength:g}")
    if job.mask is None:
        parts.append("no mask painted: the whole image may change")
    else:
        parts.append(f"mask covers {float(np.asarray(job.mask).mean()) / 255.0:.0%} of the image")
    return " · ".join(parts) + "."
