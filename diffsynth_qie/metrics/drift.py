"""Unintended global drift of an edit: shift, zoom and colour cast of the output against its source.

Pure functions on batches ``[B, 3, H, W]`` in [0, 1] (one value per sample):

- :func:`phase_shift`: the global translation ``(dy, dx)`` in pixels, sub-pixel, by phase
  correlation (the peak of the normalised cross-power spectrum, refined on each axis from
  its larger neighbour);
- :func:`scale_factor`: how much the output looks zoomed, from the radial profile of the
  Fourier magnitude (a shift does not change it), searched over 0.70-1.42;
- :func:`colour_cast`: the mean RGB difference (output − source) over the pixels a weight
  map selects (outside the edit), and its length.

An edit that changes one object leaves all three at rest; a model that drifts moves them
for the whole picture, which PSNR alone reports only as "worse".

``qie check-dataset`` measures a pair's shift and zoom its own way (``data/check_align.py``: phase correlation
per block and a robust fit over the blocks that did not change), not with these: a dataset pair's moved, inserted
or recoloured object is not drift. Judged with these global measures instead (the changed region pasted from
the source first, as the scorecard does), the check's labelled benchmark (``benchmarks/pairs_bench.py``, 256 px)
fell from 100 % precision and recall to 30 % / 25 % on ``shifted`` and 42 % / 42 % on ``scale_mismatch``.
"""
from __future__ import annotations

import math

import torch

Tensor = torch.Tensor
SCALE_RANGE = (0.70, 1.42)
SCALE_STEP = 0.01


def _gray(x: Tensor) -> Tensor:
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"drift metrics need [B, 3, H, W] batches, got {tuple(x.shape)}")
    w = torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64, device=x.device)
    return (x.double() * w[None, :, None, None]).sum(1)


def _refine(left: Tensor, mid: Tensor, right: Tensor) -> Tensor:
    """The sub-pixel offset of a phase-correlation peak from its larger neighbour: the peak of a pure shift is a
    sampled sinc, whose neighbour ratio gives the offset exactly (Foroosh, Zerubia and Berthod, 2002); the
    side lobe on the far side is negative and drops out, equal neighbours cancel."""
    r, l = right.clamp_min(0), left.clamp_min(0)
    off = r / (r + mid).clamp_min(1e-12) - l / (l + mid).clamp_min(1e-12)  # symmetric neighbours: 0
    return off.clamp(-0.5, 0.5)


def phase_shift(source: Tensor, output: Tensor) -> Tensor:
    """``[B, 2]``: ``(dy, dx)`` in pixels with ``output ≈ source`` moved by it (sub-pixel)."""
    if source.shape != output.shape:
        raise ValueError(f"phase_shift needs batches of one shape, got {tuple(source.shape)}, {tuple(output.shape)}")
    a, b = _gray(source), _gray(output)
    fa = torch.fft.fft2(a - a.mean((-2, -1), keepdim=True))
    fb = torch.fft.fft2(b - b.mean((-2, -1), keepdim=True))
    cross = fb * fa.conj()
    mag = cross.abs()
    corr = torch.fft.ifft2(cross / (mag + 1e-9 * mag.amax((-2, -1), keepdim=True) + 1e-30)).real
    n, h, w = corr.shape
    peak = corr.flatten(1).argmax(1)
    py, px = peak // w, peak % w
    rows = torch.arange(n, device=corr.device)
    mid = corr[rows, py, px]
    dy = py.double() + _refine(corr[rows, (py - 1) % h, px], mid, corr[rows, (py + 1) % h, px])
    dx = px.double() + _refine(corr[rows, py, (px - 1) % w], mid, corr[rows, py, (px + 1) % w])
    dy = torch.where(dy > h / 2, dy - h, dy)
    dx = torch.where(dx > w / 2, dx - w, dx)
    shift = torch.stack([dy, dx], 1)
    return torch.where(shift.abs() < 1e-9, torch.zeros_like(shift), shift).float()  # rounding noise is no shift


def _radial_profile(a: Tensor) -> Tensor:
    """``[B, R]``: log of the mean (Hann-windowed) Fourier magnitude per integer radius."""
    _, h, w = a.shape
    window = torch.outer(torch.hann_window(h, periodic=False, dtype=a.dtype),
                         torch.hann_window(w, periodic=False, dtype=a.dtype))
    f = torch.fft.fftshift(torch.fft.fft2((a - a.mean((-2, -1), keepdim=True)) * window).abs(), dim=(-2, -1))
    y, x = torch.meshgrid(torch.arange(h, dtype=a.dtype), torch.arange(w, dtype=a.dtype), indexing="ij")
    r = torch.hypot(y - h / 2, x - w / 2).long().flatten()
    n = min(h, w) // 2
    keep = r < n
    count = torch.bincount(r[keep], minlength=n).to(a.dtype)
    total = torch.zeros(a.shape[0], n, dtype=a.dtype).index_add_(1, r[keep], f.flatten(1)[:, keep])
    return torch.log(total / count.clamp_min(1) + 1e-9)


def scale_factor(source: Tensor, output: Tensor) -> Tensor:
    """``[B]``: the zoom ``k`` for which the source's radial spectrum at ``k·r`` best matches the output's at ``r``;
    NaN where the best fit is at the edge of the search range (no zoom explains the output)."""
    if min(source.shape[-2:]) < 16:
        raise ValueError(f"scale_factor needs images of at least 16 px per side, got {tuple(source.shape[-2:])}")
    pa, pb = _radial_profile(_gray(source)), _radial_profile(_gray(output))
    radii = torch.arange(3, pa.shape[1] // 2, dtype=torch.float64)
    target = pb[:, radii.long()]
    target = target - target.mean(1, keepdim=True)
    ks = torch.arange(SCALE_RANGE[0], SCALE_RANGE[1] + SCALE_STEP / 2, SCALE_STEP, dtype=torch.float64)
    pos = (radii[None, :] * ks[:, None]).clamp(max=pa.shape[1] - 1)          # [K, R]
    lo = pos.floor().long()
    hi = (lo + 1).clamp(max=pa.shape[1] - 1)
    frac = pos - lo
    v = pa[:, lo] * (1 - frac) + pa[:, hi] * frac                             # [B, K, R]
    v = v - v.mean(-1, keepdim=True)
    err = (target[:, None, :] - v).pow(2).mean(-1)
    best = err.argmin(1)
    # a best fit at the edge of the search is no estimate (the spectra do not match at any zoom): NaN
    edge = (best == 0) | (best == len(ks) - 1)
    return torch.where(edge, torch.full_like(ks[best], math.nan), ks[best]).float()


def colour_cast(source: Tensor, output: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(``[B, 3]`` mean RGB difference output − source over ``weight`` ``[B, 1, H, W]``, ``[B]`` its length);
    NaN where the weights select nothing."""
    if source.shape != output.shape or weight.shape != (source.shape[0], 1, *source.shape[-2:]):
        raise ValueError(f"colour_cast needs two [B, 3, H, W] batches and a [B, 1, H, W] weight, got "
                         f"{tuple(source.shape)}, {tuple(output.shape)}, {tuple(weight.shape)}")
    w = weight.double().clamp(0, 1)
    total = w.flatten(1).sum(1)
    mean = ((output.double() - source.double()) * w).flatten(2).sum(2) / total.clamp_min(1e-20)[:, None]
    mean = torch.where(total[:, None] > 0, mean, torch.full_like(mean, math.nan))
    return mean.float(), mean.norm(dim=1).float()
