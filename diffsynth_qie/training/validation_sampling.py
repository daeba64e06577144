"""The sampling side of validation: held-out cache entries turned into sampler jobs and sampled through the
training module, exactly as ``Editor`` samples (``models.sampling``); see ``validation.py`` for the whole story.

- :func:`flow_match_jobs`: one job per entry from ``seeded_noise(seed=NOISE_SEED + k)`` (the same noise at every
  validation, so steps are comparable);
- :func:`lbm_jobs`: the main and sub bridge stream of every entry, with the loss's own ends (``lbm.stream_ends``);
- :func:`sample_jobs`: every job sampled, one sampler call per latent shape, every DiT call made by ``run_dit``
  (the wrapped module, so DDP/DeepSpeed hooks fire).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..cache.store import CacheEntry

Tensor = torch.Tensor
#: runs ``fn(dit)`` where the DiT lives: through the wrapped training module in training
DiTRunner = Callable[[Callable], Tensor]

NOISE_SEED = 1234
LBM_STEPS = 1  # what LBM models are trained for; also the cheapest render


def entry_seed(k: int) -> int:
    return NOISE_SEED + k  # the k-th held-out entry's flow-matching noise (and LBM bridge noise)


@dataclass
class Render:
    """One validation output: sampled ``latents`` [16, h, w] and the ``target`` they are judged against."""

    name: str                 # file stem: "<k>-<entry>" or "<k>-<entry>_<stream>"
    entry: int                # position among the held-out entries
    stream: Optional[str]     # None (flow matching), "main" or "sub" (LBM)
    target: Tensor            # target_latents (ref_gt_latents for a ref_gt sub-stream)
    latents: Tensor


@dataclass
class _Job:
    name: str
    entry: int
    stream: Optional[str]
    prior: Tensor             # [16, h, w]: noise (σ = 1) or the bridge prior
    target: Tensor


# --- sampling through models.sampling -------------------------------------------------
def runner_velocity(run_dit: DiTRunner, cond, cfg: float, ops):
    """The model family's sampler velocity (``ops.velocity``) with every DiT call made by ``run_dit`` (the
    wrapped module).

    The velocity is cast to the latents' dtype: accelerate's mixed-precision wrapper
    returns fp32, the Editor's DiT the pipeline dtype; sampling stays in the latents' dtype.
    """
    def velocity(x: Tensor, timesteps: Tensor) -> Tensor:
        return run_dit(lambda dit: ops.velocity(dit, cond, cfg)(x, timesteps)).to(x.dtype)

    return velocity


def _conditioning(entries: Sequence[CacheEntry], cfg: float, zero_cond_t: bool, device, dtype, ops):
    from ..models.samplers.sampling import uses_cfg

    def to(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=dtype)

    prompts = [ops.join_prompt(e.prompt_embs[0], e.prompt_extras[0]) for e in entries]
    negatives = ([ops.join_prompt(e.empty_prompt_emb, e.empty_prompt_extras) for e in entries]
                 if uses_cfg(cfg) else None)
    return ops.conditioning(prompts, negatives, [e.edit_latents for e in entries], zero_cond_t, to)


def _by_shape(jobs: Sequence[_Job]) -> list[list[_Job]]:
    """Jobs grouped by latent shape (first-seen order): each group is one sampler batch."""
    groups: dict[tuple, list[_Job]] = {}
    for job in jobs:
        groups.setdefault(tuple(job.prior.shape), []).append(job)
    return list(groups.values())


def flow_match_jobs(entries: Sequence[CacheEntry], names: Sequence[str], dtype: torch.dtype) -> list[_Job]:
    """One job per entry, starting from ``seeded_noise`` at the target's latent shape."""
    from ..models.samplers.sampling import seeded_noise

    return [_Job(name, k, None, seeded_noise(tuple(e.target_latents.shape), entry_seed(k), dtype),
                 e.target_latents) for k, (e, name) in enumerate(zip(entries, names))]


def lbm_jobs(entries: Sequence[CacheEntry], names: Sequence[str], sub_target: str = "target") -> list[_Job]:
    """The main (if the row has a source) and sub job of every entry, with the loss's bridge ends."""
    from .losses.lbm import stream_ends

    jobs = []
    for k, (e, name) in enumerate(zip(entries, names)):
        row = {"entry_id": [e.entry_id], "target_latents": [e.target_latents],
               "lbm_source_latents": [e.lbm_source_latents], "sub_noise": [e.sub_noise],
               "ref_gt_latents": [e.ref_gt_latents], "sub_noise_ref_gt": [e.sub_noise_ref_gt],
               "back_mask": [e.back_mask]}
        main = stream_ends(row, 0, want_sub=False)
        if main.stream == "main":
            jobs.append(_Job(f"{name}_main", k, "main", main.prior, main.target))
        sub = stream_ends(row, 0, want_sub=True, sub_target=sub_target)
        if sub.stream == "sub":
            jobs.append(_Job(f"{name}_sub", k, "sub", sub.prior, sub.target))
    return jobs


@torch.no_grad()
def sample_jobs(run_dit: DiTRunner, entries: Sequence[CacheEntry], jobs: Sequence[_Job], *, lbm: bool, steps: int,
                cfg: float, zero_cond_t: bool, bridge_noise: float = 0.0, device=None,
                dtype: torch.dtype = torch.float32, preset, sigmas=None) -> list[Render]:
    """Sample every job (flow matching, or LBM when ``lbm``), one sampler call per shape group, the way the
    ``preset``'s model family samples (``sigmas``: a declared grid, used as given)."""
    from ..models.family_ops import ops_for
    from ..models.presets import get_preset
    from ..models.samplers.sampling import sample_bridge, sample_flow_match
    from ..models.samplers.schedules import ScheduleSpec

    preset = get_preset(preset)
    ops = ops_for(preset.family)
    renders = {}
    for group in _by_shape(jobs):
        cond = _conditioning([entries[j.entry] for j in group], cfg, zero_cond_t, device, dtype, ops)
        velocity = runner_velocity(run_dit, cond, cfg, ops)
        prior = torch.stack([j.prior for j in group]).to(device=device, dtype=dtype)
        if lbm:
            generator = torch.Generator("cpu").manual_seed(entry_seed(group[0].entry))
            out = sample_bridge(velocity, prior, LBM_STEPS, bridge_noise, generator)
        else:
            spec = ScheduleSpec.for_preset(preset, steps, prior.shape[-2:], sigmas=sigmas)
            out = sample_flow_match(velocity, prior, spec, ops.schedule)
        for job, lat in zip(group, out):
            renders[job.name] = Render(job.name, job.entry, job.stream, job.target, lat)
    return [renders[j.name] for j in jobs]
