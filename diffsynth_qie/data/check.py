"""``qie check-dataset``: the pair problems that silently spoil an edit LoRA, measured per row.

Each row's images are read through the project's one loader (``images.load_rgb`` / ``load_mask``) in a process
pool, at a working size of at most :data:`WORK_SIDE` px, and measured; thresholds turn measurements into flags:

- ``unreadable`` / ``too_small``: the loader refuses the file, or a side is below ``images.MIN_SIDE``;
- ``near_identical``: PSNR(target, source) above ``psnr_identical`` dB: the pair teaches nothing;
- ``shifted``: phase correlation finds a global shift of at least ``max_shift`` px (in target pixels) between
  source and target: a misaligned pair teaches the model to move images;
- ``scale_mismatch``: the target looks zoomed against the source by more than ``max_scale_change`` (the
  factor that best maps the source's radial Fourier magnitude profile, which a shift leaves unchanged, onto
  the target's, searched over 0.7-1.4);
- ``aspect``: the source's and target's aspect ratios differ by more than ``aspect_tolerance``: a resize to
  one size would stretch one of them;
- ``duplicate`` / ``holdout_duplicate``: the same target (64-bit difference hash within ``dup_distance`` bits)
  as an earlier row, or as a row of ``--holdout``;
- ``mask_aspect``: the mask's aspect ratio is not the target's (a mask made for another image; it is not
  stretched to measure the mask flags below);
- ``mask_empty`` / ``mask_full``: a mask covering under ``mask_empty`` or over ``mask_full`` of the image;
- ``changes_outside_mask``: a mean absolute difference outside the mask above ``outside_change``;
- ``reversed``: the row's colour change inside its edit region (its mask, else the pair's own difference,
  ``automask.diff_mask``) points against the dataset's majority (cosine below -0.5). The heuristic only
  decides for datasets with one consistent edit: when the majority change is weaker than ``min_majority``,
  no row is judged and the report says so;
- ``error``: measuring the row raised (its message); each row is measured inside its own error boundary, so
  one bad row never stops the check.

Every measure is a finite number or ``null``: an exact copy has ``psnr`` ``null`` and ``identical`` true (the
report is strict JSON). Work is bounded: at most one worker per core and per row; the duplicate pass is a hash
index (``check_dups.py``), near-linear in the rows; every phase shows its progress.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np
from PIL import Image

from ..utils.config_cli import cli_help

log = logging.getLogger(__name__)

WORK_SIDE = 256


@dataclass(frozen=True)
class CheckConfig:
    psnr_identical: float = field(default=40.0, metadata=cli_help("near_identical above this PSNR, dB", unbounded=True))
    max_shift: float = field(default=2.0, metadata=cli_help("shifted from this global shift on, target pixels", min=0))
    max_scale_change: float = field(default=0.05, metadata=cli_help(
        "scale_mismatch when the target looks zoomed by more than this relative factor", min=0))
    aspect_tolerance: float = field(default=0.02, metadata=cli_help("aspect above this relative difference", min=0))
    dup_distance: int = field(default=4, metadata=cli_help("duplicate within this many of 64 hash bits", min=0, max=64))
    mask_empty: float = field(default=0.001, metadata=cli_help("mask_empty below this fraction", min=0, max=1))
    mask_full: float = field(default=0.999, metadata=cli_help("mask_full above this fraction", min=0, max=1))
    outside_change: float = field(default=0.04, metadata=cli_help(
        "changes_outside_mask above this mean difference outside the mask (fraction of the range)", min=0, max=1))
    min_majority: float = field(default=0.04, metadata=cli_help(
        "reversed: judged only when the dataset's median colour change is at least this strong", min=0))
    workers: int = field(default=4, metadata=cli_help(
        "processes measuring rows (0: this one); at most the core count and the row count", min=0, max=1024))


@dataclass
class RowCheck:
    """One row's measurements and flags (``flags``: name -> the measured value that tripped it)."""

    index: int
    row_id: str
    paths: dict
    flags: dict = field(default_factory=dict)
    measures: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _work(im: Image.Image) -> Image.Image:
    scale = min(1.0, WORK_SIDE / max(im.size))
    return im if scale == 1.0 else im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))),
                                             Image.Resampling.BILINEAR)


def _gray(im: Image.Image) -> np.ndarray:
    return np.asarray(im.convert("L"), dtype=np.float64) / 255.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def phase_shift(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """``(dy, dx)`` with ``b ≈ a`` shifted by it (phase correlation over equal-size grayscale arrays)."""
    fa, fb = np.fft.fft2(a - a.mean()), np.fft.fft2(b - b.mean())
    cross = fb * np.conj(fa)
    corr = np.fft.ifft2(cross / np.maximum(np.abs(cross), 1e-12)).real
    dy, dx = np.unravel_index(int(np.argmax(corr)), corr.shape)
    h, w = corr.shape
    return float(dy - h if dy > h // 2 else dy), float(dx - w if dx > w // 2 else dx)


def _radial_profile(a: np.ndarray) -> np.ndarray:
    """Log of the mean Fourier magnitude per radius (windowed; a shift does not change it)."""
    window = np.outer(np.hanning(a.shape[0]), np.hanning(a.shape[1]))
    f = np.abs(np.fft.fftshift(np.fft.fft2((a - a.mean()) * window)))
    y, x = np.indices(a.shape)
    r = np.hypot(y - a.shape[0] / 2, x - a.shape[1] / 2).astype(int).ravel()
    n = min(a.shape) // 2
    total, count = np.bincount(r, f.ravel(), minlength=n)[:n], np.bincount(r, minlength=n)[:n]
    return np.log(total / np.maximum(count, 1) + 1e-9)


def scale_factor(a: np.ndarray, b: np.ndarray) -> float:
    """How much ``b`` looks zoomed against ``a`` (equal-size grayscale arrays): the factor ``k`` in 0.70-1.42 for
    which ``a``'s radial spectrum at ``k·r`` best matches ``b``'s at ``r`` (mean-removed squared error)."""
    pa, pb = _radial_profile(a), _radial_profile(b)
    radii = np.arange(3, len(pa) // 2)
    target = pb[radii] - pb[radii].mean()
    errors = []
    for k in np.arange(0.70, 1.425, 0.01):
        v = np.interp(radii * k, np.arange(len(pa)), pa)
        errors.append((float(((target - (v - v.mean())) ** 2).mean()), float(k)))
    return min(errors)[1]


def dhash(im: Image.Image) -> int:
    """64-bit difference hash (9x8 grayscale, left-right gradients)."""
    g = np.asarray(im.convert("L").resize((9, 8), Image.Resampling.BILINEAR), dtype=np.int16)
    bits = (g[:, 1:] > g[:, :-1]).flatten()
    return int(sum(1 << i for i, bit in enumerate(bits) if bit))


def measure_row(task: tuple[int, dict, CheckConfig]) -> RowCheck:
    """A row's measurements and its own flags (everything but the dataset-level ones); runs in a worker. Any
    error measuring it becomes the row's ``error`` flag: one bad row never stops the check."""
    index, row, cfg = task
    out = RowCheck(index, row["row_id"], {k: v for k, v in row.items() if k != "row_id" and v})
    try:
        _measure(out, row, cfg)
    except Exception as e:  # noqa: BLE001 - the row's own boundary: reported with the row, the others go on
        log.debug("row %s: measuring failed", out.row_id, exc_info=True)
        out.flags["error"] = f"{type(e).__name__}: {e}"
    return out


def _measure(out: RowCheck, row: dict, cfg: CheckConfig) -> None:
    from .automask import diff_mask
    from .images import MIN_SIDE, aspect_differs, load_mask, load_rgb

    try:
        target = load_rgb(row["target"])
        source = load_rgb(row["source"]) if row.get("source") else None
        mask = load_mask(row["mask"]) if row.get("mask") else None
    except (OSError, ValueError) as e:
        out.flags["unreadable"] = str(e)
        return
    small = [f"{im.width}x{im.height}" for im in (target, source, mask) if im is not None and min(im.size) < MIN_SIDE]
    if small:
        out.flags["too_small"] = small[0]
        return
    out.measures["target_hash"] = dhash(target)
    if source is None:
        return
    ar_t, ar_s = target.width / target.height, source.width / source.height
    out.measures["aspect_ratio_difference"] = round(abs(ar_t / ar_s - 1.0), 4)
    if out.measures["aspect_ratio_difference"] > cfg.aspect_tolerance:
        out.flags["aspect"] = f"target {target.width}x{target.height}, source {source.width}x{source.height}"
    t_work = _work(target)
    s_work = _work(source.resize(target.size, Image.Resampling.BILINEAR))
    a, b = _gray(s_work), _gray(t_work)
    value = psnr(a, b)
    out.measures["psnr"] = round(value, 2) if math.isfinite(value) else None  # (strict JSON: no Infinity)
    if not math.isfinite(value):
        out.measures["identical"] = True
    if value > cfg.psnr_identical:
        out.flags["near_identical"] = out.measures["psnr"] if math.isfinite(value) else "identical"
    out.measures["scale"] = round(scale_factor(a, b), 2)
    if abs(out.measures["scale"] - 1.0) > cfg.max_scale_change:  # (a zoom has no single shift: not measured then)
        out.flags["scale_mismatch"] = out.measures["scale"]
    else:
        px = target.width / t_work.width
        dy, dx = phase_shift(a, b)
        out.measures["shift_px"] = [round(dy * px, 1), round(dx * px, 1)]
        if math.hypot(dy, dx) * px >= cfg.max_shift:
            out.flags["shifted"] = out.measures["shift_px"]
    if mask is not None and aspect_differs(mask.size, target.size):
        out.flags["mask_aspect"] = f"mask {mask.width}x{mask.height}, target {target.width}x{target.height}"
        mask = None  # (made for another image: not stretched to measure it)
    region = mask.resize(target.size, Image.Resampling.NEAREST) if mask is not None else diff_mask(target, source)
    inside = np.asarray(_work(region), dtype=np.float64) / 255.0 > 0.5
    if mask is not None:
        out.measures["mask_fraction"] = round(float(inside.mean()), 4)
        if inside.mean() < cfg.mask_empty:
            out.flags["mask_empty"] = out.measures["mask_fraction"]
        elif inside.mean() > cfg.mask_full:
            out.flags["mask_full"] = out.measures["mask_fraction"]
        elif (~inside).any():
            change = np.abs(np.asarray(t_work, np.float64) - np.asarray(s_work, np.float64)).mean(-1) / 255.0
            out.measures["outside_change"] = round(float(change[~inside].mean()), 4)
            if out.measures["outside_change"] > cfg.outside_change:
                out.flags["changes_outside_mask"] = out.measures["outside_change"]
    if inside.any() and not (mask is not None and inside.all()):
        diff = (np.asarray(t_work, np.float64) - np.asarray(s_work, np.float64))[inside].mean(0) / 255.0
        out.measures["direction"] = [round(float(v), 4) for v in diff]


def pool_size(workers: int, rows: int) -> int:
    """``--workers``, at most the cores this process may use and the rows (0: measure in this process)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = max(0, min(workers, cores, rows))
    if n < workers:
        log.info("--workers %d: using %d (%d core(s), %d row(s))", workers, n, cores, rows)
    return n


def check_rows(rows: Sequence[dict], cfg: CheckConfig, holdout: Sequence[dict] = (), show_progress: bool = True
               ) -> tuple[list[RowCheck], Optional[str]]:
    """Measure ``rows`` (dicts: row_id, target, source, mask) and flag them; returns every row's check and a note
    when the direction heuristic could not decide."""
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    from .check_dups import flag_duplicates

    tasks = [(i, r, cfg) for i, r in enumerate(rows)] + [(-1 - i, r, cfg) for i, r in enumerate(holdout)]
    workers = pool_size(cfg.workers, len(tasks))
    checks = []
    with tqdm(total=len(tasks), unit="row", desc="check-dataset: measuring", disable=not show_progress) as bar:
        with ProcessPoolExecutor(workers) if workers > 0 else _InProcess() as pool:
            for c in pool.map(measure_row, tasks, chunksize=max(1, min(64, len(tasks) // (4 * max(workers, 1))))):
                checks.append(c)
                bar.update(1)
    held, checks = [c for c in checks if c.index < 0], [c for c in checks if c.index >= 0]
    hashed = [c for c in checks if "target_hash" in c.measures]
    with tqdm(total=len(hashed), unit="row", desc="check-dataset: duplicates", disable=not show_progress) as bar:
        found = flag_duplicates([(c.measures["target_hash"], c.row_id) for c in hashed],
                                [(c.measures["target_hash"], c.row_id) for c in held if "target_hash" in c.measures],
                                cfg.dup_distance, progress=bar.update)
    for i, flags in found.items():
        hashed[i].flags.update(flags)
    return checks, _flag_reversed(checks, cfg)


class _InProcess:
    """``--workers 0``: the pool's ``map`` in this process."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, items, chunksize=1):
        return map(fn, items)


def _flag_reversed(checks: list[RowCheck], cfg: CheckConfig) -> Optional[str]:
    vectors = [(c, np.array(c.measures["direction"])) for c in checks
               if "direction" in c.measures and not c.flags]
    if len(vectors) < 3:
        return "too few rows with a measurable change to judge their direction"
    majority = np.median(np.stack([v for _, v in vectors]), axis=0)
    if np.linalg.norm(majority) < cfg.min_majority:
        return (f"no majority edit direction (median colour change {np.linalg.norm(majority):.3f} < "
                f"{cfg.min_majority}): the edits differ too much for the direction heuristic to decide")
    for c, v in vectors:
        norm = np.linalg.norm(v)
        if norm >= cfg.min_majority and float(v @ majority) / (norm * np.linalg.norm(majority)) < -0.5:
            c.flags["reversed"] = "its colour change inside the edit region opposes the dataset's majority"
    return None
