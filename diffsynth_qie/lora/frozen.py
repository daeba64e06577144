"""A frozen LoRA under training (``qie train --frozen_lora FILE``): a task LoRA trained on top of a turbo or
Lightning LoRA, so the two keep working stacked.

The frozen LoRA is attached as unmerged branches (``branch.py``): its ``A``/``B`` are non-persistent buffers,
so they never get gradients, never reach the optimizer and never appear in a checkpoint or in the trained
file; the base weights are not written. Full-weight entries (a few extracted turbo LoRAs carry some) are
merged into the frozen base, which is never saved either. The trained LoRA's metadata records what it was
trained on (:data:`TRAINED_ON_KEY`); ``qie edit`` and the UI read it back (:func:`stack_hint`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch

log = logging.getLogger(__name__)

TRAINED_ON_KEY = "qie_trained_on"


@dataclass(frozen=True)
class FrozenLora:
    """What a run trains on top of: the file, its scale, content hash and declared schedule (or None)."""

    path: str
    scale: float
    sha256: str
    schedule: Optional[object] = None  # models.samplers.declared.DeclaredSchedule

    def metadata(self) -> dict[str, str]:
        return {TRAINED_ON_KEY: json.dumps({"file": Path(self.path).name, "path": str(Path(self.path).resolve()),
                                            "scale": self.scale, "sha256": self.sha256})}


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_frozen_family(path: str, metadata: Mapping[str, str], family: Optional[str]) -> None:
    """``--frozen_lora`` of another family (by its ``preset`` metadata or its public line), in one line."""
    from ..models.samplers.declared import line_family
    from .manager import lora_family

    trained = lora_family(metadata) or line_family(path, metadata)
    if family is not None and trained is not None and trained != family:
        raise ValueError(f"--frozen_lora {path} is for {trained}, but --model is {family}: pass a {family} LoRA "
                         "(or the --model of its family)")


@torch.no_grad()
def attach_frozen(model: torch.nn.Module, path: str | os.PathLike, scale: float = 1.0,
                  family: Optional[str] = None) -> FrozenLora:
    """Attach ``path`` to ``model`` as frozen unmerged branches (before PEFT injects the trainable LoRA: PEFT then
    wraps the branched linears as its ``base_layer``s, hooks and buffers included)."""
    from ..models.samplers.declared import declared_schedule
    from .apply import match_lora, merge_matched
    from .branch import attach
    from .formats import load_lora_state

    path = str(path)
    if not Path(path).is_file():
        raise ValueError(f"--frozen_lora {path} is not a file; give the path of a .safetensors LoRA")
    state = load_lora_state(path)
    check_frozen_family(path, state.metadata, family)
    state = match_lora(model, state)
    modules = dict(model.named_modules())
    if state.full:
        merge_matched(model, replace(state, modules={}), scale)
    for name, mod in state.modules.items():
        attach(modules[name], mod, scale)
    schedule, where = declared_schedule(path, state.metadata)
    log.info("frozen LoRA %s attached unmerged at scale %g (%d modules%s)", path, scale, len(state.modules),
             f"; its schedule from {where}: {schedule.describe()}" if schedule else "")
    return FrozenLora(path=path, scale=float(scale), sha256=file_sha256(path), schedule=schedule)


def trained_on(metadata: Mapping[str, str]) -> Optional[dict]:
    """What a LoRA of ours was trained on top of ({"file", "path", "scale", "sha256"}), or None."""
    raw = (metadata or {}).get(TRAINED_ON_KEY)
    try:
        found = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return None
    return found if isinstance(found, dict) and "file" in found else None


def stack_hint(lora_paths: Sequence[str | os.PathLike]) -> list[tuple[str, float]]:
    """For each LoRA trained on top of a frozen one that is not among ``lora_paths``: log the flags that stack
    them, and return (the frozen file where it still is, its scale) pairs."""
    from ..models.samplers.declared import read_metadata

    names = {Path(p).name for p in lora_paths}
    offers = []
    for p in lora_paths:
        base = trained_on(read_metadata(p))
        if base is None or base["file"] in names:
            continue
        where = base.get("path") if base.get("path") and Path(base["path"]).is_file() else base["file"]
        offers.append((where, float(base.get("scale", 1.0))))
        log.info("LoRA %s was trained on top of %s (scale %g): add --lora %s --lora_scale %g to stack them",
                 Path(p).name, base["file"], base.get("scale", 1.0), where, base.get("scale", 1.0))
    return offers
