"""The scorecard of ``qie eval-edits`` side by side: the base model and each LoRA (or few-step setting).

:func:`compare` turns per-row scores (``metrics.scorecard.score_batch`` dicts, one list per
column) into a summary: each metric's mean per column and, for every column after the
first, its win rate against the first (the share of rows it made better, ties half) and
the rows it made better. :func:`format_table` prints it; :func:`gap_line` says in one line
how much a few-step setting loses against the full step count.
"""
from __future__ import annotations

from typing import Sequence

from ..metrics.score_rules import HIGHER_IS_BETTER, aggregate, win_rate

#: the metric whose win rate heads the summary line: fidelity to the target where there is one, then preservation,
#: then a judge's score (benchmark rows: no target)
HEADLINE = ("edit_psnr", "preserve_psnr", "judge")


def compare(columns: dict[str, Sequence[dict[str, float]]]) -> dict:
    """``{"columns": [names], "metrics": {metric: {column: mean}}, "wins": {column: {metric: {"rate", "rows"}}}}``;
    the first column is the reference every other is compared with."""
    names = list(columns)
    if not names:
        raise ValueError("a scorecard needs at least one column of scores")
    means = {name: aggregate(rows) for name, rows in columns.items()}
    metrics = sorted({k for m in means.values() for k in m}, key=lambda k: (k not in HIGHER_IS_BETTER, k))
    wins: dict[str, dict] = {}
    for name in names[1:]:
        wins[name] = {}
        for metric in metrics:
            result = win_rate(columns[names[0]], columns[name], metric)
            if result is not None:
                wins[name][metric] = {"rate": result[0], "rows": result[1]}
    return {"columns": names, "rows": len(columns[names[0]]),
            "metrics": {k: {n: means[n][k] for n in names if k in means[n]} for k in metrics}, "wins": wins}


def headline_metric(summary: dict) -> str | None:
    return next((m for m in HEADLINE if m in summary["metrics"]), None)


def format_table(summary: dict) -> str:
    """A plain-text table: one line per metric, one column per model, then the win rates against the first."""
    names = summary["columns"]
    width = max(12, *(len(n) for n in names))
    head = f"{'metric':<16}" + "".join(f"{n:>{width + 2}}" for n in names)
    head += "".join(f"{'win ' + n:>{width + 6}}" for n in names[1:])
    lines = [f"scorecard ({summary['rows']} rows; win = share of rows better than {names[0]}, ties half)", head]
    for metric, values in summary["metrics"].items():
        arrow = "↑" if HIGHER_IS_BETTER.get(metric, True) else "↓"
        line = f"{metric + ' ' + arrow:<16}" + "".join(
            f"{values[n]:>{width + 2}.4g}" if n in values else f"{'–':>{width + 2}}" for n in names)
        for n in names[1:]:
            w = summary["wins"][n].get(metric)
            line += f"{w['rate'] * 100:>{width + 5}.0f}%" if w else f"{'–':>{width + 6}}"
        lines.append(line)
    return "\n".join(lines)


def win_line(summary: dict) -> str:
    """One line: each column's win rate on the headline metric, with the rows it made better."""
    metric = headline_metric(summary)
    if metric is None or len(summary["columns"]) < 2:
        return "no win rate: one column or no region metric"
    parts = []
    for n in summary["columns"][1:]:
        w = summary["wins"][n].get(metric)
        if w:
            parts.append(f"{n} beats {summary['columns'][0]} on {w['rate'] * 100:.0f}% of rows by {metric} "
                         f"(better rows: {w['rows']})")
    return "; ".join(parts)


def gap_line(summary: dict, full: str, few: Sequence[str]) -> str:
    """How much each few-step column loses against the ``full`` column on the headline metric and preservation."""
    metric = headline_metric(summary)
    if metric is None:
        return "few-step gap: no region metric to compare"
    parts = []
    for name in few:
        values = summary["metrics"][metric]
        if name in values and full in values:
            diff = values[name] - values[full]
            unit = " dB" if "psnr" in metric else ""
            extra = ""
            pres = summary["metrics"].get("preserve_psnr", {})
            if metric != "preserve_psnr" and name in pres and full in pres:
                extra = f", preserve_psnr {pres[name] - pres[full]:+.2f} dB"
            parts.append(f"{name}: {metric} {diff:+.2f}{unit}{extra}")
    return f"few-step gap vs {full}: " + "; ".join(parts)


def summary_text(path: str) -> str:
    """The table and the win-rate line of a ``qie eval-edits --scorecard`` file (the launch scripts' summary)."""
    import json
    from pathlib import Path

    summary = json.loads(Path(path).read_text(encoding="utf-8"))
    return f"{format_table(summary)}\n{win_line(summary)}\n"
