"""``qie check-dataset``: the pair problems that silently spoil an edit LoRA, measured per row.

Each row's images are read through the project's one loader (``images.load_rgb`` / ``load_mask``) in a process
pool, at a working size of at most :data:`WORK_SIDE` px, measured (``check_align.py``) and judged
(``check_rules.py``: every flag, its severity, reason and fix). Per row:

- ``unreadable`` / ``too_small`` / ``error``: the loader refuses a file, a side is below ``images.MIN_SIDE``, or
  measuring raised (each row is measured inside its own error boundary: one bad row never stops the check);
- ``aspect``: source and target aspect ratios differ by more than ``aspect_tolerance``;
- ``near_identical`` (PSNR above ``psnr_identical``) and ``no_op`` (no region changed: the source re-encoded),
  unless the instruction asks for no change;
- ``shifted`` / ``scale_mismatch``: the part that did not change moved or zoomed (robust block motion);
- ``wrong_source``: no motion explains the pair and the structures do not correlate;
- ``mask_aspect`` / ``mask_empty`` / ``changes_outside_mask`` (errors), ``mask_full`` / ``mask_loose`` (hints);
- ``reversed``: the edit region moves away from the colour the instruction names; ``direction_outlier`` (a
  warning): a row whose instruction names no colour changes colour against most rows with its instruction
  (judged only where those agree, ``min_majority``);
- ``duplicate`` (the same source and target, re-encoded or not, and instruction as an earlier row; two edits of
  one source are not duplicates), ``duplicate_pair`` (the same images with another instruction),
  ``holdout_duplicate`` (the target of a ``--holdout`` row).

Every measure is a finite number or ``null`` (strict JSON). Work is bounded: at most one worker per core and
per row; a row's images leave memory when it is measured (only hashes and a 16x16 thumbnail stay); the
duplicate pass is a hash index (``check_dups.py``), near-linear in the rows; every phase shows its progress.
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

WORK_SIDE = 384


@dataclass(frozen=True)
class CheckConfig:
    psnr_identical: float = field(default=40.0, metadata=cli_help("near_identical above this PSNR, dB", unbounded=True))
    psnr_no_op: float = field(default=26.0, metadata=cli_help(
        "no_op: a pair with no changed region and a PSNR above this, dB", unbounded=True))
    no_op_change: float = field(default=0.004, metadata=cli_help(
        "no_op when less than this share of the image's coarse cells (1/32 of its short side) changed", min=0, max=1))
    max_shift: float = field(default=2.0, metadata=cli_help("shifted from this global shift on, target pixels", min=0))
    max_scale_change: float = field(default=0.04, metadata=cli_help(
        "scale_mismatch when the target looks zoomed by more than this relative factor", min=0))
    min_agreement: float = field(default=0.4, metadata=cli_help(
        "shifted / scale_mismatch only when at least this share of the unchanged blocks agree on the motion",
        min=0, max=1))
    min_blocks: int = field(default=12, metadata=cli_help(
        "without a mask, a local edit's pair is judged on all its textured blocks only when it has this many "
        "(else on those outside the changed region)", min=4, max=10000))
    min_structure: float = field(default=0.25, metadata=cli_help(
        "wrong_source below this correlation of the two images' gradients (when no motion explains the pair)",
        min=-1, max=1))
    aspect_tolerance: float = field(default=0.02, metadata=cli_help("aspect above this relative difference", min=0))
    dup_distance: int = field(default=4, metadata=cli_help("duplicate within this many of 64 hash bits", min=0, max=64))
    mask_empty: float = field(default=0.001, metadata=cli_help("mask_empty below this fraction", min=0, max=1))
    mask_full: float = field(default=0.999, metadata=cli_help("mask_full above this fraction", min=0, max=1))
    outside_change: float = field(default=0.02, metadata=cli_help(
        "changes_outside_mask when more than this fraction of the area outside the mask changed", min=0, max=1))
    min_colour_evidence: float = field(default=0.03, metadata=cli_help(
        "reversed when the edit region moves at least this far (chromaticity) away from the named colour", min=0))
    min_majority: float = field(default=0.04, metadata=cli_help(
        "reversed: judged only when the dataset's median colour change is at least this strong", min=0))
    workers: int = field(default=4, metadata=cli_help(
        "processes measuring rows (0: this one); at most the core count and the row count", min=0, max=1024))


@dataclass
class RowCheck:
    """One row's measurements and flags (``flags``: name -> the measured value that tripped it; ``issues``:
    name -> severity, reason, fix, confidence). Measures named ``_...`` stay in memory only."""

    index: int
    row_id: str
    paths: dict
    flags: dict = field(default_factory=dict)
    measures: dict = field(default_factory=dict)
    issues: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["measures"] = {k: v for k, v in self.measures.items() if not k.startswith("_")}
        return d

    def severity(self) -> Optional[str]:
        """The worst severity among the row's flags (None: none)."""
        from .check_rules import SEVERITIES, severity

        found = {severity(name) for name in self.flags}
        return next((s for s in SEVERITIES if s in found), None)


def _work(im: Image.Image) -> Image.Image:
    scale = min(1.0, WORK_SIDE / max(im.size))
    return im if scale == 1.0 else im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))),
                                             Image.Resampling.BILINEAR, reducing_gap=2.0)


def measure_row(task: tuple[int, dict, CheckConfig]) -> RowCheck:
    """A row's measurements and its own flags (everything but the dataset-level ones); runs in a worker. Any
    error measuring it becomes the row's ``error`` flag: one bad row never stops the check."""
    from .check_rules import flag

    index, row, cfg = task
    out = RowCheck(index, row["row_id"], {k: v for k, v in row.items() if k in ("target", "source", "mask") and v})
    try:
        _measure(out, row, cfg)
    except Exception as e:  # noqa: BLE001 - the row's own boundary: reported with the row, the others go on
        log.debug("row %s: measuring failed", out.row_id, exc_info=True)
        flag(out, "error", f"{type(e).__name__}: {e}", f"measuring the row failed: {type(e).__name__}: {e}")
    return out


def _measure(out: RowCheck, row: dict, cfg: CheckConfig) -> None:
    from .check_align import hash_and_thumb
    from .check_rules import flag, judge_pair
    from .images import MIN_SIDE, aspect_differs, load_mask, load_rgb

    if not row.get("target"):
        flag(out, "unreadable", "no target", "the row names no target image")
        return
    try:
        target = load_rgb(row["target"])
        source = load_rgb(row["source"]) if row.get("source") else None
        mask = load_mask(row["mask"]) if row.get("mask") else None
    except (OSError, ValueError, RuntimeError) as e:
        flag(out, "unreadable", str(e), f"an image could not be read: {e}")
        return
    small = [f"{im.width}x{im.height}" for im in (target, source, mask) if im is not None and min(im.size) < MIN_SIDE]
    if small:
        flag(out, "too_small", small[0], f"an image is {small[0]}, under {MIN_SIDE} px a side")
        return
    m = out.measures
    t_work = _work(target)  # (hashes and thumbnails from the working size: the full one is not needed again)
    m["target_hash"], m["_target_thumb"] = hash_and_thumb(t_work)
    m["_instruction"] = " ".join((row.get("prompt") or "").lower().split())
    if source is None:
        return
    s_work = _work(source)
    m["source_hash"], m["_source_thumb"] = hash_and_thumb(s_work)
    ar_t, ar_s = target.width / target.height, source.width / source.height
    m["aspect_ratio_difference"] = round(abs(ar_t / ar_s - 1.0), 4)
    if m["aspect_ratio_difference"] > cfg.aspect_tolerance:
        flag(out, "aspect", f"target {target.width}x{target.height}, source {source.width}x{source.height}",
             f"source and target aspect ratios differ by {m['aspect_ratio_difference']:.1%}")
        return
    if s_work.size != t_work.size:
        s_work = source.resize(t_work.size, Image.Resampling.BILINEAR, reducing_gap=2.0)
    if mask is not None and aspect_differs(mask.size, target.size):
        flag(out, "mask_aspect", f"mask {mask.width}x{mask.height}, target {target.width}x{target.height}",
             f"the mask ({mask.width}x{mask.height}) was made for another image than the target "
             f"({target.width}x{target.height})")
        mask = None  # (made for another image: not stretched to measure it)
    if mask is not None and mask.size != t_work.size:
        mask = mask.resize(t_work.size, Image.Resampling.NEAREST)
    inside = None if mask is None else np.asarray(mask) > 127
    px = target.width / t_work.width
    del target, source
    t = np.asarray(t_work, np.float32) / 255.0
    s = np.asarray(s_work, np.float32) / 255.0
    judge_pair(out, s, t, inside, cfg, row.get("prompt"), px)


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

    from .check_dups import DuplicatePass

    # (the held-out rows first: the duplicate pass compares each row with them and the earlier rows as it arrives)
    tasks = [(-1 - i, r, cfg) for i, r in enumerate(holdout)] + [(i, r, cfg) for i, r in enumerate(rows)]
    workers = pool_size(cfg.workers, len(tasks))
    held, checks, dups = [], [], None
    with tqdm(total=len(tasks), unit="row", desc="check-dataset: measuring", disable=not show_progress) as bar:
        with ProcessPoolExecutor(workers) if workers > 0 else _InProcess() as pool:
            for c in pool.map(measure_row, tasks, chunksize=max(1, min(64, len(tasks) // (4 * max(workers, 1))))):
                if c.index < 0:
                    held.append(c)
                else:  # (the duplicate pass runs here while the workers measure the next rows)
                    dups = dups or DuplicatePass(held, cfg.dup_distance)
                    dups.add(c)
                    checks.append(c)
                bar.update(1)
    if dups is not None:
        dups.finish()
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
    """The rows whose instruction names no colour, judged against the majority colour change of the rows with
    the same instruction (one instruction, one edit: a mixed dataset has no majority to go by)."""
    groups: dict[str, list] = {}
    for c in checks:
        if "direction" in c.measures and not c.flags:
            groups.setdefault(c.measures.get("_instruction", ""), []).append((c, np.array(c.measures["direction"])))
    notes = [_judge_group(vectors, cfg) for vectors in groups.values() if len(vectors) >= 3]
    if not groups:
        return None
    if not notes:
        return "too few rows with one instruction and a measurable change to judge their direction"
    return next((n for n in notes if n), None)


def _judge_group(vectors: list, cfg: CheckConfig) -> Optional[str]:
    from .check_rules import flag

    stack = np.stack([v for _, v in vectors])
    majority = np.median(stack, axis=0)
    cosines = stack @ majority / np.maximum(np.linalg.norm(stack, axis=1) * np.linalg.norm(majority), 1e-12)
    if np.linalg.norm(majority) < cfg.min_majority or (cosines > 0.5).mean() < 0.6:
        return (f"no majority edit direction (median colour change {np.linalg.norm(majority):.3f}, "
                f"{(cosines > 0.5).mean():.0%} of the rows along it): the edits differ too much for the direction "
                "heuristic to decide")
    for (c, v), cos in zip(vectors, cosines):
        if np.linalg.norm(v) >= cfg.min_majority and cos < -0.5:
            flag(c, "direction_outlier", "its colour change inside the edit region opposes the majority of its instruction",
                 f"its colour change inside the edit region opposes the majority of the rows with its instruction "
                 f"(cosine {cos:.2f})", min(1.0, -cos))
    return None
