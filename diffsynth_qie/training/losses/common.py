"""Pure helpers the training losses share (flow-matching SFT in ``sft.py``, LBM in ``lbm.py``).

Per-sample pieces: noising, the velocity target, mask weights, the per-sample MSE,
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
