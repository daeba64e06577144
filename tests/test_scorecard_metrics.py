"""The scorecard's metrics on constructed cases with known answers: an identical copy, a (sub-pixel) shifted
copy, a zoomed copy, a recolour inside versus outside the mask, and the win rate."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffsynth_qie.metrics import drift, score_rules as R, scorecard as S
from diffsynth_qie.metrics.image import MAX_PSNR, masked_ssim, ssim


def smooth_image(seed=0, size=64) -> torch.Tensor:
    """A smooth random RGB image ``[1, 3, H, W]`` in [0, 1] (periodic, so exact Fourier shifts apply)."""
    rng = np.random.default_rng(seed)
    f = np.fft.fft2(rng.random((3, size, size)))
    k = np.hypot(*np.meshgrid(np.fft.fftfreq(size), np.fft.fftfreq(size), indexing="ij"))
    img = np.fft.ifft2(f * np.exp(-(k / 0.25) ** 2)).real
    img = (img - img.min()) / (img.max() - img.min())
    return torch.from_numpy(img)[None].float()


def fourier_shift(x: torch.Tensor, dy: float, dx: float) -> torch.Tensor:
    h, w = x.shape[-2:]
    ky = torch.fft.fftfreq(h, dtype=torch.float64)[:, None]
    kx = torch.fft.fftfreq(w, dtype=torch.float64)[None, :]
    phase = torch.exp(-2j * math.pi * (ky * dy + kx * dx))
    return torch.fft.ifft2(torch.fft.fft2(x.double()) * phase).real.float()


def box_mask(size=64, lo=20, hi=44) -> torch.Tensor:
    m = torch.zeros(1, 1, size, size)
    m[..., lo:hi, lo:hi] = 1
    return m


def test_identical_copy_is_perfect_everywhere():
    x = smooth_image()
    [row] = S.score_batch(x, x.clone(), target=x.clone(), region=box_mask())
    assert row["preserve_psnr"] == MAX_PSNR and row["edit_psnr"] == MAX_PSNR
    assert row["preserve_ssim"] == pytest.approx(1.0) and row["edit_ssim"] == pytest.approx(1.0)
    assert row["shift_px"] == pytest.approx(0, abs=1e-6) and row["scale_drift"] == pytest.approx(0, abs=1e-6)
    assert row["colour_cast"] == 0


@pytest.mark.parametrize("dy,dx", [(2.5, -1.25), (0.3, 0.7), (-3.0, 4.0)])
def test_shifted_copy_reports_its_sub_pixel_shift(dy, dx):
    x = smooth_image(1)
    got = drift.phase_shift(torch.cat([x, x]), torch.cat([x, fourier_shift(x, dy, dx)]))
    assert got[0].tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    assert got[1].tolist() == pytest.approx([dy, dx], abs=0.05)
    [row] = S.score_batch(x, fourier_shift(x, dy, dx))
    assert row["shift_px"] == pytest.approx(math.hypot(dy, dx), abs=0.05)
    assert "preserve_psnr" not in row  # no mask and no target: no region, so nothing measured there


def test_zoomed_copy_reports_its_scale():
    x = smooth_image(2, size=96)
    zoomed = torch.nn.functional.interpolate(x, scale_factor=1.2, mode="bicubic", align_corners=False)
    off = (zoomed.shape[-1] - 96) // 2
    zoomed = zoomed[..., off:off + 96, off:off + 96].clamp(0, 1)
    got = drift.scale_factor(torch.cat([x, x]), torch.cat([x, zoomed]))
    assert got[0] == pytest.approx(1.0) and got[1] == pytest.approx(1.2, abs=0.03)


def test_recolour_inside_the_mask_keeps_preservation_and_outside_breaks_it():
    x, mask = smooth_image(3), box_mask()
    inside = x.clone()
    inside[:, 0] = torch.where(mask[:, 0].bool(), 1 - inside[:, 0], inside[:, 0])  # red flipped inside only
    outside = x.clone()
    outside[:, 2] = torch.where(mask[:, 0].bool(), outside[:, 2], (outside[:, 2] + 0.2).clamp(max=1))
    rows = S.score_batch(torch.cat([x, x]), torch.cat([inside, outside]), target=torch.cat([inside, inside]),
                         region=torch.cat([mask, mask]))
    good, bad = rows
    assert good["preserve_psnr"] == MAX_PSNR and good["colour_cast"] == 0 and good["edit_psnr"] == MAX_PSNR
    assert bad["preserve_psnr"] < 20 and bad["colour_cast"] > 0.1
    assert bad["edit_psnr"] < 20  # the inside was not edited toward the target
    _, cast = drift.colour_cast(x, outside, 1 - mask)
    assert cast.item() == pytest.approx(bad["colour_cast"])
    mean, _ = drift.colour_cast(x, outside, 1 - mask)
    assert mean[0, 0] == 0 and mean[0, 1] == 0 and mean[0, 2] > 0.1  # a blue cast, nothing else


def test_without_a_mask_the_region_comes_from_the_target():
    x, mask = smooth_image(4), box_mask()
    target = x.clone()
    target[:, 1] = torch.where(mask[:, 0].bool(), 1 - target[:, 1], target[:, 1])
    region = S.changed_region(x, target)
    assert region[..., 0, 0] == 0 and region[..., 32, 32] == 1
    [row] = S.score_batch(x, target.clone(), target=target, has_region=[False], region=torch.zeros_like(mask))
    assert row["preserve_psnr"] == MAX_PSNR and row["edit_psnr"] == MAX_PSNR


def test_masked_ssim_is_ssim_where_the_weight_is_everywhere():
    a, b = smooth_image(5), smooth_image(6)
    full = torch.ones(1, 1, 64, 64)
    assert masked_ssim(a, b, full).item() == pytest.approx(ssim(a, b).item(), abs=1e-6)
    assert math.isnan(masked_ssim(a, b, torch.zeros_like(full)).item())


def test_win_rate_counts_rows_the_lora_made_better_in_each_metric_direction():
    base = [{"edit_psnr": 20.0, "shift_px": 1.0}, {"edit_psnr": 25.0, "shift_px": 0.0}, {"shift_px": 0.5}]
    tuned = [{"edit_psnr": 22.0, "shift_px": 0.0}, {"edit_psnr": 24.0, "shift_px": 0.01}, {"shift_px": 2.0}]
    rate, rows = R.win_rate(base, tuned, "edit_psnr")
    assert rate == 0.5 and rows == [0]                 # the third row has no edit_psnr: not counted
    rate, rows = R.win_rate(base, tuned, "shift_px")   # lower is better; 0.0 vs 0.01 is a tie
    assert rate == pytest.approx((1 + 0.5 + 0) / 3) and rows == [0]
    assert R.win_rate(base, tuned, "preserve_lpips") is None
    assert R.worst_rows(tuned, "edit_psnr", 1) == [0] and R.worst_rows(tuned, "shift_px", 1) == [2]
    assert R.aggregate(base)["shift_px"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one score per row"):
        R.win_rate(base, tuned[:2], "edit_psnr")


def test_scale_is_absent_where_no_zoom_explains_the_output():
    x, noise = smooth_image(7, size=64), torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    assert math.isnan(drift.scale_factor(x, noise).item())
    [row] = S.score_batch(x, noise)
    assert "scale_drift" not in row and "shift_px" in row
