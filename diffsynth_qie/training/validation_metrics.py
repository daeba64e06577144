"""Metrics of the validation renders against their targets, logged at every validation step.

For each rendered output (a decoded image) and the target it is judged against:

- ``val_psnr`` and ``val_ssim`` against the target (``metrics/image.py``);
- ``val_lpips`` when the LPIPS network can be loaded offline (``metrics/lpips.py``;
  otherwise it is skipped with one logged line, never downloaded);
- ``val_psnr_preserve`` for entries with an edit mask: PSNR over the pixels outside
  the mask (weights ``1 - mask``), i.e. how well the edit leaves the rest alone;
- the edit scorecard against the row's source (``metrics/scorecard.py``): ``val_preserve_psnr``,
  ``val_preserve_ssim`` (``val_preserve_lpips``) outside the mask (or the region where
  target and source differ), ``val_edit_psnr`` / ``val_edit_ssim`` inside it, and the
  drift ``val_shift_px``, ``val_scale_drift``, ``val_colour_cast``.

Each metric is the mean over the held-out outputs; LBM runs also log the mean per
stream (``val_psnr_main``, ``val_psnr_sub``, ...).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from PIL import Image

from ..metrics.image import mask_to_pixels, masked_psnr, psnr, ssim, to_pixels
from ..metrics.lpips import lpips_distance

PREFIX = "val_"
SCORES_FILE = "scores.jsonl"  # one line per output of a validation step: its name and every metric


def write_scores(path, row_scores: dict[str, dict[str, float]]) -> None:
    """``scores.jsonl`` of a validation step (atomic): ``{"name": <output>, <metric>: value, ...}`` per line."""
    import json

    from ..utils.atomic import atomic_write_text

    atomic_write_text(path, "".join(json.dumps({"name": n, **v}) + "\n" for n, v in row_scores.items()))


def read_scores(path) -> dict[str, dict[str, float]]:
    """The rows of a ``scores.jsonl`` (lines that do not parse are skipped); {} when there is none."""
    import json
    from pathlib import Path

    rows = {}
    p = Path(path)
    for line in (p.read_text(encoding="utf-8").splitlines() if p.is_file() else []):
        try:
            record = json.loads(line)
            name = str(record.pop("name"))
            rows[name] = {k: float(v) for k, v in record.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return rows


def output_metrics(output: Image.Image, target: Image.Image, back_mask: Optional[torch.Tensor] = None,
                   lpips_model=None, source: Optional[Image.Image] = None) -> dict[str, float]:
    """The metrics of one output against its target (``back_mask``: the latent edit mask ``[1, h, w]``) and, with
    the row's ``source``, its scorecard."""
    if output.size != target.size:
        raise ValueError(f"validation output {output.size} and target {target.size} differ in size")
    out, tgt = to_pixels([output, target]).split(1)
    values = {"psnr": float(psnr(out, tgt)[0]), "ssim": float(ssim(out, tgt)[0])}
    if lpips_model is not None:
        with torch.no_grad():
            values["lpips"] = float(lpips_distance(lpips_model, out, tgt)[0])
    if back_mask is not None:
        keep = 1 - mask_to_pixels(back_mask, tuple(out.shape[-2:]))
        value = float(masked_psnr(out, tgt, keep)[0])
        if not math.isnan(value):
            values["psnr_preserve"] = value
    if source is not None:
        from ..metrics.scorecard import score_batch

        src = to_pixels([source.convert("RGB").resize(output.size, Image.Resampling.LANCZOS)])
        region = mask_to_pixels(back_mask, tuple(out.shape[-2:])) if back_mask is not None else None
        values.update(score_batch(src, out, tgt, region=region, lpips_model=lpips_model)[0])
    return values


def summarize(per_output: Sequence[tuple[Optional[str], dict[str, float]]]) -> dict[str, float]:
    """Means over outputs (``val_<metric>``) and, for named streams, per stream (``val_<metric>_<stream>``)."""
    groups: dict[str, list[float]] = {}
    streams = {s for s, _ in per_output if s is not None}
    for stream, values in per_output:
        for k, v in values.items():
            groups.setdefault(f"{PREFIX}{k}", []).append(v)
            if stream is not None and len(streams) > 1:
                groups.setdefault(f"{PREFIX}{k}_{stream}", []).append(v)
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}
