"""Samplers: Qwen-Image flow matching (with true CFG in one batch) and the LBM bridge.

Pure functions of a DiT forward, below training and inference: ``inference.Editor`` and
training's validation (``training/validation.py``) both sample through this module.

Both samplers take a *velocity function* ``velocity(x [B,16,h,w], timesteps [B]) -> v``
rather than a DiT, so the same loop runs the real model (:func:`dit_velocity`), a
toy model in the LBM tests, or a DiT under training (validation). Convention
(DiffSynth's): σ = 1 at the prior (noise, or the LBM source), σ = 0 at the data;
``v = dx/dσ`` and the DiT sees ``timestep = 1000·σ``.

- **Flow matching** steps with DiffSynth's ``FlowMatchScheduler.step`` on the schedule the
  model family returns for a :class:`~.schedules.ScheduleSpec` (``schedules.py``: one route
  for the default, Lightning and fixed-grid schedules of every family).
- **True CFG** runs the positive and negative prompt as ONE batch of 2B through
  :func:`~diffsynth_qie.models.qwen_image_edit.forward.dit_forward` (DiffSynth runs two sequential
  batch-1 passes); ``v = v_neg + cfg·(v_pos − v_neg)``. Like DiffSynth, any
  ``cfg != 1`` uses the negative pass; ``cfg == 1`` skips it.
- **Step cache** (``step_cache.py``, ``cached_blocks.py``): flow matching can reuse the DiT blocks' work of an
  earlier step at some steps; off unless asked. The bridge has 1-4 steps, each a large jump with nothing
  before it to reuse: it takes no step cache.
- **Bridge (LBM)**: σ_k = linspace(1, 1/N, N), Euler ``x ← x + (σ_{k+1} − σ_k)·v`` with
  σ_{N+1} = 0 and ``s·√(σ_{k+1}(1−σ_{k+1}))·ε`` re-injected after every step but the
  last. :func:`bridge_sigmas`, :func:`bridge_step`, :func:`bridge_interpolate` and
  :func:`bridge_target` are the pure math the LBM loss shares.

Timesteps stay fp32 here: ``dit_forward`` casts them to the DiT's compute dtype, exactly
as DiffSynth's pipeline and its training loss do (bf16 rounds 1000·σ), so LoRAs see the
same values at training, validation and inference.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .cached_blocks import StepCache
from .bridge import (bridge_interpolate, bridge_noise_scale, bridge_sigmas,  # noqa: F401 (re-exported)
                             bridge_step, bridge_target)
from ..qwen_image_edit.forward import dit_forward
from .schedules import ScheduleSpec

Tensor = torch.Tensor
#: (x [B, 16, h, w], timesteps [B] on the 0..1000 scale) -> velocity [B, 16, h, w]
VelocityFn = Callable[[Tensor, Tensor], Tensor]
#: (x, σ) -> x with the kept (unmasked) region reset; see ``masking.LatentMaskBlend``
KeepFn = Callable[[Tensor, float], Tensor]
#: progress(step, total), step counts from 1
ProgressFn = Callable[[int, int], None]
#: preview(step, total, x0): after step ``step`` (from 1), the clean latents the step predicted, x0 = x − σ·v (the
#: kept region reset with ``keep(x0, 0)``); a copy, so a preview cannot change the sampling
PreviewFn = Callable[[int, int, Tensor], None]
#: a model family's schedule for a spec (``FamilyOps.schedule``) -> DiffSynth ``FlowMatchScheduler``
ScheduleFn = Callable[[ScheduleSpec], Any]


# --- conditioning + DiT velocity --------------------------------------------------
@dataclass
class Conditioning:
    """Per-sample DiT conditioning, everything already on the DiT's device/dtype.

    ``prompt_embs[b]`` is ``[L_b, D]`` (valid tokens only); ``negative_embs`` the same
    for the negative prompt (needed only when cfg != 1); ``edit_latents[b]`` the list
    of reference latents ``[16, h_i, w_i]`` of sample b.
    """

    prompt_embs: list[Tensor]
    edit_latents: list[list[Tensor]]
    negative_embs: Optional[list[Tensor]] = None
    zero_cond_t: bool = False

    def __post_init__(self):
        if len(self.edit_latents) != len(self.prompt_embs):
            raise ValueError(f"conditioning has {len(self.prompt_embs)} prompts but {len(self.edit_latents)} "
                             "reference lists; give one per sample")
        if self.negative_embs is not None and len(self.negative_embs) != len(self.prompt_embs):
            raise ValueError(f"conditioning has {len(self.prompt_embs)} prompts but "
                             f"{len(self.negative_embs)} negative prompts")

    def __len__(self) -> int:
        return len(self.prompt_embs)

    def repeat(self, n: int) -> "Conditioning":
        """The same conditioning for ``n`` times as many samples (LBM's two streams)."""
        return Conditioning(self.prompt_embs * n, self.edit_latents * n,
                            None if self.negative_embs is None else self.negative_embs * n, self.zero_cond_t)


def uses_cfg(cfg: float) -> bool:
    """DiffSynth's rule (``cfg_guided_model_fn``): any scale other than 1 runs the negative pass."""
    return float(cfg) != 1.0


def split_cfg(x: Tensor, cond: Conditioning) -> bool:
    """Whether true CFG runs as two unmasked passes (positive, then negative) rather than one batch of 2B.

    The rule: on a GPU, when a positive and its negative prompt differ in length (almost always: the negative
    is usually empty), two passes. The joint batch would pad the shorter prompt and need a key mask, and with a
    mask ``scaled_dot_product_attention`` cannot use the flash kernels; two passes also peak at half the
    activations. Equal lengths, or a CPU (no flash kernels, and one batch is fewer, larger matmuls): one batch."""
    if x.device.type == "cpu" or cond.negative_embs is None:
        return False
    return any(p.shape[0] != n.shape[0] for p, n in zip(cond.prompt_embs, cond.negative_embs))


def predict_velocity(dit, x: Tensor, timesteps: Tensor, cond: Conditioning, cfg: float = 1.0,
                     split: bool | None = None) -> Tensor:
    """Velocity ``[B, 16, h, w]`` for a batch, with true CFG as one batch of 2B or two passes (:func:`split_cfg`
    decides when ``split`` is None).

    The 2B batch stacks [positive samples..., negative samples...]; prompts of
    different lengths are padded and masked by ``dit_forward``.
    """
    batch = x.shape[0]
    if len(cond) != batch:
        raise ValueError(f"conditioning holds {len(cond)} samples but the latents hold {batch}")
    timesteps = timesteps.reshape(-1).expand(batch) if timesteps.numel() == 1 else timesteps.reshape(-1)
    if not uses_cfg(cfg):
        out = dit_forward(dit, x, timesteps, cond.prompt_embs, cond.edit_latents, zero_cond_t=cond.zero_cond_t)
        return torch.stack(out)
    if cond.negative_embs is None:
        raise ValueError(f"cfg={cfg} needs negative prompt embeddings (encode the negative prompt, "
                         "even an empty one), or use cfg=1")
    if split if split is not None else split_cfg(x, cond):
        pos = torch.stack(dit_forward(dit, x, timesteps, cond.prompt_embs, cond.edit_latents,
                                      zero_cond_t=cond.zero_cond_t))
        neg = torch.stack(dit_forward(dit, x, timesteps, cond.negative_embs, cond.edit_latents,
                                      zero_cond_t=cond.zero_cond_t))
        return neg + cfg * (pos - neg)
    out = dit_forward(dit, torch.cat([x, x]), torch.cat([timesteps, timesteps]),
                      cond.prompt_embs + cond.negative_embs, cond.edit_latents + cond.edit_latents,
                      zero_cond_t=cond.zero_cond_t)
    pos, neg = torch.stack(out[:batch]), torch.stack(out[batch:])
    return neg + cfg * (pos - neg)


def dit_velocity(dit, cond: Conditioning, cfg: float = 1.0) -> VelocityFn:
    """A :data:`VelocityFn` driving ``dit`` (``dit_forward`` casts the timesteps to the DiT's dtype)."""

    def velocity(x: Tensor, timesteps: Tensor) -> Tensor:
        return predict_velocity(dit, x, timesteps.to(device=x.device), cond, cfg)

    return velocity


# --- flow matching ----------------------------------------------------------------
@torch.no_grad()
def sample_flow_match(velocity: VelocityFn, noise: Tensor, spec: ScheduleSpec, schedule: ScheduleFn,
                      keep: KeepFn | None = None, progress: ProgressFn | None = None,
                      source: Tensor | None = None, preview: PreviewFn | None = None,
                      step_cache: StepCache | None = None) -> Tensor:
    """Integrate from ``noise`` [B, C, h, w] (σ = 1) to σ = 0 with DiffSynth's Euler step on the schedule the
    model family builds for ``spec`` (``schedule(spec)``: the family's ``FamilyOps.schedule``).

    ``keep(x, σ)`` runs on the initial latents and after every step with the σ the
    latents are now at (the mask's latent blend).
    ``spec.strength`` < 1 (SDEdit): the schedule starts part-way (DiffSynth's ``denoising_strength``) from
    ``source`` noised to the first σ, ``(1 − σ₀)·source + σ₀·noise``; 0 returns ``source``; 1 is the plain sampler.
    ``preview`` (:data:`PreviewFn`) gets each step's predicted clean latents; it leaves the result as it is.
    ``step_cache`` (``cached_blocks.StepCache``, on the DiT ``velocity`` drives): some steps reuse the blocks' work
    of an earlier step (``step_cache.py``); None runs every block of every step.
    """
    strength = spec.strength
    if strength < 1.0 and source is None:
        raise ValueError(f"strength {strength} starts from the source image's latents; none were given")
    if tuple(noise.shape[-2:]) != spec.latent_hw:
        raise ValueError(f"the schedule was asked for latents of {spec.latent_hw}, the noise is {tuple(noise.shape[-2:])}")
    if strength <= 0.0:
        return source
    scheduler = schedule(spec)
    sigmas = [float(s) for s in scheduler.sigmas] + [0.0]
    x = noise if strength >= 1.0 else ((1 - sigmas[0]) * source.float() + sigmas[0] * noise.float()).to(noise.dtype)
    if keep is not None:
        x = keep(x, sigmas[0])
    total = len(scheduler.timesteps)
    with step_cache.run(sigmas[:total]) if step_cache is not None else contextlib.nullcontext():
        for i, timestep in enumerate(scheduler.timesteps):
            if step_cache is not None:
                step_cache.step(i)
            v = velocity(x, timestep.reshape(1).expand(x.shape[0]))
            if preview is not None:
                preview(i + 1, total, predicted_clean(x, v, sigmas[i], keep))
            # BasePipeline.step without inpaint: x + v·(σ_next − σ) in the latents' dtype.
            x = scheduler.step(v, scheduler.timesteps[i], x)
            if keep is not None:
                x = keep(x, sigmas[i + 1])
            if progress is not None:
                progress(i + 1, total)
    return x


def predicted_clean(x: Tensor, v: Tensor, sigma: float, keep: KeepFn | None = None) -> Tensor:
    """The clean latents a step predicts from ``x`` at ``sigma`` and its velocity: x0 = x − σ·v (v = dx/dσ, so the
    straight path's end at σ = 0), in fp32, with the kept region reset by ``keep(x0, 0)``; a new tensor."""
    x0 = x.float() - float(sigma) * v.float()
    return keep(x0.to(x.dtype), 0.0) if keep is not None else x0.to(x.dtype)


# --- latent bridge (LBM) ----------------------------------------------------------
@torch.no_grad()
def sample_bridge(velocity: VelocityFn, prior: Tensor, steps: int, bridge_noise: float = 0.005,
                  generator: torch.Generator | None = None, keep: KeepFn | None = None,
                  progress: ProgressFn | None = None, strength: float = 1.0,
                  preview: PreviewFn | None = None) -> Tensor:
    """Few-step LBM sampling from ``prior`` [B, 16, h, w] (σ = 1) to σ = 0.

    Re-injected noise is drawn on the CPU from ``generator`` (device-independent
    results), one draw of the whole batch per intermediate step. ``strength`` < 1 starts the bridge part-way:
    the prior is taken as the state at σ = strength (every σ scaled by it), so less of the edit is made;
    0 returns the prior. ``preview`` as in :func:`sample_flow_match` (x0 of both streams).
    """
    if strength <= 0.0:
        return prior
    sigmas = (bridge_sigmas(steps) * strength).tolist() + [0.0]
    x = prior
    if keep is not None:
        x = keep(x, sigmas[0])
    for k in range(steps):
        sigma, sigma_next = sigmas[k], sigmas[k + 1]
        timesteps = torch.full((x.shape[0],), 1000.0 * sigma, dtype=torch.float32)
        v = velocity(x, timesteps)
        if preview is not None:
            preview(k + 1, steps, predicted_clean(x, v, sigma, keep))
        noise = None
        if sigma_next > 0 and bridge_noise:
            noise = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(device=x.device, dtype=x.dtype)
        x = bridge_step(x, v, sigma, sigma_next, bridge_noise, noise)
        if keep is not None:
            x = keep(x, sigma_next)
        if progress is not None:
            progress(k + 1, steps)
    return x


def seeded_noise(shape: Sequence[int], seed: int, dtype: torch.dtype, device=None) -> Tensor:
    """Gaussian noise exactly as DiffSynth's ``BasePipeline.generate_noise`` draws it (CPU generator)."""
    generator = torch.Generator("cpu").manual_seed(int(seed))
    noise = torch.randn(tuple(shape), generator=generator, device="cpu", dtype=dtype)
    return noise.to(device=device) if device is not None else noise
