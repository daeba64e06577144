"""An edit's region derived from the pair itself (``qie cache --auto_mask diff``), for rows without a mask.

``|target − source|`` (the largest channel difference per pixel, after both are at the target's cache size) is
blurred (Gaussian, ``blur`` px), thresholded (``threshold``, a fraction of the full range) and dilated
(``dilate`` px), so the region covers the whole changed object with a margin. White = may change, as a
hand-drawn ``back_mask``; the mask-weighted loss (``--mask_loss_weights``) then uses it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFilter


@dataclass(frozen=True)
class AutoMask:
    blur: float = 2.0        # Gaussian radius in pixels applied to the difference
    threshold: float = 0.1   # a blurred difference above this fraction of 255 is part of the edit
    dilate: int = 8          # pixels the region grows by on every side

    def __post_init__(self):
        if self.blur < 0 or not 0 < self.threshold < 1 or self.dilate < 0:
            raise ValueError(f"auto mask: blur {self.blur} must be >= 0, threshold {self.threshold} in (0, 1), "
                             f"dilate {self.dilate} >= 0 (--auto_mask_blur / _threshold / _dilate)")


def diff_mask(target: Image.Image, source: Image.Image, params: AutoMask = AutoMask()) -> Image.Image:
    """The edit region of a pair as a binary "L" mask at ``target``'s size (``source`` resized to it)."""
    if source.size != target.size:
        source = source.resize(target.size, Image.Resampling.LANCZOS)
    a = np.asarray(target.convert("RGB"), dtype=np.int16)
    b = np.asarray(source.convert("RGB"), dtype=np.int16)
    diff = Image.fromarray(np.abs(a - b).max(axis=-1).astype(np.uint8), mode="L")
    if params.blur > 0:
        diff = diff.filter(ImageFilter.GaussianBlur(params.blur))
    mask = diff.point(lambda v: 255 if v > params.threshold * 255 else 0)
    if params.dilate > 0:
        mask = mask.filter(ImageFilter.MaxFilter(2 * params.dilate + 1))
    return mask
