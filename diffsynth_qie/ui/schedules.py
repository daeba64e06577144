"""What a picked LoRA says about how to run it, read from its file (``qie edit`` reads the same):

- **a declared schedule** (``qie_schedule`` metadata, else the public-line table by file name): flow matching uses
  it unless the user overrides it, as ``qie edit --scheduler auto`` does (:func:`declared`, :func:`job_sigmas`);
- **the frozen LoRA it was trained on top of** (``qie_trained_on``): offered for stacking, with its scale, when the
  file is still in the LoRA folder (:func:`stack_offer`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .lora_picker import LoraFolder
from .uploads import UIError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Declared:
    """The schedule that the LoRA ``name`` declares (``where``: its metadata or the public-line table)."""

    name: str
    schedule: object  # models.samplers.declared.DeclaredSchedule
    where: str

    @property
    def steps(self) -> int:
        return int(self.schedule.steps)

    @property
    def cfg(self) -> float:
        return float(self.schedule.cfg)

    def note(self) -> str:
        """The status line: which steps, CFG and sigmas flow matching uses with this LoRA."""
        s = self.schedule
        grid = (f"its {len(s.sigmas)} sigmas {', '.join(f'{v:g}' for v in s.sigmas)}" if s.sigmas is not None
                else f"{s.steps} steps at shift {s.shift:g}")
        change = "CFG may be changed" if s.sigmas is not None else "Steps and CFG may be changed"
        return (f"`{Path(self.name).name}` declares its schedule ({f'{s.line}; ' if s.line else ''}from {self.where}):"
                f" flow matching uses {grid} at CFG {s.cfg:g} (Steps and CFG are set to it; {change}).")


def declared(folder: LoraFolder, names: Sequence[str | None], model: str) -> Declared | None:
    """The schedule the LoRAs ``names`` (inside ``folder``) declare for flow matching on ``model``, or None.

    The rules are ``qie edit --scheduler auto``'s: a schedule declared for the other family, or two LoRAs declaring
    different ones, are refused (UIError naming the files); a Lightning file known only by its name is left to the
    Lightning sampler."""
    from ..models.presets import family_of, get_preset
    from ..models.samplers.declared import declared_schedule, plan_schedule
    from ..models.samplers.lightning import is_lightning_lora

    paths = [(n, folder.resolve(n)) for n in names if n]
    paths = [(n, p) for n, p in paths if p is not None]
    headers = {str(p): folder.metadata(n) for n, p in paths}
    try:
        found = [(n, p, *declared_schedule(p, headers[str(p)])) for n, p in paths]
    except ValueError as exc:  # a malformed qie_schedule entry
        raise UIError(str(exc)) from None
    found = [(n, s, w) for n, p, s, w in found
             if s is not None and not (w != "its metadata" and is_lightning_lora(p, headers[str(p)]))]
    if not found:
        return None
    preset, family = get_preset(model), family_of(model)
    try:  # the family and agreement checks, in qie edit's words
        plan_schedule("auto", None, None, [str(p) for _, p in paths], family.name,
                      default_steps=len(preset.sigmas) if preset.sigmas else family.default_steps,
                      default_cfg=family.default_cfg, headers=headers)
    except ValueError as exc:
        raise UIError(str(exc)) from None
    return Declared(*found[0])


def job_sigmas(found: Declared | None, steps: int) -> tuple[float, ...] | None:
    """The grid a flow-matching job samples on with ``steps``: the declared one (an explicit grid takes only its
    own step count, as in ``qie edit``; a shift schedule is shifted once at any count), or None without one."""
    if found is None:
        return None
    s = found.schedule
    if s.sigmas is not None and steps != s.steps:
        raise UIError(f"`{Path(found.name).name}` declares an explicit grid of {s.steps} sigmas; Steps {steps} "
                      f"belongs to another schedule: set Steps to {s.steps} (or pick another LoRA)")
    return tuple(s.grid(steps))


@dataclass(frozen=True)
class StackOffer:
    """The frozen LoRA a picked LoRA was trained on top of: ``name`` in the LoRA folder (None: not there)."""

    file: str
    scale: float
    name: str | None
    where: str  # the path training recorded

    def note(self, trained: str) -> str:
        head = f"`{Path(trained).name}` was trained on top of `{self.file}` (scale {self.scale:g})"
        if self.name is not None:
            return f"{head}: press **Stack with {self.file}** to add it as the second LoRA."
        if self.where and Path(self.where).is_file():
            return (f"{head}, which is outside the LoRA folder: copy `{self.where}` into it to stack the two here, "
                    f"or add `--lora {self.where} --lora_scale {self.scale:g}` to `qie edit`.")
        return f"{head}, which is no longer at `{self.where or self.file}`: results may be weaker without it."


def stack_offer(folder: LoraFolder, name: str | None, others: Sequence[str | None] = ()) -> StackOffer | None:
    """What ``name`` (in ``folder``) was trained on top of, when it is not already among ``others`` (the other
    picked LoRAs)."""
    from ..lora.frozen import trained_on

    path = folder.resolve(name) if name else None
    base = trained_on(folder.metadata(name)) if path is not None else None
    if base is None or base["file"] in {Path(o).name for o in others if o}:
        return None
    root = folder.root.resolve()
    listed = folder.names()
    recorded = Path(str(base.get("path") or ""))
    inside = (recorded.resolve().relative_to(root).as_posix()
              if base.get("path") and recorded.is_file() and recorded.resolve().is_relative_to(root) else None)
    same_name = [n for n in listed if Path(n).name == base["file"] and n != name]
    found = inside if inside in listed else (same_name[0] if same_name else None)
    return StackOffer(file=base["file"], scale=float(base.get("scale", 1.0)), name=found, where=str(base.get("path") or ""))
