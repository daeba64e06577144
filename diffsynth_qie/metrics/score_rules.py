"""How edit scores compare: each metric's better direction, ties, means and win rates over rows of scores.

Plain numbers only (no torch), so that ``qie report`` and the scorecard tables read scores without loading the
metrics that compute them (``metrics/scorecard.py``, whose table of metrics these rules follow).
"""
from __future__ import annotations

from typing import Optional, Sequence

#: metric -> True where higher is better (the table in metrics/scorecard.py, with the optional CLIP and judge scores)
HIGHER_IS_BETTER = {"preserve_psnr": True, "preserve_ssim": True, "preserve_lpips": False, "edit_psnr": True,
                    "edit_ssim": True, "shift_px": False, "scale_drift": False, "colour_cast": False,
                    "clip_direction": True, "judge": True, "judge_semantic": True, "judge_quality": True}
#: ties within this tolerance count as neither a win nor a loss
TIE = {"shift_px": 0.05, "scale_drift": 0.005}


def aggregate(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """The mean of every metric over the rows that have it."""
    groups: dict[str, list[float]] = {}
    for row in rows:
        for k, v in row.items():
            groups.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}


def better(metric: str, a: float, b: float) -> int:
    """+1 where ``a`` is better than ``b`` for ``metric``, -1 where worse, 0 within the tie tolerance."""
    diff = a - b if HIGHER_IS_BETTER.get(metric, True) else b - a
    tol = TIE.get(metric, 1e-6)
    return 0 if abs(diff) <= tol else (1 if diff > 0 else -1)


def win_rate(base: Sequence[dict[str, float]], tuned: Sequence[dict[str, float]],
             metric: str) -> Optional[tuple[float, list[int]]]:
    """(the share of rows where ``tuned`` beats ``base`` on ``metric``, ties counting half; the indices of the
    rows it made better), over the rows both have the metric for; None when none has it."""
    if len(base) != len(tuned):
        raise ValueError(f"win rate needs one score per row on both sides, got {len(base)} and {len(tuned)}")
    outcomes = [(i, better(metric, t[metric], b[metric])) for i, (b, t) in enumerate(zip(base, tuned))
                if metric in b and metric in t]
    if not outcomes:
        return None
    rate = sum(1.0 if o > 0 else 0.5 if o == 0 else 0.0 for _, o in outcomes) / len(outcomes)
    return rate, [i for i, o in outcomes if o > 0]


def worst_rows(rows: Sequence[dict[str, float]], metric: str, count: int) -> list[int]:
    """Indices of the ``count`` rows that are worst on ``metric`` (rows without it are left out)."""
    have = [i for i, r in enumerate(rows) if metric in r]
    sign = 1 if HIGHER_IS_BETTER.get(metric, True) else -1
    return sorted(have, key=lambda i: sign * rows[i][metric])[:count]
