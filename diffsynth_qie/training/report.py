"""The training report: one self-contained HTML page about a run's output directory.

It reads what training wrote (``loss.jsonl`` and the validation strips
``validation/step-<n>/*.png``) and nothing else, so it works during a run, after it,
and on a copy of the directory. The page holds, with every image inlined as base64:

- a summary table (last value of every logged number, best value of the loss and the quality metrics);
- the loss curve, raw and smoothed (exponential moving average, bias-corrected like
  TensorBoard's, weight ``--smoothing``);
- the learning rate;
- each validation metric (``val_*``: PSNR, SSIM, LPIPS, PSNR outside the mask, ...)
  and each other logged number (``grad_norm``, ``mse_main``, ...) over steps;
- the validation strips [reference | target | output] of every validation step;
- with ``select_by`` (``qie report --select_by val_edit_psnr``): the best step by that
  metric (in its direction: PSNR/SSIM up, LPIPS/drift down) and the checkpoint saved there,
  and the worst rows of the last validation step by it (``scores.jsonl``), with their strips;
- the held-out scorecard and edits of ``qie eval-edits`` (``scorecard.json``, ``heldout_grid.png``) when the
  run's directory has them.

Plots are matplotlib PNGs (the ``[train]`` extra installs matplotlib).
"""
from __future__ import annotations

import base64
import html
import io
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from PIL import Image

from ..utils.atomic import atomic_write_text, finished_files
from .tracking import LOSS_LOG, VALIDATION_DIR, read_loss_log

log = logging.getLogger(__name__)

REPORT_NAME = "report.html"
SCORECARD_NAME = "scorecard.json"  # what `qie eval-edits --scorecard` wrote into the run's directory, if anything
PREDICTION_NAME = "predicted_step.json"  # qie train's preflight: the step time predicted for the visible GPU
HELDOUT_GRID_NAME = "heldout_grid.png"  # `qie eval-edits --grid`: every reference | base | LoRA | target per row
NOT_PLOTTED = {"step", "loss", "lr", "epoch"}
STRIP_MAX_WIDTH = 1536  # wider validation strips are scaled down in the page (the PNG files are untouched)


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average: ``s_t = w·s_{t-1} + (1-w)·x_t``, divided by ``1 - w^t``."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {weight}")
    out, acc = [], 0.0
    for t, x in enumerate(values, 1):
        acc = weight * acc + (1 - weight) * x
        out.append(acc / (1 - weight ** t))
    return out


def series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records that have a finite number for it."""
    pairs = [(int(r["step"]), float(r[key])) for r in records
             if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    return [s for s, _ in pairs], [v for _, v in pairs]


def metric_keys(records: Sequence[dict]) -> list[str]:
    """Numeric keys besides step/loss/lr/epoch: ``val_*`` first, then the rest, each sorted."""
    keys = {k for r in records for k, v in r.items()
            if k not in NOT_PLOTTED and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return sorted(keys, key=lambda k: (not k.startswith("val_"), k))


@dataclass
class StepStrips:
    step: int
    images: list[tuple[str, Path]] = field(default_factory=list)  # (name, file)


def validation_strips(output_dir: Path) -> list[StepStrips]:
    """The finished strip PNGs of every ``validation/step-<n>`` folder, by step."""
    found = []
    for folder in finished_files(output_dir / VALIDATION_DIR, "step-*"):
        m = re.fullmatch(r"step-(\d+)", folder.name)
        if m and folder.is_dir():
            files = finished_files(folder, "*.png")
            if files:
                found.append(StepStrips(int(m.group(1)), [(p.stem, p) for p in files]))
    return sorted(found, key=lambda s: s.step)


def _png_data(image_or_figure) -> str:
    buf = io.BytesIO()
    if isinstance(image_or_figure, Image.Image):
        image_or_figure.save(buf, format="PNG")
    else:
        image_or_figure.savefig(buf, format="png", dpi=100)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(title: str, ylabel: str, lines: Sequence[tuple[str, list[int], list[float], dict]]):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ValueError("qie report needs matplotlib: `pip install matplotlib` (or the project's [train] extra)") \
            from e
    fig = Figure(figsize=(7.5, 3.2))
    ax = fig.add_subplot()
    for label, xs, ys, style in lines:
        ax.plot(xs, ys, label=label, **style)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend()
    fig.tight_layout()
    return fig


def _strip_data(path: Path) -> str:
    with Image.open(path) as im:
        im = im.convert("RGB")
        if im.width > STRIP_MAX_WIDTH:
            im = im.resize((STRIP_MAX_WIDTH, round(im.height * STRIP_MAX_WIDTH / im.width)), Image.LANCZOS)
        return _png_data(im)


def _fmt(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:.6g}"


def _best(key: str, values: list[float]) -> Optional[float]:
    """The best value of a quality measure (loss, mse*, lpips, drift: lowest; val_psnr*, val_ssim: highest); None
    for numbers that are not one (lr, grad_norm, sigma_mean, ...)."""
    if lower_is_better(key):
        return min(values)
    return max(values) if key.startswith("val_") else None


def lower_is_better(key: str) -> bool:
    """Direction of a logged number: loss, mse*, lpips and the scorecard's drift metrics are better low."""
    from ..metrics.score_rules import HIGHER_IS_BETTER

    name = key[len("val_"):] if key.startswith("val_") else key
    return key == "loss" or key.startswith("mse") or "lpips" in key or HIGHER_IS_BETTER.get(name) is False


def best_step(records: Sequence[dict], key: str) -> Optional[tuple[int, float]]:
    """(step, value) where ``key`` was best; None when it was never logged."""
    steps, values = series(records, key)
    if not steps:
        return None
    pick = min if lower_is_better(key) else max
    value = pick(values)
    return steps[values.index(value)], value


def _selection(out: Path, records: Sequence[dict], key: str, worst: int) -> list[str]:
    from .validation_metrics import SCORES_FILE, read_scores

    best = best_step(records, key)
    if best is None:
        known = ", ".join(k for k in metric_keys(records) if k.startswith("val_")) or "none (train with --validate_every)"
        raise ValueError(f"--select_by {key}: not in {out / LOSS_LOG}; logged validation metrics: {known}")
    ckpt = out / f"checkpoint-{best[0]}"
    parts = [f"<h2>Best by {html.escape(key)}</h2><p>step {best[0]} ({_fmt(best[1])}, "
             f"{'lower' if lower_is_better(key) else 'higher'} is better): "
             + (f"<code>{html.escape(str(ckpt))}</code>" if ckpt.is_dir() else "no checkpoint saved at that step")
             + "</p>"]
    strips = validation_strips(out)
    metric = key[len("val_"):] if key.startswith("val_") else key
    if strips:
        last = strips[-1]
        rows = read_scores(out / VALIDATION_DIR / f"step-{last.step}" / SCORES_FILE)
        have = [n for n, r in rows.items() if metric in r]
        have.sort(key=lambda n: rows[n][metric], reverse=lower_is_better(key))
        files = dict(last.images)
        parts.append(f"<h3>Worst {min(worst, len(have))} row(s) by {html.escape(metric)} at step {last.step}</h3>")
        parts += [f"<figure class='strip'><img alt='{html.escape(n)}' src='{_strip_data(files[n])}'><figcaption>"
                  f"{html.escape(n)}: {html.escape(metric)} {_fmt(rows[n][metric])}</figcaption></figure>"
                  for n in have[:worst] if n in files]
    return parts


def _scorecard(path: Path) -> list[str]:
    """The held-out scorecard (base vs LoRA, win rates) of ``qie eval-edits --scorecard``, when it is there."""
    import json

    try:
        card = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        names, metrics, wins = card["columns"], card["metrics"], card["wins"]
    except (ValueError, KeyError, TypeError):
        log.warning("%s is not a scorecard of `qie eval-edits --scorecard`; left out of the report", path)
        return []
    if card is None:
        return []
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names) + "".join(
        f"<th>win {html.escape(n)}</th>" for n in names[1:])
    rows = []
    for k, values in metrics.items():
        cells = "".join(f"<td>{_fmt(values.get(n))}</td>" for n in names)
        cells += "".join(f"<td>{wins[n][k]['rate'] * 100:.0f}%</td>" if k in wins.get(n, {}) else "<td>–</td>"
                         for n in names[1:])
        rows.append(f"<tr><td>{html.escape(k)}{' ↓' if lower_is_better('val_' + k) else ' ↑'}</td>{cells}</tr>")
    return [f"<h2>Held-out scorecard ({card.get('rows', '?')} rows; win = share of rows better than "
            f"{html.escape(names[0])})</h2><table><tr><th>metric</th>{head}</tr>{''.join(rows)}</table>"]


def write_prediction(output_dir: str | Path, prediction) -> None:
    """Keep the preflight's predicted step time (a ``preflight.timing.TimePrediction``) in the run's directory."""
    import json

    e, t = prediction.estimate, prediction.table
    atomic_write_text(Path(output_dir) / PREDICTION_NAME, json.dumps(
        {"gpu": e.gpu, "step_s": e.seconds, "mfu": e.mfu, "split_s": e.split, "source": t.source,
         "accuracy": t.accuracy}))


def _step_time(out: Path, records: Sequence[dict]) -> list[str]:
    """The measured step time (median of the logged ones, the first left out: it includes warm-up) beside the
    preflight's prediction."""
    import json
    import statistics

    measured = [r["step_s"] for r in records if isinstance(r.get("step_s"), (int, float))][1:]
    path = out / PREDICTION_NAME
    predicted = json.loads(path.read_text()) if path.is_file() else None
    if not measured and predicted is None:
        return []
    parts = []
    if measured:
        parts.append(f"measured {statistics.median(measured):.3f} s per optimizer step (median of "
                     f"{len(measured)} logged)")
    if predicted is not None:
        parts.append(f"predicted {predicted['step_s']:.3f} s on {html.escape(predicted['gpu'])} before the run "
                     f"(MFU {100 * predicted['mfu']:.0f} %; {html.escape(predicted['source'])}, "
                     f"{html.escape(predicted['accuracy'])})")
    return [f"<p>Step time: {'; '.join(parts)}.</p>"]


def build_report(output_dir: str | Path, smoothing: float = 0.9, select_by: Optional[str] = None,
                 worst: int = 3) -> str:
    """The report page's HTML for a run's ``output_dir``."""
    out = Path(output_dir)
    loss_log = out / LOSS_LOG
    if not out.is_dir():
        raise ValueError(f"{out} is not a directory; pass the --output_dir of a `qie train` run")
    if not loss_log.is_file():
        raise ValueError(f"{loss_log} not found: {out} is not a training output directory (pass the --output_dir "
                         "of a `qie train` run that has logged at least one step)")
    records = read_loss_log(loss_log)
    steps, losses = series(records, "loss")
    if not steps:
        raise ValueError(f"{loss_log} has no logged loss yet; run `qie train` for at least one step first")
    smoothing = float(smoothing)
    smoothed = smooth(losses, smoothing)
    keys = metric_keys(records)
    rows = [("loss", losses[-1], _best("loss", losses), f"{smoothed[-1]:.6g}")]
    for k in keys:
        _, vals = series(records, k)
        rows.append((k, vals[-1], _best(k, vals), ""))

    plots = [("loss", _figure(f"loss (EMA smoothing {smoothing:g})", "loss", [
        ("raw", steps, losses, {"alpha": 0.35, "color": "tab:blue"}),
        ("smoothed", steps, smoothed, {"color": "tab:blue", "linewidth": 2})]))]
    lr_steps, lrs = series(records, "lr")
    if lr_steps:
        plots.append(("learning rate", _figure("learning rate", "lr", [("lr", lr_steps, lrs, {"color": "tab:green"})])))
    for k in keys:
        xs, ys = series(records, k)
        style = {"marker": "o"} if len(xs) < 50 else {}
        plots.append((k, _figure(k, k, [(k, xs, ys, {"color": "tab:orange" if k.startswith("val_") else "tab:gray",
                                                      **style})])))

    parts = [f"<h1>Training report</h1><p class='dir'>{html.escape(str(out.resolve()))}</p>",
             f"<p>{len(steps)} logged step(s), last step {steps[-1]}.</p>",
             "<table><tr><th>value</th><th>last</th><th>best</th><th>smoothed</th></tr>"]
    parts += [f"<tr><td>{html.escape(k)}</td><td>{_fmt(last)}</td><td>{_fmt(best)}</td><td>{sm}</td></tr>"
              for k, last, best, sm in rows]
    parts.append("</table>")
    parts += _step_time(out, records)
    if select_by:
        parts += _selection(out, records, select_by, worst)
    parts += _scorecard(out / SCORECARD_NAME)
    if (out / HELDOUT_GRID_NAME).is_file():  # the held-out rows, every reference of a row first
        parts.append("<h2>Held-out edits [references | base | LoRA | target]</h2><figure class='strip'>"
                     f"<img alt='held-out edits' src='{_strip_data(out / HELDOUT_GRID_NAME)}'></figure>")
    parts.append("<h2>Curves</h2>")
    for title, fig in plots:
        parts.append(f"<figure><img alt='{html.escape(title)}' src='{_png_data(fig)}'></figure>")
    strips = validation_strips(out)
    parts.append("<h2>Validation [reference | target | output]</h2>")
    if not strips:
        parts.append("<p>No validation strips (train with <code>--validate_every N</code> to render them).</p>")
    for s in strips:
        parts.append(f"<h3>step {s.step}</h3>")
        parts += [f"<figure class='strip'><img alt='{html.escape(name)}' src='{_strip_data(path)}'>"
                  f"<figcaption>{html.escape(name)}</figcaption></figure>" for name, path in s.images]
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
             "td:first-child{text-align:left}img{max-width:100%}figure{margin:0.5em 0}.dir{color:#666}"
             # small strips (e.g. the tiny demo's 64 px panels) are shown enlarged, pixels kept sharp
             ".strip img{width:100%;max-width:900px;image-rendering:pixelated}")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>Training report</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")


def write_report(output_dir: str | Path, out_path: Optional[str | Path] = None, smoothing: float = 0.9,
                 select_by: Optional[str] = None, worst: int = 3) -> Path:
    """Write the report (default ``<output_dir>/report.html``) atomically; returns its path."""
    path = Path(out_path) if out_path else Path(output_dir) / REPORT_NAME
    atomic_write_text(path, build_report(output_dir, smoothing, select_by, worst))
    log.info("report: %s", path)
    return path
