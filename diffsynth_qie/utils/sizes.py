"""Image sizes under a pixel budget, in multiples of a divisor: pure integer math shared by every layer
(``data/images.py`` re-exports it; the model-family seam sizes references with it)."""
from __future__ import annotations

import math


def fit_to_budget(width: int, height: int, max_pixels: int, divisor: int = 16,
                  *, upscale: bool = False) -> tuple[int, int]:
    """Target size for a ``width`` x ``height`` image under a pixel budget.

    Returns ``(w2, h2)`` with ``w2 * h2 <= max_pixels``, both sides multiples of
    ``divisor`` and at least ``divisor``, and the aspect ratio kept as closely as
    rounding *down* to the divisor allows (rounding down never breaks the
    budget). Images already under the budget are not enlarged unless
    ``upscale`` (they are only trimmed to the divisor), matching DiffSynth's
    dynamic-resolution behaviour. Extreme aspect ratios are clamped: the short
    side stays >= ``divisor`` and the long side shrinks to keep the budget.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if divisor <= 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    if max_pixels < divisor * divisor:
        raise ValueError(f"max_pixels={max_pixels} is smaller than one {divisor}x{divisor} block; "
                         f"use max_pixels >= {divisor * divisor}")
    scale = math.sqrt(max_pixels / (width * height))
    if not upscale:
        scale = min(scale, 1.0)
    w2 = max(divisor, int(width * scale + 1e-9) // divisor * divisor)
    h2 = max(divisor, int(height * scale + 1e-9) // divisor * divisor)
    # Only reachable after clamping a side up to `divisor`: shrink the long side.
    if w2 * h2 > max_pixels:
        if w2 >= h2:
            w2 = max(divisor, max_pixels // h2 // divisor * divisor)
        else:
            h2 = max(divisor, max_pixels // w2 // divisor * divisor)
    assert w2 * h2 <= max_pixels and w2 % divisor == 0 and h2 % divisor == 0, (w2, h2)
    return w2, h2


def fit_image(size: tuple[int, int], max_pixels: int, divisor: int = 16, source: str = "image") -> tuple[int, int]:
    """:func:`fit_to_budget` for a real image: refuses (``ValueError``) a side shorter than
    ``divisor`` pixels, which could only be met by enlarging the image."""
    width, height = size
    if width < divisor or height < divisor:
        raise ValueError(f"{source} is {width}x{height} pixels; images need at least {divisor} pixels per side "
                         "(they are never enlarged). Use a larger image.")
    return fit_to_budget(width, height, max_pixels, divisor)
