"""The edit scorecard: what an edit kept, what it changed, and how it drifted, per row and in aggregate.

:func:`score_batch` takes batches ``[B, 3, H, W]`` in [0, 1] of the source, the output and
(optionally) the target, and an edit region ``[B, 1, H, W]`` (1 = may change). Where a row
has no mask, the region is estimated from the pair: :func:`changed_region` thresholds
``|target − source|`` (dilated); with neither a mask nor a target the region-based
metrics are not computed for that row. Every metric is one number per row:

===================  ==========================================================  ========
name                 what                                                         better
===================  ==========================================================  ========
``preserve_psnr``    PSNR source vs output outside the region                     higher
``preserve_ssim``    SSIM source vs output, averaged outside the region           higher
``preserve_lpips``   LPIPS source vs the output with the region pasted from the   lower
                     source (only the outside can differ); when LPIPS loads
``edit_psnr``        PSNR output vs target inside the region                      higher
``edit_ssim``        SSIM output vs target, averaged inside the region            higher
``shift_px``         length of the global shift (phase correlation, sub-pixel)    lower
                     of the output with the region pasted from the source
``scale_drift``      ``|zoom − 1|`` (radial Fourier profile), the same way;       lower
                     images of at least 64 px per side
``colour_cast``      length of the mean RGB change outside the region             lower
===================  ==========================================================  ========

A metric never reports a value it did not compute: a row where a metric has nothing to
measure (no region, an empty outside) simply lacks the key. ``score_rules.win_rate`` compares two
score lists row by row (the LoRA against the base) in the metric's own direction.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .drift import colour_cast, phase_shift, scale_factor
from .image import masked_psnr, masked_ssim

Tensor = torch.Tensor

REGION_THRESHOLD = 0.1   # |target − source| (largest channel) above this is part of the changed region
REGION_DILATE = 2        # pixels the estimated region grows by
SCALE_MIN_SIDE = 64      # below this the radial spectrum has too few radii for a zoom estimate: not reported


def changed_region(source: Tensor, target: Tensor, threshold: float = REGION_THRESHOLD,
                   dilate: int = REGION_DILATE) -> Tensor:
    """``[B, 1, H, W]`` in {0, 1}: where the target differs from the source (largest channel difference above
    ``threshold``), grown by ``dilate`` pixels (the same idea as ``qie cache --auto_mask diff``)."""
    diff = (target.double() - source.double()).abs().amax(1, keepdim=True)
    region = (diff > threshold).double()
    if dilate > 0:
        region = F.max_pool2d(region, 2 * dilate + 1, stride=1, padding=dilate)
    return region.float()


def score_batch(source: Tensor, output: Tensor, target: Optional[Tensor] = None,
                region: Optional[Tensor] = None, has_region: Optional[Sequence[bool]] = None,
                lpips_model=None) -> list[dict[str, float]]:
    """One dict of scores per row (see the module docstring).

    ``region``: the edit masks ``[B, 1, H, W]``; rows where ``has_region`` is False (or all rows when
    ``region`` is None) use :func:`changed_region` of their target, or get no region metric without a target.
    """
    if source.shape != output.shape or (target is not None and target.shape != source.shape):
        raise ValueError(f"scorecard needs batches of one shape: source {tuple(source.shape)}, output "
                         f"{tuple(output.shape)}, target {None if target is None else tuple(target.shape)}")
    n = source.shape[0]
    masked = [False] * n if region is None else list(has_region if has_region is not None else [True] * n)
    known = torch.tensor([m or target is not None for m in masked])
    reg = torch.zeros(n, 1, *source.shape[-2:]) if region is None else region.float().clone()
    if target is not None:
        estimate = changed_region(source, target)
        for i, m in enumerate(masked):
            if not m:
                reg[i] = estimate[i]
    keep = 1 - reg
    # drift is measured on what should have stayed: the edit region is pasted from the source first
    steady = torch.where(known[:, None, None, None], output * keep + source * reg, output)
    columns: dict[str, Tensor] = {"shift_px": phase_shift(source, steady).norm(dim=1)}
    if min(source.shape[-2:]) >= SCALE_MIN_SIDE:
        columns["scale_drift"] = (scale_factor(source, steady) - 1).abs()
    region_columns = {"preserve_psnr": masked_psnr(output, source, keep),
                      "preserve_ssim": masked_ssim(output, source, keep),
                      "colour_cast": colour_cast(source, output, keep)[1]}
    if lpips_model is not None:
        from .lpips import lpips_distance

        pasted = output * keep + source * reg
        with torch.no_grad():
            region_columns["preserve_lpips"] = lpips_distance(lpips_model, source, pasted)
    if target is not None:
        region_columns["edit_psnr"] = masked_psnr(output, target, reg)
        region_columns["edit_ssim"] = masked_ssim(output, target, reg)
    rows = []
    for i in range(n):
        row = {k: float(v[i]) for k, v in columns.items() if math.isfinite(float(v[i]))}
        if known[i]:
            row.update({k: float(v[i]) for k, v in region_columns.items() if math.isfinite(float(v[i]))})
        rows.append(row)
    return rows
