"""Mask semantics for editing: white (>= 128) = the region that may change.

Two blends, both controlled by ``strength`` (``EditRequest.mask_blend``, 0..1):

- **Latent blend, every step.** Outside the mask the latents are reset to the source
  image's latents brought to the current σ along the sampler's own path:
  ``x_keep(σ) = (1−σ)·z_src + σ·prior`` (flow matching: prior = the initial noise,
  so this is ``z_src`` noised with the same noise; LBM: prior = the stream's start).
  ``x ← (1−k)·x + k·x_keep(σ)`` with keep weight ``k = (1 − m_lat)·strength``.
  ``m_lat`` is the mask max-pooled to latent resolution: a latent cell may change
  if any of its 8×8 pixels is painted, so the model has room for the whole edit.
- **Pixel blend, at the end.** ``out = (1−k)·decoded + k·input`` with
  ``k = (1 − m)·strength``; at strength 1 this is ``m·decoded + (1−m)·input``.
  Feathering softens ``m`` *inside* the painted region only (erode, then blur), so
  with strength 1 every pixel outside the mask equals the input exactly, feathered
  or not.

Strength 0 turns masking off (the plain edit); strength 1 keeps the outside exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageFilter

from ..data.images import resize_mask, resize_to, to_mask, to_rgb

Tensor = torch.Tensor


def check_strength(strength: float) -> float:
    strength = float(strength)
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"mask_blend must be in [0, 1], got {strength}")
    return strength


def binary_mask(mask: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Any mask image -> binary mode "L" {0, 255} at ``size`` = (w, h)."""
    if mask.mode != "L":
        mask = to_mask(mask)  # alpha layers, RGB, 16-bit ... -> binary L
    return resize_mask(mask, size)


def latent_keep_weight(mask: Image.Image, latent_hw: tuple[int, int], strength: float = 1.0,
                       factor: int = 8) -> Tensor:
    """Keep weight ``[1, 1, h, w]`` at latent resolution: (1 − maxpool_f(m))·strength, ``f`` the VAE's factor
    (8 for Qwen-Image-Edit, 16 for Qwen-Image-2.1)."""
    h, w = latent_hw
    m = torch.from_numpy(np.asarray(binary_mask(mask, (w * factor, h * factor)), dtype=np.float32) / 255.0)
    m_lat = torch.nn.functional.max_pool2d(m[None, None], kernel_size=factor)
    return (1.0 - m_lat) * check_strength(strength)


def keep_source(x: Tensor, sigma: float, z_src: Tensor, prior: Tensor, weight: Tensor) -> Tensor:
    """``(1−k)·x + k·((1−σ)·z_src + σ·prior)``: pure latent blend (k = ``weight``)."""
    kept = (1 - sigma) * z_src + sigma * prior
    return x * (1 - weight) + kept * weight


@dataclass
class LatentMaskBlend:
    """The sampler's ``keep(x, σ)`` hook: everything on the latents' device/dtype."""

    z_src: Tensor    # [B, 16, h, w] source latents at the output size
    prior: Tensor    # [B, 16, h, w] the sampler's start (noise / LBM prior)
    weight: Tensor   # [1 or B, 1, h, w] keep weight

    def __call__(self, x: Tensor, sigma: float) -> Tensor:
        return keep_source(x, float(sigma), self.z_src, self.prior, self.weight)


def pixel_edit_weight(mask: Image.Image, size: tuple[int, int], feather: float = 0.0) -> np.ndarray:
    """Edit weight m ∈ [0, 1] ``[h, w]`` at ``size`` = (w, h); feathered inside the mask only."""
    m = binary_mask(mask, size)
    if feather > 0:
        grow = 2 * math.ceil(2 * feather) + 1  # erode by ~2σ so the blur's tail stays inside
        soft = m.filter(ImageFilter.MinFilter(grow)).filter(ImageFilter.GaussianBlur(feather))
        arr = np.minimum(np.asarray(soft, dtype=np.float32), np.asarray(m, dtype=np.float32))
    else:
        arr = np.asarray(m, dtype=np.float32)
    return arr / 255.0


def blend_pixels(decoded: Image.Image, source: Image.Image, mask: Image.Image, strength: float = 1.0,
                 feather: float = 0.0) -> Image.Image:
    """``(1−k)·decoded + k·source`` with k = (1 − m)·strength; ``source`` is resized to ``decoded``'s size."""
    size = decoded.size
    keep = (1.0 - pixel_edit_weight(mask, size, feather)) * check_strength(strength)
    src = np.asarray(resize_to(to_rgb(source), size), dtype=np.float32)
    dec = np.asarray(decoded.convert("RGB"), dtype=np.float32)
    out = dec * (1.0 - keep[..., None]) + src * keep[..., None]
    return Image.fromarray(np.clip(np.rint(out), 0, 255).astype(np.uint8), mode="RGB")
