"""``qie check-dataset``'s outputs: ``check.jsonl`` (one line per flagged row: the row, each flag and its measured
value, each issue's severity, reason and fix; strict JSON, a value that is not finite is written as ``null``)
and ``check.html`` (one self-contained page: the counts per flag, then the flagged rows grouped by severity and by
their worst flag, most confident first, each with source, target, mask and an overlay of the estimated changed
region (red) and the mask's outline (green); at most ``max_cards`` rows, so the page stays a few MB whatever the
dataset's size; every flagged row is in ``check.jsonl``)."""
from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Optional, Sequence

from PIL import Image

from ..utils.atomic import atomic_write_text
from .check import RowCheck
from .check_rules import SEVERITIES, severity

THUMB = 128
MAX_CARDS = 200


def strict(value):
    """``value`` with every float that is not finite replaced by ``None`` (JSON has no Infinity or NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def json_line(record: dict) -> str:
    return json.dumps(strict(record), default=str, allow_nan=False) + "\n"


def _png(im: Image.Image) -> str:
    im.thumbnail((THUMB, THUMB))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}" alt="">'


def _thumb(path: Optional[str], mask: bool = False, derived: Optional[tuple] = None) -> str:
    """A thumbnail of ``path``; with no path and ``derived`` = (target, source) paths, the pair's derived mask."""
    from .images import load_mask, load_rgb

    try:
        if path:
            im = load_mask(path) if mask else load_rgb(path)
        elif derived and all(derived):
            from .automask import diff_mask

            im = diff_mask(load_rgb(derived[0]), load_rgb(derived[1]))
        else:
            return '<div class="none">—</div>'
    except (OSError, ValueError):
        return '<div class="none">unreadable</div>'
    return _png(im)


def _overlay(paths: dict) -> str:
    """The target with the estimated changed region tinted red and the mask's outline in green."""
    import numpy as np
    from PIL import ImageFilter

    from .check_align import change_region
    from .images import load_mask, load_rgb

    try:
        t = load_rgb(paths["target"])
        t.thumbnail((2 * THUMB, 2 * THUMB))
        s = load_rgb(paths["source"]).resize(t.size) if paths.get("source") else t
        a = np.asarray(t, np.float32) / 255
        region = change_region(np.asarray(s, np.float32) / 255, a)
        out = np.where(region[..., None], 0.5 * a + 0.5 * np.array([1.0, 0.1, 0.1]), a)
        if paths.get("mask"):
            m = load_mask(paths["mask"]).resize(t.size)
            edge = np.asarray(m.filter(ImageFilter.FIND_EDGES).filter(ImageFilter.MaxFilter(3))) > 0
            out[edge] = (0.1, 0.9, 0.1)
    except (OSError, ValueError, KeyError):
        return '<div class="none">—</div>'
    return _png(Image.fromarray((out * 255).astype("uint8")))


def _rank(c: RowCheck) -> tuple:
    """A row's place on the page: its worst severity, then its worst flag, most confident first."""
    worst = min((SEVERITIES.index(severity(f)) if severity(f) in SEVERITIES else 1) for f in c.flags)
    name = min((f for f in c.flags if severity(f) == SEVERITIES[worst]), key=lambda f: -_conf(c, f))
    return worst, name, -_conf(c, name)


def _conf(c: RowCheck, name: str) -> float:
    return float(c.issues.get(name, {}).get("confidence", 1.0))


def summary_line(checks: Sequence[RowCheck]) -> str:
    """``N rows checked: E with an error, W with a warning, H with a hint (counts per flag)``."""
    counts: dict[str, int] = {}
    worst = {s: 0 for s in SEVERITIES}
    for c in checks:
        for name in c.flags:
            counts[name] = counts.get(name, 0) + 1
        if c.flags:
            worst[c.severity() or "warning"] += 1
    per_flag = ", ".join(f"{n} {k} ({severity(k)})" for k, n in sorted(counts.items(), key=lambda kv: (
        SEVERITIES.index(severity(kv[0])), kv[0]))) or "nothing flagged"
    return (f"{len(checks)} rows checked: {worst['error']} with an error, {worst['warning']} with a warning, "
            f"{worst['hint']} with a hint only ({per_flag})")


def write_outputs(out_dir: str | Path, checks: Sequence[RowCheck], note: Optional[str], source: str,
                  derived_masks: bool = False, max_cards: int = MAX_CARDS, show_progress: bool = True) -> Path:
    """``check.jsonl`` and ``check.html`` in ``out_dir``; returns the page's path. ``derived_masks``: rows without
    a mask show the one ``qie cache --auto_mask diff`` would derive (captioned as derived). The page shows
    ``max_cards`` flagged rows, the worst first."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    flagged = [c for c in checks if c.flags]
    atomic_write_text(out_dir / "check.jsonl", "".join(json_line(c.to_json()) for c in flagged))
    summary = summary_line(checks)
    shown = sorted(flagged, key=_rank)[:max_cards]
    sections, current = [], None
    for c in tqdm(shown, unit="row", desc="check-dataset: report", disable=not show_progress or not shown):
        sev, name, _ = _rank(c)
        if (sev, name) != current:
            current = (sev, name)
            n = sum(1 for x in flagged if _rank(x)[:2] == current)
            sections.append(f'<h2 class="{SEVERITIES[sev]}">{SEVERITIES[sev]}: {html.escape(name)} ({n} rows)</h2>')
        derived = (c.paths.get("target"), c.paths.get("source")) if derived_masks and not c.paths.get("mask") else None
        mask_caption = "derived mask (--auto_mask diff)" if derived else "mask"
        items = []
        for k, v in c.flags.items():
            issue = c.issues.get(k, {})
            fix = f'<br><i>fix: {html.escape(issue["fix"])}</i>' if issue.get("fix") else ""
            items.append(f'<li class="{severity(k)}"><b>{html.escape(k)}</b> ({severity(k)}, confidence '
                         f'{_conf(c, k):.2f}): {html.escape(str(issue.get("reason", v)))}{fix}</li>')
        sections.append(
            f'<div class="card"><h3>{html.escape(c.row_id)}</h3><div class="strip">'
            f'<figure>{_thumb(c.paths.get("source"))}<figcaption>source</figcaption></figure>'
            f'<figure>{_thumb(c.paths.get("target"))}<figcaption>target</figcaption></figure>'
            f'<figure>{_thumb(c.paths.get("mask"), True, derived)}<figcaption>{mask_caption}</figcaption></figure>'
            f'<figure>{_overlay(c.paths)}<figcaption>changed (red), mask (green)</figcaption></figure>'
            f'</div><ul>{"".join(items)}</ul></div>')
    more = (f"<p>The first {len(shown)} flagged rows are shown; all {len(flagged)} are in check.jsonl.</p>"
            if len(shown) < len(flagged) else "")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>qie check-dataset: {html.escape(source)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:24px;background:#fafafa}}.card{{background:#fff;border:1px solid #ddd;
border-radius:8px;padding:12px;margin:12px 0;display:inline-block;vertical-align:top;width:580px;margin-right:12px}}
.strip{{display:flex;gap:8px}}figure{{margin:0;text-align:center;font-size:11px}}img{{max-width:{THUMB}px;max-height:{THUMB}px;
border:1px solid #ccc}}.none{{width:{THUMB}px;height:{THUMB}px;display:flex;align-items:center;justify-content:center;
color:#999;border:1px dashed #ccc}}h3{{margin:0 0 8px;font-size:15px}}ul{{margin:8px 0 0;padding-left:18px;font-size:13px}}
h2.error{{color:#b00020}}h2.warning{{color:#a86b00}}h2.hint{{color:#1d5fa8}}li.error b{{color:#b00020}}
li.warning b{{color:#a86b00}}li.hint b{{color:#1d5fa8}}
</style></head><body><h1>qie check-dataset</h1><p>{html.escape(source)}: {len(flagged)} of them flagged. {html.escape(summary)}.</p>
{f'<p><i>{html.escape(note)}</i></p>' if note else ''}{more}{''.join(sections)}</body></html>"""
    path = out_dir / "check.html"
    atomic_write_text(path, page)
    return path
