"""The preflight of ``--checkpoint_blocks N`` with 0 < N < L: N checkpointed and L - N plain blocks from three runs.

The runs at two depths (``train.py``) give one block's share by their difference, but a shallow DiT cannot hold
N checkpointed and L - N plain blocks in proportion. So three runs, the first block checkpointed in each (as in
the mix, whose first N blocks recompute: the first block, whose input needs no gradient, keeps less than the
others when plain): one block checkpointed (``c1``), two (``c2``), and the first checkpointed with the second
plain (``m2``). ``c2 - c1`` is a checkpointed block's share, ``m2 - c1`` a plain one's; above the static share
(frozen weights, LoRA, optimizer state), a checkpointed block keeps its inputs (and with ``selective`` the kept
outputs), a plain block its whole activations. The backward runs the last block first, so the mixed step's peak
is the larger of two moments (``memory/plan_terms.activation_bytes`` counts the same):

- the start of the backward: ``m2`` with L - N plain blocks and N checkpointed ones;
- the first recompute: ``c2`` with N checkpointed blocks, and the static share of all L.

The counted kernels add the same way: ``c1`` plus N - 1 checkpointed blocks' and L - N plain blocks' kernels
(a plain block runs no recompute).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional


def run_three(cfg, depths: tuple, step: Callable) -> dict:
    """``step(cfg, depth, grows)`` for ``c1``, ``c2`` (every block checkpointed) and ``m2`` (the first only); ``c2``
    does not run the growth check's later steps (``c1`` or, encoding, ``m2`` does)."""
    t = cfg.train
    every, first = (dataclasses.replace(cfg, train=dataclasses.replace(t, checkpoint_blocks=n)) for n in (depths[1], 1))
    return {"c1": step(every, depths[0]), "c2": step(every, depths[1], False), "m2": step(first, depths[1])}


def _encoders(r) -> int:
    return r.encoder_weights + r.encode_transient


def _peak(r) -> int:
    return r.peak - _encoders(r)


def _static(r) -> int:
    return r.weights - r.encoder_weights + r.optimizer_state


def mixed_verdict(runs: dict, depths: tuple, blocks: int, n: int, gpu_bytes: Optional[int]):
    """The steady-state :class:`~..fakegpu.verdict.MemoryVerdict` of ``n`` of ``blocks`` blocks checkpointed, from
    :func:`run_three`'s runs."""
    from ..fakegpu.verdict import MemoryVerdict

    c1, c2, m2 = runs["c1"], runs["c2"], runs["m2"]
    span = depths[1] - depths[0]
    static = max(0, (_static(c2) - _static(c1)) // span)
    ckpt = max(0, (_peak(c2) - _peak(c1)) // span - static)  # a checkpointed block's inputs (and kept outputs)
    plain = max(0, _peak(m2) - _peak(c1) - static)  # a plain block's whole activations
    rest = (blocks - depths[1]) * static + _encoders(m2)
    start = _peak(m2) + rest + (blocks - n - 1) * plain + (n - 1) * ckpt
    recompute = _peak(c2) + rest + (n - depths[1]) * ckpt
    peak, moment = max((start, "the start of the backward"), (recompute, "the first recompute"))
    holders = sorted([(f"{blocks} blocks' weights, LoRA and optimizer state", blocks * static),
                      (f"{blocks - n} plain blocks' saved activations", (blocks - n) * plain * (start >= recompute)),
                      (f"{n} checkpointed blocks' saved inputs", n * ckpt),
                      ("--on_the_fly: text encoder and VAE encoder, one encode's working set", _encoders(m2))],
                     key=lambda h: -h[1])
    return MemoryVerdict(phase="training step (steady state)", peak_bytes=int(peak), gpu_bytes=gpu_bytes,
                         holders=tuple(h for h in holders if h[1] > 0),
                         scaled=f"checkpointed and plain blocks run at {depths[0]} and {depths[1]}, scaled to {n} "
                                f"of {blocks} checkpointed; peak at {moment}")


def mixed_profile(runs: dict, blocks: int, n: int):
    """The whole DiT's counted kernels with ``n`` of ``blocks`` blocks checkpointed."""
    c1, c2, m2 = (runs[k].costs for k in ("c1", "c2", "m2"))
    return c1.combine(c2.combine(c1, -1.0), n - 1).combine(m2.combine(c1, -1.0), blocks - n)
