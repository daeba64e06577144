"""Finding the checkpoint to resume from, and recovering from damaged or interrupted ones.

The on-disk names of a checkpoint (``checkpoint.py`` documents the layout and writes it), its
``trainer_state.json`` (:class:`TrainerState`), the complete checkpoints of an output directory,
``--resume`` resolution (``latest`` skips damaged checkpoints, naming the damaged file), cheap damage
checks that load no tensor, and the clean-up of what killed writes left behind.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..utils.atomic import finished_files, temp_leftovers
from ..utils.integrity import safetensors_problem, state_file_problem
from .data import DataPosition

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PREFIX = "checkpoint-"
LORA_NAME = "lora.safetensors"
TRAINABLE_NAME = "trainable.safetensors"
STATE_DIR = "state"
TRAINER_STATE = "trainer_state.json"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class TrainerState:
    """The loop's own resumable state (optimizer & co. live in ``state/``)."""

    step: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    seed: int = 0
    world_size: int = 1
    batch_size: int = 1
    gradient_accumulation_steps: int = 1
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format_version": FORMAT_VERSION, "step": self.step, "position": self.position.to_json(),
                "seed": self.seed, "world_size": self.world_size, "batch_size": self.batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps, **self.extra}

    @classmethod
    def from_json(cls, d: dict) -> "TrainerState":
        known = {"format_version", "step", "position", "seed", "world_size", "batch_size", "gradient_accumulation_steps"}
        return cls(step=int(d["step"]), position=DataPosition.from_json(d["position"]), seed=int(d["seed"]),
                   world_size=int(d["world_size"]), batch_size=int(d["batch_size"]),
                   gradient_accumulation_steps=int(d["gradient_accumulation_steps"]),
                   extra={k: v for k, v in d.items() if k not in known})


# --- finding checkpoints --------------------------------------------------------------
_ASIDE_RE = re.compile(r"^\.checkpoint-(\d+)\.old$")


def remove_leftovers(output_dir: str | os.PathLike) -> list[Path]:
    """Delete what killed writes left in ``output_dir``: temp files (``.lora.*.tmp.safetensors``
    and the like) and unfinished ``.checkpoint-<step>.tmp``/``.old`` directories.

    Call it on the main process when a run starts, before anything is written. Finished
    files and ``checkpoint-*`` directories are never touched. Returns what was removed.
    """
    out = Path(output_dir)
    _recover_swapped(out)
    stale = temp_leftovers(out) + [p for p in finished_files(out, ".checkpoint-*") if _ASIDE_RE.match(p.name)]
    for p in stale:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if stale:
        log.info("removed %d leftover(s) of an interrupted run from %s: %s", len(stale), out,
                 ", ".join(p.name for p in stale[:5]))
    return stale


def _recover_swapped(out: Path) -> None:
    """A save of an already existing step killed between its two renames leaves no
    ``checkpoint-<step>``: put back the complete new one (or else the old one)."""
    for aside in finished_files(out, ".checkpoint-*"):
        m = _ASIDE_RE.match(aside.name)
        final = out / f"{PREFIX}{m.group(1)}" if m else None
        if final is None or final.exists():
            continue
        new = out / f".{PREFIX}{m.group(1)}.tmp"
        chosen = new if (new / TRAINER_STATE).is_file() else aside
        os.replace(chosen, final)
        log.warning("restored %s from %s (a save was interrupted)", final, chosen.name)


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    out = Path(output_dir)
    found = []
    for p in finished_files(out, f"{PREFIX}*"):
        m = _CKPT_RE.match(p.name)
        if m and (p / TRAINER_STATE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def resolve_resume(resume: Optional[str], output_dir: str | os.PathLike) -> Optional[Path]:
    """The checkpoint directory ``--resume`` names; ``latest`` with none yet means a fresh start.

    ``latest`` skips damaged checkpoints (:func:`checkpoint_problem`) with a warning naming
    the damaged file and takes the newest intact one; a named checkpoint must be intact.
    """
    if not resume:
        return None
    if resume == "latest":
        found = list_checkpoints(output_dir)
        damaged = [f"{p / TRAINER_STATE} is missing" for p in _incomplete_checkpoints(output_dir, found)]
        for problem in damaged:
            log.warning("--resume latest: skipping damaged checkpoint: %s", problem)
        if not found and not damaged:
            log.info("--resume latest: no checkpoint in %s yet, starting from step 0", output_dir)
            return None
        for ckpt in reversed(found):
            problem = checkpoint_problem(ckpt)
            if problem is None:
                return ckpt
            damaged.append(problem)
            log.warning("--resume latest: skipping damaged checkpoint %s: %s", ckpt, problem)
        raise ValueError(f"--resume latest: every checkpoint in {output_dir} is damaged ({'; '.join(damaged)}); "
                         f"resume from an intact copy with --resume DIR, or start again without --resume")
    path = Path(resume)
    if not (path / TRAINER_STATE).is_file():
        raise ValueError(f"--resume {resume}: not a complete checkpoint (no {TRAINER_STATE}); give a "
                         f"{PREFIX}<step> directory or 'latest'")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"--resume {resume}: damaged checkpoint: {problem}; give another {PREFIX}<step> "
                         "directory or 'latest' (which skips damaged ones)")
    return path


def _incomplete_checkpoints(output_dir: str | os.PathLike, found: list[Path]) -> list[Path]:
    """``checkpoint-<step>`` directories without a trainer state (damaged, or copied
    incompletely) newer than the newest complete one: resuming silently from an older
    checkpoint would lose their steps unannounced. Older ones are what an interrupted
    pruning of old checkpoints leaves and are not reported."""
    newest = int(_CKPT_RE.match(found[-1].name).group(1)) if found else -1
    out = []
    for p in finished_files(output_dir, f"{PREFIX}*"):
        m = _CKPT_RE.match(p.name)
        if m and p.is_dir() and int(m.group(1)) > newest and not (p / TRAINER_STATE).is_file():
            out.append((int(m.group(1)), p))
    return [p for _, p in sorted(out, reverse=True)]


# --- validating checkpoints -----------------------------------------------------------
def checkpoint_problem(ckpt: str | os.PathLike) -> Optional[str]:
    """What is wrong with checkpoint directory ``ckpt`` (naming the file), or None if intact.

    Cheap checks, no tensor is loaded: ``trainer_state.json`` parses and has this
    version's fields; the LoRA and the trainable tensors (not written under DeepSpeed,
    whose engine checkpoint holds them) have readable safetensors headers and all the
    bytes those headers promise; ``state/`` holds the optimizer state and no empty
    file; torch's zip files there are not truncated.
    """
    ckpt = Path(ckpt)
    try:
        read_trainer_state(ckpt)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{ckpt / TRAINER_STATE} is unreadable ({type(e).__name__}: {e})"
    state = ckpt / STATE_DIR
    if not state.is_dir():
        return f"{state} is missing"
    engine = any(p.is_dir() for p in state.iterdir())  # DeepSpeed writes its engine checkpoint as a folder
    files = [p for p in state.rglob("*") if p.is_file()]
    for need in [ckpt / LORA_NAME] + ([] if engine else [ckpt / TRAINABLE_NAME]):
        problem = safetensors_problem(need)
        if problem:
            return problem
    if not engine and not (state / "optimizer.bin").is_file():
        return f"{state / 'optimizer.bin'} (the optimizer state) is missing"
    if engine and not any("optim" in p.name for p in files):
        return f"{state} holds no optimizer state"
    for f in files:
        problem = state_file_problem(f)
        if problem:
            return problem
    return None


def read_trainer_state(ckpt: str | os.PathLike) -> TrainerState:
    data = json.loads((Path(ckpt) / TRAINER_STATE).read_text())
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{ckpt}: checkpoint format_version {data.get('format_version')!r}, this version "
                         f"reads {FORMAT_VERSION}; resume with the diffsynth-qie version that wrote it")
    return TrainerState.from_json(data)

