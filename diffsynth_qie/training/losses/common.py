"""The steps every training loss repeats, defined once (SFT, LBM, DPO, NFT and any loss added after them).

Per sample, never per batch: the flow-matching point (σ, then ε, from the loss's generator, and the noised
latents and velocity target they give: :func:`draw_flow_points`), each sample's prompt as the family's DiT call
takes it (:func:`joined_prompts`), the ``--mask_loss_weights`` pixel weights (:func:`pixel_weights`), the
per-sample MSE and the weighted batch mean; and, for the losses that decode latents (``--lbm_pixel_loss``,
``--loss nft``), the frozen VAE they load alone and their refusal of ZeRO-3. They import nothing from the losses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

Tensor = torch.Tensor


def add_noise(latents: Tensor, noise: Tensor, sigma: Tensor | float) -> Tensor:
    """``(1-σ)·x0 + σ·ε`` for one sample (DiffSynth's ``scheduler.add_noise``)."""
    return (1 - sigma) * latents + sigma * noise


def flow_target(latents: Tensor, noise: Tensor) -> Tensor:
    """Velocity target ``ε - x0`` (DiffSynth's ``scheduler.training_target``)."""
    return noise - latents


def mask_weights(back_mask: Tensor, inside: float, outside: float) -> Tensor:
    """Per-pixel weights ``[1, h, w]`` from a soft edit mask, normalised to mean 1.

    ``w = inside·m + outside·(1-m)``, divided by its mean over the sample: with a
    uniform error e the weighted loss is e whatever the mask's size, and
    ``inside/outside`` is the per-pixel ratio. ``inside=1, outside=0`` is the plain
    mean over the edit region. An all-zero weight map (empty mask with outside=0)
    stays all zero: the sample contributes nothing.
    """
    m = back_mask.float().clamp(0, 1)
    w = inside * m + outside * (1 - m)
    mean = w.mean()
    # on the device, without a host read (a sync per masked sample): all-zero weights divide to NaN, not taken
    return torch.where(mean > 0, w / mean, w)


def per_sample_mse(pred: Tensor, target: Tensor, weight: Optional[Tensor] = None) -> Tensor:
    """Mean squared error of one sample ``[C, h, w]`` (fp32), optionally pixel-weighted ``[1, h, w]``."""
    err = (pred.float() - target.float()) ** 2
    if weight is not None:
        err = err * weight.to(err.dtype)
    return err.mean()


def weighted_batch_mean(losses: Sequence[Tensor], weights: Tensor) -> Tensor:
    """``mean_b(weight_b · loss_b)`` — DiffSynth's ``mse * training_weight`` per sample."""
    stacked = torch.stack(list(losses))
    return (stacked * weights.to(stacked.device, stacked.dtype)).mean()


def sample_noise(like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Gaussian noise shaped like ``like``, drawn on the CPU (reproducible on any device)."""
    return torch.randn(like.shape, generator=generator, dtype=torch.float32).to(like.device, like.dtype)


@dataclass
class FlowPoints:
    """One flow-matching point per sample of a batch: what a loss feeds the DiT and regresses."""

    sigmas: Tensor          # [B] float32 noise levels σ (CPU)
    timesteps: Tensor       # [B] what the DiT is conditioned on, σ·1000 (CPU)
    weights: Tensor         # [B] per-sample loss weights of the σ weighting (CPU)
    noise: list[Tensor]     # ε per sample, in its latents' dtype and device
    noisy: list[Tensor]     # x_σ = (1-σ)·x0 + σ·ε per sample, in the latents' dtype
    target: list[Tensor]    # the velocity target ε - x0 per sample, fp32

    def at(self, latents: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """``(x_σ, ε - x0)`` of other latents of the same shapes at each sample's own σ and ε (a preference
        loss's rejected image, noised exactly like the chosen one)."""
        noisy, target = [], []
        for b, x0 in enumerate(latents):
            noisy.append(_noised(x0, self.noise[b].float(), self.sigmas[b]))
            target.append(flow_target(x0.float(), self.noise[b].float()))
        return noisy, target


def _noised(x0: Tensor, noise: Tensor, sigma: Tensor) -> Tensor:
    return add_noise(x0.float(), noise, sigma.to(x0.device, torch.float32)).to(x0.dtype)


def draw_flow_points(latents: Sequence[Tensor], timesteps_config, generator: torch.Generator | None, *, family,
                     weighting: str = "diffsynth", strata=None) -> FlowPoints:
    """Flow-matching points of clean ``latents`` (one ``[C, h, w]`` per sample), drawn sample by sample from
    ``generator`` in this order: σ_b (``training.timesteps.draw_timesteps`` on ``family``'s training schedule,
    ``weighting`` its loss weight; ``strata``: the batch's ``Strata``, sample b draws from its own), then ε_b.

    A sample gets the same σ and noise whether it is trained in a batch or alone, and the order of the draws is
    what the pinned loss curve and the losses' parity tests hold."""
    from ..timesteps import Strata, draw_timesteps

    draws, noise, noisy, target = [], [], [], []
    for b, x0 in enumerate(latents):
        one = None if strata is None else Strata((strata.strata[b],), strata.count)
        d = draw_timesteps(1, timesteps_config, generator, weighting=weighting, strata=one, family=family)
        eps = sample_noise(x0, generator)
        noisy.append(_noised(x0, eps.float(), d.sigmas[0]))
        target.append(flow_target(x0.float(), eps.float()))
        noise.append(eps)
        draws.append(d)
    return FlowPoints(sigmas=torch.cat([d.sigmas for d in draws]), timesteps=torch.cat([d.timesteps for d in draws]),
                      weights=torch.cat([d.weights for d in draws]), noise=noise, noisy=noisy, target=target)


def joined_prompts(ops, batch: dict) -> list:
    """Each sample's prompt as the family's DiT call takes it: ``FamilyOps.join_prompt`` of the cached
    embedding and its extra tensors (none for Qwen-Image-Edit, the reference slots for Qwen-Image-2.1)."""
    extras = batch.get("prompt_extras") or [{}] * len(batch["prompt_emb"])
    return [ops.join_prompt(e, x) for e, x in zip(batch["prompt_emb"], extras)]


def pixel_weights(mask_loss_weights: Optional[Sequence[float]], masks: Optional[Sequence[Optional[Tensor]]],
                  n: int) -> list[Optional[Tensor]]:
    """Per-sample pixel weights of ``--mask_loss_weights INSIDE OUTSIDE`` (:func:`mask_weights` of each sample's
    edit mask): None for every sample when the flag is off (the masks are not read) and for a sample with no mask."""
    if mask_loss_weights is None or masks is None:
        return [None] * n
    inside, outside = mask_loss_weights
    return [None if m is None else mask_weights(m, inside, outside) for m in masks]


def refuse_zero3(ds_config: Optional[dict], flag: str, why: str) -> None:
    """``ValueError`` when the DeepSpeed config is ZeRO-3, which ``flag`` cannot run under (``why``)."""
    if (ds_config or {}).get("zero_optimization", {}).get("stage") == 3:
        raise ValueError(f"{flag} does not run under DeepSpeed ZeRO-3 ({why}); use DDP or ZeRO-2 (e.g. --config_file "
                         "deepspeed_configs/zero2.yaml)")


def load_frozen_vae(preset, model_dir: Optional[str], device, dtype: torch.dtype):
    """The preset's VAE loaded alone on ``device``, frozen and in eval mode (a loss that decodes latents)."""
    from ...models.load.loading import load_pipeline

    device_name = "cpu" if torch.device(device).type == "cpu" else str(device)
    vae = load_pipeline(preset, model_dir=model_dir, components=("vae",), device=device_name, torch_dtype=dtype).vae
    return vae.to(device).requires_grad_(False).eval()
