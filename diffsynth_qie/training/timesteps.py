"""Per-sample noise levels for flow-matching training, on the model family's DiffSynth training schedule
(``Family.training_template``: ``"Qwen-Image"`` for both Qwen-Image-Edit and Qwen-Image-2.1).

DiffSynth's ``FlowMatchSFTLoss`` draws *one* timestep per step (batch size 1) from
``FlowMatchScheduler(template).set_timesteps(1000, training=True)`` and weights the
loss with ``scheduler.training_weight``. We keep the same tables — the 1000 shifted
training σ's (mu = 0.8, terminal shift 0.02), their timesteps (σ·1000) and the
bell-shaped weights — but draw an index *per sample*:

- ``uniform``: index uniform in ``[min_boundary·N, max_boundary·N)`` (DiffSynth's rule);
- ``logit_normal``: u = sigmoid(N(mean, std)) on the *unshifted* time axis (u = 1 is pure
  noise), mapped to the nearest table index, so the schedule's shift still applies
  (SD3's density over the Qwen-Image grid);
- ``stratified``: uniform, but the S samples of one optimizer step (all micro-batches, all
  ranks) cover the index range in S equal strata: the sample with global index g gets
  u = (k + U)/S with k = perm[g], a permutation seeded by (seed, step)
  (:func:`step_strata`), and index ``lo + floor(u·(hi - lo))``. Each sample's marginal is
  the uniform one; the step's σ's are spread evenly (FireRed's ``--uniform_sampling``).

Index 0 is σ≈1 (noise), index N-1 is σ≈0.02 (data); DiffSynth convention throughout.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..models.family import Family
from .timestep_config import TimestepConfig

NUM_TRAIN_TIMESTEPS = 1000


@dataclass(frozen=True)
class TimestepDraw:
    """One draw for a batch: everything per sample, shape ``[B]`` (float32, CPU)."""

    index: torch.Tensor      # int64 indices into the schedule table
    sigmas: torch.Tensor     # noise level σ in (0, 1]
    timesteps: torch.Tensor  # σ·1000, what the DiT is conditioned on
    weights: torch.Tensor    # per-sample loss weight


@functools.lru_cache(maxsize=4)
def training_schedule(template: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sigmas, timesteps, weights) of DiffSynth's training schedule ``FlowMatchScheduler(template)`` (a model
    family's ``Family.training_template``), each ``[1000]``."""
    from diffsynth.diffusion.flow_match import FlowMatchScheduler

    scheduler = FlowMatchScheduler(template)
    scheduler.set_timesteps(NUM_TRAIN_TIMESTEPS, training=True)
    return (scheduler.sigmas.float().clone(), scheduler.timesteps.float().clone(),
            scheduler.linear_timesteps_weights.float().clone())


@dataclass(frozen=True)
class Strata:
    """Which equal strata of ``[0, 1)`` a batch's samples draw from: ``strata[b]`` of ``count``."""

    strata: tuple[int, ...]
    count: int

    def __post_init__(self):
        assert self.count >= 1 and all(0 <= k < self.count for k in self.strata), (self.strata, self.count)


def step_strata(seed: int, step: int, step_samples: int) -> list[int]:
    """The stratum of each of one optimizer step's ``step_samples`` samples, by global sample index
    (rank-major, then micro-batch, then position): a permutation of ``range(step_samples)`` that
    depends only on ``(seed, step)``, identical on every rank and after a resume."""
    digest = hashlib.sha256(f"{seed}/strata/{step}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randperm(step_samples, generator=gen).tolist()


def micro_strata(strata: Sequence[int], starts: Sequence[int], sizes: Sequence[int]) -> list[Strata]:
    """Split a step's strata (:func:`step_strata`) into this rank's micro-batches, which start at the
    global sample indices ``starts`` and hold ``sizes`` samples."""
    return [Strata(tuple(strata[a:a + n]), len(strata)) for a, n in zip(starts, sizes)]


def sample_indices(batch_size: int, config: TimestepConfig, generator: torch.Generator | None = None,
                   num: int = NUM_TRAIN_TIMESTEPS, strata: Optional[Strata] = None) -> torch.Tensor:
    """``[B]`` schedule indices drawn per sample (see the module docstring). ``strata``: for
    ``stratified``, the samples' strata (default: the batch alone, in a random order)."""
    lo = int(config.min_timestep_boundary * num)
    hi = max(lo + 1, int(config.max_timestep_boundary * num))
    if config.timestep_sampling == "stratified":
        if strata is None:
            strata = Strata(tuple(torch.randperm(batch_size, generator=generator).tolist()), batch_size)
        assert len(strata.strata) == batch_size, (strata, batch_size)
        u = (torch.tensor(strata.strata, dtype=torch.float64)
             + torch.rand(batch_size, generator=generator, dtype=torch.float64)) / strata.count
        return (lo + torch.floor(u * (hi - lo)).long()).clamp(lo, hi - 1)
    if config.timestep_sampling == "uniform":
        return torch.randint(lo, hi, (batch_size,), generator=generator)
    if config.timestep_sampling == "logit_normal":
        u = torch.sigmoid(config.logit_mean + config.logit_std * torch.randn(batch_size, generator=generator))
        # table index i sits at unshifted time 1 - i/num
        index = torch.round((1.0 - u) * num).long()
        return index.clamp(lo, hi - 1)
    raise ValueError(f"unknown --timestep_sampling {config.timestep_sampling!r}; "
                     "use uniform, logit_normal or stratified")


def draw_timesteps(batch_size: int, config: TimestepConfig, generator: torch.Generator | None = None,
                   weighting: str = "diffsynth", strata: Optional[Strata] = None, *, family: Family) -> TimestepDraw:
    """Per-sample σ, timesteps and loss weights for a batch from ``family``'s training schedule (``strata``: see
    :func:`sample_indices`)."""
    sigmas, timesteps, weights = training_schedule(family.training_template)
    index = sample_indices(batch_size, config, generator, num=len(sigmas), strata=strata)
    w = weights[index] if weighting == "diffsynth" else torch.ones(batch_size)
    return TimestepDraw(index=index, sigmas=sigmas[index], timesteps=timesteps[index], weights=w)
