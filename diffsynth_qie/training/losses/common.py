"""Pure helpers the training losses share (flow-matching SFT in ``sft.py``, LBM in ``lbm.py``).

Per-sample pieces: noising and the velocity target (:func:`noised`), the prompt join, mask weights, the per-sample MSE,
the weighted batch mean and reproducible noise; and, for the losses that decode latents (``--lbm_pixel_loss``,
``--loss nft``), the frozen VAE they load alone and their refusal of ZeRO-3. They import nothing from the losses.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

Tensor = torch.Tensor


def add_noise(latents: Tensor, noise: Tensor, sigma: Tensor | float) -> Tensor:
    """``(1-σ)·x0 + σ·ε`` for one sample (DiffSynth's ``scheduler.add_noise``)."""
    return (1 - sigma) * latents + sigma * noise


def flow_target(latents: Tensor, noise: Tensor) -> Tensor:
    """Velocity target ``ε - x0`` (DiffSynth's ``scheduler.training_target``)."""
    return noise - latents


def noised(x0: Tensor, noise: Tensor, sigma: Tensor | float) -> tuple[Tensor, Tensor]:
    """One sample's noisy latents ``x_σ`` (in ``x0``'s dtype) and its velocity target ``ε - x0`` (fp32), computed
    in fp32 from its own noise and σ: the step every flow-matching loss takes per sample (sft, dpo, nft)."""
    x, eps = x0.float(), noise.float()
    return add_noise(x, eps, sigma).to(x0.dtype), flow_target(x, eps)


def joined_prompts(ops, batch: dict) -> list:
    """Each sample's prompt as its family's DiT takes it: the embedding joined with the extra tensors the cache
    keeps beside it (``FamilyOps.join_prompt``; 2.1: the references' slot mask)."""
    extras = batch.get("prompt_extras") or [{}] * len(batch["prompt_emb"])
    return [ops.join_prompt(e, x) for e, x in zip(batch["prompt_emb"], extras)]


def pixel_weights(masks: Sequence[Optional[Tensor]], config) -> list:
    """Each sample's ``--mask_loss_weights`` map (:func:`mask_weights`); None for a sample without a mask, and
    for every sample without the flag."""
    if config.loss.mask_loss_weights is None:
        return [None] * len(masks)
    inside, outside = config.loss.mask_loss_weights
    return [None if m is None else mask_weights(m, inside, outside) for m in masks]


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
