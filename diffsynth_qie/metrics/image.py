"""Image quality metrics on batched pixel tensors ``[B, 3, H, W]`` in [0, 1].

- :func:`psnr` and :func:`ssim` are per-sample (``[B]``), so every sample of a batch
  keeps its own value. SSIM is the standard Gaussian SSIM (window 11, σ = 1.5,
  K1 = 0.01, K2 = 0.03; reflect-padded, the mean over every pixel): the same numbers
  as torchmetrics' ``structural_similarity_index_measure``.
- :func:`masked_psnr` is PSNR with per-pixel weights, e.g. ``1 - edit mask`` for how
  well a masked edit preserves everything outside its mask.
- :func:`to_pixels` turns PIL images into such a batch.

LPIPS needs pretrained network weights and lives in ``metrics/lpips.py``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

Tensor = torch.Tensor

#: PSNR reported for identical images (the MSE is 0)
MAX_PSNR = 99.0
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def to_pixels(images: Sequence) -> Tensor:
    """PIL images (one size) -> float32 ``[B, 3, H, W]`` in [0, 1]."""
    arrays = [np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0 for im in images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def _check(a: Tensor, b: Tensor) -> None:
    if a.shape != b.shape or a.ndim != 4:
        raise ValueError(f"metrics need two [B, C, H, W] batches of one shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")


def _psnr_from_mse(mse: Tensor) -> Tensor:
    safe = mse.clamp_min(1e-20)
    return torch.where(mse > 0, 10 * torch.log10(1.0 / safe), torch.full_like(mse, MAX_PSNR))


def psnr(a: Tensor, b: Tensor) -> Tensor:
    """Per-sample PSNR (dB) for data range 1; :data:`MAX_PSNR` where the images are identical."""
    _check(a, b)
    return _psnr_from_mse((a.double() - b.double()).pow(2).flatten(1).mean(1)).float()


def masked_psnr(a: Tensor, b: Tensor, weight: Tensor) -> Tensor:
    """Per-sample PSNR over the pixels ``weight`` ``[B, 1, H, W]`` selects (soft weights allowed).

    A sample whose weights are all zero has nothing to measure: NaN.
    """
    _check(a, b)
    if weight.shape != (a.shape[0], 1, *a.shape[-2:]):
        raise ValueError(f"weight must be [B, 1, H, W] = {(a.shape[0], 1, *a.shape[-2:])}, got {tuple(weight.shape)}")
    w = weight.double().clamp(0, 1)
    err = ((a.double() - b.double()).pow(2) * w).flatten(1).sum(1)
    total = w.flatten(1).sum(1) * a.shape[1]
    mse = err / total.clamp_min(1e-20)
    return torch.where(total > 0, _psnr_from_mse(mse), torch.full_like(mse, float("nan"))).float()


def _gaussian_window(channels: int, dtype, device) -> Tensor:
    size = int(3.5 * SSIM_SIGMA + 0.5) * 2 + 1
    x = torch.arange(size, dtype=dtype, device=device) - (size - 1) / 2
    g = torch.exp(-(x ** 2) / (2 * SSIM_SIGMA ** 2))
    g = g / g.sum()
    return g.expand(channels, 1, 1, size).contiguous()  # 1-D: the 2-D Gaussian is separable


def ssim(a: Tensor, b: Tensor) -> Tensor:
    """Per-sample SSIM for data range 1 (Gaussian window 11, σ 1.5; reflect padding, mean over all pixels)."""
    return ssim_map(a, b).flatten(1).mean(1).float()


def masked_ssim(a: Tensor, b: Tensor, weight: Tensor) -> Tensor:
    """Per-sample SSIM averaged over the pixels ``weight`` ``[B, 1, H, W]`` selects; NaN where it selects none."""
    if weight.shape != (a.shape[0], 1, *a.shape[-2:]):
        raise ValueError(f"weight must be [B, 1, H, W] = {(a.shape[0], 1, *a.shape[-2:])}, got {tuple(weight.shape)}")
    w = weight.double().clamp(0, 1)
    index = ssim_map(a, b).mean(1, keepdim=True)
    total = w.flatten(1).sum(1)
    value = (index * w).flatten(1).sum(1) / total.clamp_min(1e-20)
    return torch.where(total > 0, value, torch.full_like(value, float("nan"))).float()


def ssim_map(a: Tensor, b: Tensor) -> Tensor:
    """The per-pixel SSIM index ``[B, C, H, W]`` (float64) behind :func:`ssim`."""
    _check(a, b)
    x, y = a.double(), b.double()
    c = x.shape[1]
    window = _gaussian_window(c, x.dtype, x.device)
    pad = window.shape[-1] // 2
    if min(x.shape[-2:]) <= pad:
        raise ValueError(f"SSIM needs images of more than {pad} px per side, got {tuple(x.shape[-2:])}")
    x, y = (F.pad(t, (pad, pad, pad, pad), mode="reflect") for t in (x, y))

    def blur(t: Tensor) -> Tensor:
        return F.conv2d(F.conv2d(t, window, groups=c), window.transpose(-1, -2), groups=c)  # rows, then columns

    mu_x, mu_y = blur(x), blur(y)
    var_x = (blur(x * x) - mu_x ** 2).clamp_min(0)
    var_y = (blur(y * y) - mu_y ** 2).clamp_min(0)
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = SSIM_K1 ** 2, SSIM_K2 ** 2
    return ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2))


def mask_to_pixels(back_mask: Tensor, size: tuple[int, int]) -> Tensor:
    """A latent-resolution edit mask ``[B, 1, h, w]`` (or ``[1, h, w]``) -> ``[B, 1, H, W]`` (nearest)."""
    m = back_mask.float()
    if m.ndim == 3:
        m = m[None]
    return F.interpolate(m, size=size, mode="nearest").clamp(0, 1)
