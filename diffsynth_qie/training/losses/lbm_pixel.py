"""LBM's optional pixel-space perceptual loss (``--lbm_pixel_loss lpips --lbm_pixel_weight W``).

As in the LBM reference: from the DiT's velocity v̂ at the bridge point x_σ, the
predicted target latents are ``ẑ_T = x_σ − σ·v̂`` (the bridge's ``x_σ = z_T + σ·(z_prior − z_T)``
solved for z_T). A random crop of at most ``--lbm_pixel_crop`` pixels per side
(default 512; the crop is taken in latent space, at the family's pixels per latent pixel: 8 for
Qwen-Image-Edit, 16 for Qwen-Image-2.1) is decoded
with the VAE decoder, with gradient, and compared by LPIPS with the same crop of the
target (its RGB channels: 2.1's VAE decodes RGBA). Phase 2 has no images, so the target crop is the VAE decode of the cached
target latents (without gradient). Each sample's loss becomes
``mse + W · LPIPS(decode(ẑ_T crop), decode(z_T crop))``; the reference example uses W = 10.

The VAE is loaded only when the flag is given, alone (``components=("vae",)``), on
each process, outside the wrapped training module (it is frozen and not saved);
LPIPS needs its backbone weights in the torch hub cache (``metrics/lpips.py``; a
clear error names the file otherwise). Not with DeepSpeed ZeRO-3 (the decoder must
be whole on every rank): use DDP or ZeRO-2 (the LBM launcher uses DDP).
The crop offsets are drawn from the loss's generator after the bridge draws, so
runs stay reproducible and the default path's draws are unchanged.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...metrics.lpips import lpips_distance

log = logging.getLogger(__name__)

Tensor = torch.Tensor
LATENT_SCALE = 8  # pixels per latent pixel (Qwen-Image-Edit's VAE; ``PixelCritic.scale`` holds the family's)


@dataclass
class PixelCritic:
    """The frozen VAE (the family's DiffSynth VAE) and LPIPS network that score decoded crops."""

    vae: torch.nn.Module
    lpips: torch.nn.Module
    weight: float
    crop: int  # max pixels per side
    scale: int = LATENT_SCALE  # pixels per latent pixel (``Family.vae_factor``)

    def crop_box(self, shape: Sequence[int], generator: Optional[torch.Generator]) -> tuple[int, int, int, int]:
        """(top, left, height, width) in latent pixels of a random crop of a ``[C, h, w]`` latent."""
        h, w = int(shape[-2]), int(shape[-1])
        side = max(1, self.crop // self.scale)
        ch, cw = min(h, side), min(w, side)
        top = int(torch.randint(h - ch + 1, (1,), generator=generator))
        left = int(torch.randint(w - cw + 1, (1,), generator=generator))
        return top, left, ch, cw

    def _decode(self, latents: Tensor) -> Tensor:
        """``[C, h, w]`` -> ``[1, 3, s·h, s·w]`` in [0, 1]: the RGB channels (not clamped, so the gradient never
        stops)."""
        vae_dtype = next(self.vae.parameters()).dtype
        image = self.vae.decode(latents[None].to(vae_dtype))
        return (image[:, :3].float() + 1) / 2

    def losses(self, predicted_targets: Sequence[Tensor], targets: Sequence[Tensor],
               generator: Optional[torch.Generator] = None) -> Tensor:
        """Per-sample LPIPS ``[B]`` between decoded crops of predicted and true target latents."""
        out = []
        for pred, target in zip(predicted_targets, targets):
            top, left, ch, cw = self.crop_box(target.shape, generator)
            window = (slice(None), slice(top, top + ch), slice(left, left + cw))
            with torch.no_grad():
                real = self._decode(target[window])
            out.append(lpips_distance(self.lpips, self._decode(pred[window]), real)[0])
        return torch.stack(out)


def predicted_targets(noisy: Sequence[Tensor], velocity: Sequence[Tensor], sigmas: Tensor) -> list[Tensor]:
    """ẑ_T = x_σ − σ·v̂ per sample (fp32)."""
    return [x.float() - float(s) * v.float() for x, v, s in zip(noisy, velocity, sigmas)]


def build_pixel_critic(lbm, preset, model_dir: Optional[str], device, dtype: torch.dtype,
                       ds_config: Optional[dict] = None) -> PixelCritic:
    """Load the VAE alone and LPIPS for ``--lbm_pixel_loss lpips`` (``ValueError`` when they cannot be)."""
    from ...models.presets import family_of
    from ...metrics.lpips import require_lpips
    from .common import load_frozen_vae, refuse_zero3

    refuse_zero3(ds_config, "--lbm_pixel_loss lpips", "the VAE decoder must be whole on every rank")
    lpips = require_lpips().to(device)
    vae = load_frozen_vae(preset, model_dir, device, dtype)
    log.info("LBM pixel loss: %g x LPIPS on decoded crops of at most %d px (VAE decoder loaded)",
             lbm.lbm_pixel_weight, lbm.lbm_pixel_crop)
    return PixelCritic(vae=vae, lpips=lpips, weight=float(lbm.lbm_pixel_weight), crop=int(lbm.lbm_pixel_crop),
                       scale=family_of(preset).vae_factor)
