"""Schedules as data: the sampling schedule a LoRA declares, read and written here only.

A few-step (turbo, Lightning) LoRA works only with the schedule it was distilled for, and the lines are
not interchangeable. A LoRA says which one in its safetensors metadata, under :data:`SCHEDULE_KEY`, as JSON:

    {"version": 1, "steps": 6, "cfg": 1.0, "sigmas": [1.0, 0.9375, 0.875, 0.75, 0.5, 0.25]}
    {"version": 1, "steps": 8, "cfg": 1.0, "shift": 3.0}

``sigmas``: the explicit grid (without the final 0), used as given. ``shift``: the constant flow-match
shift ``σ' = s·σ / (1 + (s-1)·σ)`` of the uniform grid, applied once (:meth:`DeclaredSchedule.grid`).
Either way the family's scheduler receives explicit sigmas, so no resolution-dependent shift is added on
top: a declared schedule is never shifted twice. Optional: ``family`` (the model family it is for),
``line`` (the public line's name), ``unmerged`` (true: load it as a branch, do not merge).

Files without the key (the public lines) are recognised by name: :data:`PUBLIC_LINES`, the table
``docs/SCHEDULES.md`` prints. Our trained LoRAs write the schedule they were validated with.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional, Sequence

log = logging.getLogger(__name__)

SCHEDULE_KEY = "qie_schedule"
SCHEDULE_VERSION = 1
_FIELDS = ("version", "steps", "cfg", "sigmas", "shift", "family", "line", "unmerged")


@dataclass(frozen=True)
class DeclaredSchedule:
    """A sampling schedule as data: ``steps``, ``cfg`` and explicit ``sigmas`` or a ``shift``."""

    steps: int
    cfg: float = 1.0
    sigmas: Optional[tuple[float, ...]] = None
    shift: Optional[float] = None
    family: Optional[str] = None
    line: Optional[str] = None
    unmerged: bool = False

    def __post_init__(self):
        where = self.line or "a declared schedule"
        if (self.sigmas is None) == (self.shift is None):
            raise ValueError(f"{where}: give either explicit sigmas or a shift, not {'both' if self.sigmas else 'neither'}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"{where}: steps must be a whole number >= 1, got {self.steps!r}")
        if not (math.isfinite(self.cfg) and self.cfg >= 0):
            raise ValueError(f"{where}: cfg must be a finite number >= 0, got {self.cfg!r}")
        if self.sigmas is not None:
            sig = tuple(float(s) for s in self.sigmas)
            if len(sig) != self.steps or not all(0 < s <= 1 for s in sig) or any(b >= a for a, b in zip(sig, sig[1:])):
                raise ValueError(f"{where}: sigmas must be {self.steps} decreasing values in (0, 1], got {list(sig)}")
            object.__setattr__(self, "sigmas", sig)
        elif not (math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"{where}: shift must be a finite number > 0, got {self.shift!r}")

    def grid(self, steps: Optional[int] = None) -> tuple[float, ...]:
        """The sigmas to sample on (without the final 0): the explicit ones, or the uniform grid of ``steps``
        (default: the declared count) shifted once."""
        if self.sigmas is not None:
            if steps is not None and steps != self.steps:
                raise ValueError(f"{self.describe()} is an explicit grid of {self.steps} sigmas; --steps {steps} belongs "
                                 f"to another schedule: drop --steps (or pass --steps {self.steps})")
            return self.sigmas
        n = self.steps if steps is None else int(steps)
        s = float(self.shift)
        return tuple(s * t / (1 + (s - 1) * t) for t in (1 - k / n for k in range(n)))

    def describe(self) -> str:
        what = (f"{len(self.sigmas)} sigmas {', '.join(f'{s:g}' for s in self.sigmas)}" if self.sigmas is not None
                else f"{self.steps} steps at shift {self.shift:g}")
        return f"{self.line + ': ' if self.line else ''}{what}, CFG {self.cfg:g}"

    def to_json(self) -> dict:
        out = {"version": SCHEDULE_VERSION, "steps": self.steps, "cfg": self.cfg}
        out.update({k: v for k, v in (("sigmas", list(self.sigmas) if self.sigmas else None), ("shift", self.shift),
                                      ("family", self.family), ("line", self.line)) if v is not None})
        if self.unmerged:
            out["unmerged"] = True
        return out

    def to_metadata(self) -> dict[str, str]:
        """The safetensors metadata entry that declares this schedule."""
        return {SCHEDULE_KEY: json.dumps(self.to_json())}


def from_metadata(metadata: Mapping[str, str], source: str = "the LoRA") -> Optional[DeclaredSchedule]:
    """The schedule ``metadata`` declares, or None; a malformed entry is one error naming the file."""
    raw = (metadata or {}).get(SCHEDULE_KEY)
    if not raw:
        return None
    try:
        data = json.loads(raw) if isinstance(raw, str) else raw
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("version") != SCHEDULE_VERSION:
            raise ValueError(f"version {data.get('version')!r} is not {SCHEDULE_VERSION}")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}")
        sigmas = data.get("sigmas")
        return DeclaredSchedule(steps=data["steps"], cfg=float(data.get("cfg", 1.0)),
                                sigmas=None if sigmas is None else tuple(sigmas), shift=data.get("shift"),
                                family=data.get("family"), line=data.get("line"), unmerged=bool(data.get("unmerged")))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{source}: metadata {SCHEDULE_KEY!r} is not a valid schedule ({e}); fix or remove the "
                         f"entry (schema: docs/SCHEDULES.md)") from e


# --- the public lines, by file name ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PublicLine:
    pattern: str                # a regular expression searched in the lower-cased file name
    example: str                # a published file name
    schedule: DeclaredSchedule
    source: str                 # where the schedule is stated


_EDIT, _Q21 = "qwen-image-edit", "qwen-image-2.1"
_TURBO8 = (1.0, 14 / 15, 6 / 7, 10 / 13, 2 / 3, 6 / 11, 0.4, 2 / 9)  # models/presets.py TURBO_SIGMAS
_LIGHTNING = "ModelTC/Qwen-Image-Lightning (shift 3 in distillation; DiffSynth's 'Qwen-Image-Lightning' schedule)"

PUBLIC_LINES: tuple[PublicLine, ...] = (
    PublicLine(r"viggle-turbo.*6[-_]?step", "Qwen-Image-2.1-viggle-turbo-v0.2.1-6step-lora-r128.safetensors",
               DeclaredSchedule(6, 1.0, (1.0, 0.9375, 0.875, 0.75, 0.5, 0.25), family=_Q21,
                                line="Qwen-Image-2.1 viggle-turbo v0.2.1 (6 steps)", unmerged=True),
               "huggingface.co/Viggle/Qwen-Image-2.1-viggle-turbo: load on the base at runtime, do not merge"),
    PublicLine(r"viggle-turbo.*4[-_]?step", "Qwen-Image-2.1-viggle-turbo-4step-lora-r64.safetensors",
               DeclaredSchedule(4, 1.0, (1.0, 0.75, 0.5, 0.25), family=_Q21,
                                line="Qwen-Image-2.1 viggle-turbo v0.1 (4 steps)", unmerged=True),
               "huggingface.co/Viggle/Qwen-Image-2.1-viggle-turbo (4 passes, no CFG); the grid is the uniform "
               "4-step one: the card names no list"),
    PublicLine(r"qwen_image_2\.1_turbo_lora", "qwen_image_2.1_turbo_lora_avg_rank_178_bf16.safetensors",
               DeclaredSchedule(8, 1.0, _TURBO8, family=_Q21, line="Qwen-Image-2.1-Turbo, extracted (8 steps)"),
               "Comfy-Org/Qwen-Image-2.1 (extracted from Qwen-Image-2.1-Turbo: 8 steps, CFG 1); the grid is the "
               "Turbo checkpoint's (the 2.1-turbo preset)"),
    *(PublicLine(rf"{model}-lightning.*{n}[-_ ]?steps?", f"Qwen-Image-Edit-{model[-4:]}-Lightning-{n}steps-V1.0-bf16"
                 ".safetensors", DeclaredSchedule(n, 1.0, shift=3.0, family=_EDIT,
                                                  line=f"Qwen-Image-Edit-{model[-4:]} Lightning ({n} steps)"),
                 _LIGHTNING)
      for model in ("edit-2509", "edit-2511") for n in (4, 8)),
)


def public_line(path: str | os.PathLike) -> Optional[PublicLine]:
    """The public line a file's name belongs to, or None."""
    name = Path(path).name.lower()
    return next((line for line in PUBLIC_LINES if re.search(line.pattern, name)), None)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """A safetensors file's header metadata ({} for another file or an unreadable one: the loader reports it)."""
    if not (str(path).endswith(".safetensors") and Path(path).is_file()):
        return {}
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return dict(f.metadata() or {})
    except Exception:  # (an unreadable file is reported by the LoRA loader, with its name)
        return {}


def declared_schedule(path: str | os.PathLike, metadata: Optional[Mapping[str, str]] = None
                      ) -> tuple[Optional[DeclaredSchedule], str]:
    """(the schedule a LoRA declares, where from: "its metadata" / "the public-line table"), or (None, "")."""
    found = from_metadata(read_metadata(path) if metadata is None else metadata, str(path))
    if found is not None:
        return found, "its metadata"
    line = public_line(path)
    return (line.schedule, "the public-line table (docs/SCHEDULES.md)") if line else (None, "")


def line_family(path: str | os.PathLike, metadata: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The family a LoRA's declared schedule names (a public line's, by file name), or None."""
    schedule, _ = declared_schedule(path, metadata)
    return schedule.family if schedule else None


@dataclass(frozen=True)
class SchedulePlan:
    """What an edit samples with: ``sigmas`` None = the model's own schedule (or Lightning's)."""

    scheduler: str
    steps: int
    cfg: float
    sigmas: Optional[tuple[float, ...]] = None


def plan_schedule(scheduler: str, steps: Optional[int], cfg: Optional[float], lora_paths: Sequence,
                  family: str, default_steps: int, default_cfg: float,
                  headers: Optional[Mapping[str, Mapping[str, str]]] = None) -> SchedulePlan:
    """The schedule of an edit with ``lora_paths``: a declared one (metadata, else the public-line table) unless
    ``scheduler`` is given explicitly; ``steps`` / ``cfg`` given by the user override it (said in one line).
    Two LoRAs declaring different schedules, or one declared for another family, are refused in one line.
    ``headers``: the files' metadata by path where the caller has read it already (the rest is read here)."""
    from .lightning import is_lightning_lora, sampling_plan

    headers = headers or {}
    declared = [(p, *declared_schedule(p, headers.get(p))) for p in map(str, lora_paths)]
    declared = [(p, s, where) for p, s, where in declared if s is not None]
    for path, schedule, _ in declared:
        if schedule.family is not None and schedule.family != family:
            raise ValueError(f"LoRA {path} is {schedule.line or 'declared'} for {schedule.family}, but this model is "
                             f"{family}: pick a {family} LoRA (or the matching --model)")
    # (a Lightning file known only by its name keeps the Lightning scheduler: the same grid, tests pin it, and
    # it also starts part-way for --strength)
    declared = [d for d in declared if not (d[2] != "its metadata" and is_lightning_lora(d[0], headers.get(d[0])))]
    if scheduler != "auto" or not declared:
        return SchedulePlan(*sampling_plan(scheduler, steps, cfg, lora_paths, default_steps, default_cfg))
    path, schedule, where = declared[0]
    for other, theirs, _ in declared[1:]:
        if replace(theirs, line=None, unmerged=False) != replace(schedule, line=None, unmerged=False):
            raise ValueError(f"LoRA {path} declares {schedule.describe()} but LoRA {other} declares "
                             f"{theirs.describe()}: they belong to different few-step lines; use one of them")
    grid = schedule.grid(steps)
    used_cfg = schedule.cfg if cfg is None else float(cfg)
    overrides = [f"--{k} {v:g}" for k, v, mine in (("steps", steps, schedule.steps), ("cfg", cfg, schedule.cfg))
                 if v is not None and v != mine]
    log.info("LoRA %s declares its schedule (%s; from %s): using it%s (--scheduler default to ignore it)",
             Path(path).name, schedule.describe(), where,
             f", with {' and '.join(overrides)} as given" if overrides else "")
    return SchedulePlan("default", len(grid), used_cfg, grid)


def table_markdown() -> str:
    """The table of :data:`PUBLIC_LINES` for ``docs/SCHEDULES.md``."""
    rows = ["| file name (example) | family | steps | sigmas / shift | CFG | load | source |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for line in PUBLIC_LINES:
        s = line.schedule
        grid = ", ".join(f"{v:.4g}" for v in s.sigmas) if s.sigmas is not None else f"shift {s.shift:g}"
        rows.append(f"| `{line.example}` | {s.family} | {s.steps} | {grid} | {s.cfg:g} | "
                    f"{'unmerged only' if s.unmerged else 'merged or unmerged'} | {line.source} |")
    return "\n".join(rows)
