"""``qie check-dataset``'s flags: each one's severity and fix (:data:`FLAGS`), and the judgement of one pair's
measurements (:func:`judge_pair`).

Severities: ``error`` (the row would teach the wrong thing; ``--write_clean`` drops it), ``warning`` (likely
wrong, look at it) and ``hint`` (harmless, could be better). Every flag raised carries a one-line reason with the
values measured, the fix, and a confidence in 0..1 (the report sorts by it).

Geometry is judged on what did not change: the blocks outside the mask (all of them without one), fitted
robustly (``check_align.fit_motion``), so a moved, removed or inserted object is not a global shift or zoom.
Mask checks compare the mask with the estimated changed region: changes well outside the mask are an error; a
full mask on a global edit is fine; a full or loose mask around a small change is a hint.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

#: flag -> (severity, fix)
FLAGS: dict[str, tuple[str, str]] = {
    "error": ("error", "see the message; the other rows were checked"),
    "unreadable": ("error", "re-export the file or remove the row"),
    "too_small": ("error", "use images of at least 16 px a side"),
    "near_identical": ("error", "give the row its edited target, or remove it"),
    "no_op": ("error", "the target is the source re-encoded: give the row its edited target, or remove it"),
    "shifted": ("error", "re-align the target with the source (or regenerate it) so unchanged pixels stay put"),
    "scale_mismatch": ("error", "crop/resize the target to the source's framing"),
    "aspect": ("error", "crop source and target to one aspect ratio"),
    "wrong_source": ("error", "point the row at the photo its target was made from"),
    "duplicate": ("error", "keep one copy of the pair"),
    "holdout_duplicate": ("error", "remove the row: it leaks a held-out pair into training"),
    "mask_aspect": ("error", "re-make the mask for this target (its aspect ratio)"),
    "mask_empty": ("error", "draw the edit region, or drop the mask"),
    "changes_outside_mask": ("error", "grow the mask over every change, or drop the mask"),
    "reversed": ("error", "swap source and target"),
    "duplicate_pair": ("warning", "the same images as another row with another instruction: keep one if the "
                                  "instructions mean the same"),
    "direction_outlier": ("warning", "check that source and target are not swapped"),
    "instruction_mismatch": ("warning", "check that the target does what the instruction says"),
    "mask_full": ("hint", "a mask around the change lets a masked loss focus on it"),
    "mask_loose": ("hint", "tighten the mask around the change"),
}
SEVERITIES = ("error", "warning", "hint")


def severity(name: str) -> str:
    return FLAGS.get(name, ("warning", ""))[0]


def flag(out, name: str, value, reason: str, confidence: float = 1.0) -> None:
    """Raise ``name`` on ``out`` (a ``RowCheck``) with its measured ``value`` and a one-line ``reason``."""
    sev, fix = FLAGS.get(name, ("warning", ""))
    out.flags[name] = value
    out.issues[name] = {"severity": sev, "reason": reason, "fix": fix,
                        "confidence": round(float(min(1.0, max(0.0, confidence))), 3)}


def judge_pair(out, s: np.ndarray, t: np.ndarray, mask: Optional[np.ndarray], cfg, prompt: Optional[str],
               px: float) -> Optional[np.ndarray]:
    """Flag one aligned-size pair (float HxWx3 in 0..1 at the working size; ``mask``: bool or None; ``px``:
    target px per working px). Returns the estimated changed region (for the report)."""
    from .check_align import (block_keep, block_motion, change_region, coarse_change, dilate, fit_motion, gray,
                              search_zoom, structure)
    from .check_intent import asks_no_change, colour_evidence

    m = out.measures
    gs, gt = gray(s), gray(t)
    mse = float(((s - t) ** 2).mean())
    value = math.inf if mse == 0 else 10 * math.log10(1.0 / mse)
    m["psnr"] = round(value, 2) if math.isfinite(value) else None  # (strict JSON: no Infinity)
    if not math.isfinite(value):
        m["identical"] = True
    wants_change = not asks_no_change(prompt)
    if value > cfg.psnr_identical and wants_change:
        flag(out, "near_identical", m["psnr"] if math.isfinite(value) else "identical",
             f"target equals the source (PSNR {m['psnr'] or 'inf'} dB > {cfg.psnr_identical})")
        return np.zeros(gs.shape, bool)
    region = change_region(s, t)
    m["changed"] = round(float(region.mean()), 4)
    full_mask = mask is not None and mask.mean() > cfg.mask_full
    blocks = block_motion(gs, gt)
    changed = motion = None  # what changed; the motion is judged on the rest
    if mask is not None and not full_mask and mask.any():
        changed = dilate(mask, 2)
    elif m["changed"] < 0.5:  # a local edit: outside the estimated changed region, when enough is left there
        changed = dilate(region, 2)
        motion = fit_motion(blocks, block_keep(blocks, changed))
        if motion.blocks < 4 and (everywhere := fit_motion(blocks)).blocks >= cfg.min_blocks:
            changed, motion = None, everywhere
    if motion is None:
        motion = fit_motion(blocks, None if changed is None else block_keep(blocks, changed))
    zoom = motion.scale
    if not motion.aligned and motion.inliers < 0.8:  # (a zoom beyond a few per cent: search it)
        keep_fn = (lambda b: block_keep(b, changed)) if changed is not None else None
        k, zmo = search_zoom(gs, gt, keep_fn)
        if zmo.inliers > motion.inliers + 0.1:
            motion, zoom = zmo, k
    m["blocks"], m["unmoved"], m["explained"] = motion.blocks, round(motion.identity, 3), round(motion.inliers, 3)
    m["structure"] = round(structure(gs, gt), 3)
    geometric = False
    if not motion.aligned and motion.inliers >= cfg.min_agreement:
        shift = [round(motion.shift[0] * px, 1), round(motion.shift[1] * px, 1)]
        m["scale"], m["shift_px"] = round(zoom, 3), shift
        conf = motion.inliers - motion.identity
        if abs(zoom - 1.0) > cfg.max_scale_change:
            geometric = True
            flag(out, "scale_mismatch", m["scale"], f"the unchanged part looks zoomed by {zoom:.3f} "
                 f"({motion.inliers:.0%} of {motion.blocks} blocks agree, {motion.identity:.0%} unmoved)", conf)
        elif math.hypot(*shift) >= cfg.max_shift:
            geometric = True
            flag(out, "shifted", shift, f"the unchanged part moved by (dy, dx) = ({shift[0]}, {shift[1]}) px "
                 f"({motion.inliers:.0%} of {motion.blocks} blocks agree, {motion.identity:.0%} unmoved)", conf)
    if not geometric and not motion.aligned and m["structure"] < cfg.min_structure:
        flag(out, "wrong_source", m["structure"], f"the target's structure does not match the source's "
             f"(gradient correlation {m['structure']:.2f} < {cfg.min_structure}; {motion.identity:.0%} of "
             f"{motion.blocks} blocks unmoved)", 1.0 - max(0.0, m["structure"]) / cfg.min_structure)
        return region
    if geometric:
        return region
    m["coarse_change"] = round(coarse_change(s, t), 4)
    if wants_change and m["coarse_change"] < cfg.no_op_change and value > cfg.psnr_no_op:
        flag(out, "no_op", m["coarse_change"], f"no region changed ({m['coarse_change']:.2%} of the image's cells "
             f"differ, PSNR {value:.1f} dB): the target is the source re-encoded",
             1.0 - m["coarse_change"] / cfg.no_op_change)
    if mask is not None:
        _judge_mask(out, mask, region, cfg)
    edit = mask if mask is not None and cfg.mask_empty < mask.mean() <= cfg.mask_full else region
    if edit.any() and not edit.all():
        evidence = colour_evidence(prompt, s * 255, t * 255, edit)
        if evidence is not None:
            m["colour_evidence"] = round(evidence, 4)
            if evidence < -cfg.min_colour_evidence:
                flag(out, "reversed", m["colour_evidence"], f"the edit region moves away from the colour the "
                     f"instruction names (chromaticity {evidence:+.3f})", min(1.0, -evidence / 0.1))
        else:
            m["direction"] = [round(float(v), 4) for v in (t - s)[edit].mean(0)]
    return region


def _judge_mask(out, mask: np.ndarray, region: np.ndarray, cfg) -> None:
    m = out.measures
    frac = float(mask.mean())
    m["mask_fraction"] = round(frac, 4)
    if frac < cfg.mask_empty:
        flag(out, "mask_empty", m["mask_fraction"], f"the mask covers {frac:.2%} of the image "
             f"(< {cfg.mask_empty:.2%}) while {m['changed']:.1%} changed")
        return
    pad = max(2, round(0.015 * max(mask.shape)))
    from .check_align import dilate

    outside = region & ~dilate(mask, pad)
    rest = max(1, int((~mask).sum()))
    m["outside_change"] = round(float(outside.sum() / rest), 4)
    if m["outside_change"] > cfg.outside_change and outside.mean() > cfg.outside_change / 4:
        flag(out, "changes_outside_mask", m["outside_change"], f"{m['outside_change']:.1%} of the area outside "
             f"the mask changed (> {cfg.outside_change:.1%}); the mask covers {frac:.1%}",
             min(1.0, m["outside_change"] / (4 * cfg.outside_change)))
    elif frac > cfg.mask_full and m["changed"] < 0.5:
        flag(out, "mask_full", m["mask_fraction"], f"a full mask around a change of {m['changed']:.1%} of the image",
             1.0 - m["changed"])
    elif frac > 0.3 and frac > 4 * m["changed"]:
        flag(out, "mask_loose", m["mask_fraction"], f"the mask covers {frac:.1%}, the change {m['changed']:.1%}",
             1.0 - m["changed"] / frac)
