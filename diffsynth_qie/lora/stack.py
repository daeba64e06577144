"""Two LoRAs as one file (``qie train --loss dmd --merge_teacher``): their deltas add, ``ΔW = s₁B₁A₁ + s₂B₂A₂``.

Per module the low-rank pairs are concatenated along the rank, each ``A`` with its own scale (its ``alpha /
rank`` times the user scale) folded in, so the stacked file needs no alpha and any runtime that loads a plain LoRA
loads it: a module in one LoRA only keeps its pair. Full weights are absolute values, not deltas: a full weight in
both is refused. The written file keeps the second LoRA's metadata (the student's declared schedule) and names
the first (``qie_stacked_on``) instead of asking to stack it (``qie_trained_on`` is dropped).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch

from .state import LoraModule, LoraState

STACKED_KEY = "qie_stacked_on"


def _folded(mod: LoraModule, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (mod.A.float() * (mod.scale * scale)), mod.B.float()


def stack_states(states: Sequence[tuple[LoraState, float]]) -> LoraState:
    """One :class:`LoraState` whose delta is the sum of ``states``' deltas (each at its scale)."""
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    full: dict[str, torch.Tensor] = {}
    for state, scale in states:
        for name, mod in state.modules.items():
            pairs.setdefault(name, []).append(_folded(mod, scale))
        both = sorted(set(full) & set(state.full))
        if both:
            raise ValueError(f"both LoRAs train {both[:3]} fully; full weights do not add, so they cannot be "
                             "stacked into one file: load the two LoRAs together instead")
        full.update(state.full)
    modules = {name: LoraModule(A=torch.cat([a for a, _ in p]), B=torch.cat([b for _, b in p], dim=1))
               for name, p in pairs.items()}
    return LoraState(modules=modules, full=full, metadata=dict(states[-1][0].metadata), source="stacked")


def stack_files(first: str | os.PathLike, second: str | os.PathLike, out: str | os.PathLike,
                first_scale: float = 1.0) -> Path:
    """``out``: ``first`` (at ``first_scale``) and ``second`` stacked (see the module docstring), written
    atomically in the canonical format."""
    from .export import save_lora
    from .formats import load_lora_state
    from .frozen import TRAINED_ON_KEY

    a, b = load_lora_state(first), load_lora_state(second)
    stacked = stack_states([(a, first_scale), (b, 1.0)])
    metadata = {k: v for k, v in b.metadata.items() if k != TRAINED_ON_KEY}
    metadata[STACKED_KEY] = json.dumps({"file": Path(first).name, "scale": first_scale})
    for key in ("rank", "alpha"):  # the stacked ranks differ from the run's; each pair's scale is folded in
        metadata.pop(key, None)
    return save_lora(out, stacked, metadata=metadata)
