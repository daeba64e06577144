"""Extracting a LoRA from a fully fine-tuned DiT (``qie extract-lora``).

For every 2-D ``.weight`` that differs between the tuned and the base DiT, the difference
``D = W_tuned - W_base`` (fp32) is factorised by SVD, ``D = U S Vh``, and truncated to rank r:
``B = U_r sqrt(S_r)``, ``A = sqrt(S_r) Vh_r``, so ``B @ A`` is the best rank-r approximation of D
(Eckart-Young). r is either fixed (``rank``) or the smallest rank keeping a fraction
``energy`` of ``sum(S^2)`` (capped by ``rank`` when both are given). Both DiTs are read one
tensor at a time. Differing tensors that are not 2-D weights (biases, norms) cannot be
low-rank factors; they are listed in a warning, or kept as full weights with ``keep_other``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass, field

import torch

from ..models.load.dit_files import resolve_dit
from .state import LoraModule, LoraState, listing

log = logging.getLogger(__name__)


@dataclass
class ExtractReport:
    modules: int = 0
    ranks: dict[str, int] = field(default_factory=dict)
    rel_errors: dict[str, float] = field(default_factory=dict)  # ||D - BA|| / ||D|| per module
    other_changed: list[str] = field(default_factory=list)


def _rank_for(s: torch.Tensor, rank: int | None, energy: float | None) -> int:
    r = int(s.numel())
    if energy is not None:
        power = s.double() ** 2
        kept = torch.cumsum(power, 0) / power.sum()
        r = min(r, int(torch.searchsorted(kept, torch.tensor(energy, dtype=kept.dtype) - 1e-12)) + 1)
    if rank is not None:
        r = min(r, rank)
    return max(r, 1)


def low_rank(delta: torch.Tensor, rank: int | None = None, energy: float | None = None) -> tuple[LoraModule, float]:
    """The rank-r factors of ``delta`` and the relative Frobenius error of ``B @ A``."""
    d = delta.float()
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    r = _rank_for(s, rank, energy)
    root = s[:r].sqrt()
    b, a = u[:, :r] * root, root[:, None] * vh[:r]
    norm = float(s.norm())
    err = float(s[r:].norm()) / norm if norm > 0 else 0.0
    return LoraModule(A=a.contiguous(), B=b.contiguous()), err


def _check_args(rank: int | None, energy: float | None) -> None:
    if rank is None and energy is None:
        raise ValueError("give --rank R or --energy F (e.g. --energy 0.9) to choose the LoRA's rank")
    if rank is not None and rank < 1:
        raise ValueError(f"--rank must be >= 1, got {rank}")
    if energy is not None and not 0 < energy <= 1:
        raise ValueError(f"--energy must be in (0, 1], got {energy}")


@torch.no_grad()
def extract_lora(base: str | os.PathLike, tuned: str | os.PathLike, rank: int | None = None,
                 energy: float | None = None, keep_other: bool = False) -> tuple[LoraState, ExtractReport]:
    """Per-module SVD of ``tuned - base`` (model directories, ``transformer/`` folders or presets)."""
    _check_args(rank, energy)
    base_files, tuned_files = resolve_dit(base), resolve_dit(tuned)
    only_b = sorted(set(base_files.shapes) - set(tuned_files.shapes))
    only_t = sorted(set(tuned_files.shapes) - set(base_files.shapes))
    shape_diff = sorted(k for k in set(base_files.shapes) & set(tuned_files.shapes)
                        if base_files.shapes[k] != tuned_files.shapes[k])
    if only_b or only_t or shape_diff:
        raise ValueError(f"--tuned {tuned} is not a fine-tune of --base {base}: keys only in the base: "
                         f"{listing(only_b) or '-'}; only in the tuned model: {listing(only_t) or '-'}; "
                         f"different shapes: {listing(shape_diff) or '-'}")
    from safetensors import safe_open

    report = ExtractReport()
    modules: dict[str, LoraModule] = {}
    full: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        handles = {p.name: stack.enter_context(safe_open(str(p), framework="pt", device="cpu"))
                   for p in base_files.files}
        for path in tuned_files.files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    b = handles[base_files.key_file[key]].get_tensor(key)
                    if torch.equal(t, b) or not t.is_floating_point():
                        continue
                    if t.ndim == 2 and key.endswith(".weight"):
                        name = key[: -len(".weight")]
                        modules[name], report.rel_errors[name] = low_rank(t.float() - b.float(), rank, energy)
                        report.ranks[name] = modules[name].rank
                    else:
                        report.other_changed.append(key)
                        if keep_other:
                            full[key] = t.clone()
    if not modules and not full:
        raise ValueError(f"--tuned {tuned} has no 2-D weight that differs from --base {base}; nothing to extract")
    if report.other_changed:
        if keep_other:
            log.info("kept %d changed non-matrix tensor(s) as full weights: %s", len(full), listing(list(full)))
        else:
            log.warning("%d changed tensor(s) are not 2-D weights and are not in the LoRA (pass --keep_other to "
                        "store them as full weights): %s", len(report.other_changed), listing(report.other_changed))
    report.modules = len(modules)
    errors = list(report.rel_errors.values())
    if errors:
        log.info("extracted %d module(s), ranks %d-%d, relative error of the delta: mean %.3g, max %.3g",
                 len(modules), min(report.ranks.values()), max(report.ranks.values()),
                 sum(errors) / len(errors), max(errors))
    state = LoraState(modules=modules, full=full, format="diffsynth_qie", source=f"{tuned} - {base}")
    return state, report


def extraction_metadata(base, tuned, rank: int | None, energy: float | None) -> dict:
    return {"extracted_from": {"base": str(base), "tuned": str(tuned)}, "extract_rank": rank,
            "extract_energy": None if energy is None or math.isnan(energy) else energy}
