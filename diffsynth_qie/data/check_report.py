"""``qie check-dataset``'s outputs: ``check.jsonl`` (one line per flagged row: the row, each flag and its measured
value; strict JSON, a value that is not finite is written as ``null``) and ``check.html`` (one self-contained
page: the counts per flag and a thumbnail strip of the first ``max_cards`` flagged pairs, so the page stays a
few MB whatever the dataset's size; every flagged row is in ``check.jsonl``)."""
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
    im.thumbnail((THUMB, THUMB))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}" alt="">'


def write_outputs(out_dir: str | Path, checks: Sequence[RowCheck], note: Optional[str], source: str,
                  derived_masks: bool = False, max_cards: int = MAX_CARDS, show_progress: bool = True) -> Path:
    """``check.jsonl`` and ``check.html`` in ``out_dir``; returns the page's path. ``derived_masks``: rows without
    a mask show the one ``qie cache --auto_mask diff`` would derive (captioned as derived). The page shows the
    first ``max_cards`` flagged rows."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    flagged = [c for c in checks if c.flags]
    atomic_write_text(out_dir / "check.jsonl", "".join(json_line(c.to_json()) for c in flagged))
    counts: dict[str, int] = {}
    for c in flagged:
        for name in c.flags:
            counts[name] = counts.get(name, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "nothing flagged"
    cards = []
    shown = flagged[:max_cards]
    for c in tqdm(shown, unit="row", desc="check-dataset: report", disable=not show_progress or not shown):
        derived = (c.paths.get("target"), c.paths.get("source")) if derived_masks and not c.paths.get("mask") else None
        mask_caption = "derived mask (--auto_mask diff)" if derived else "mask"
        flags = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>" for k, v in c.flags.items())
        cards.append(
            f'<div class="card"><h3>{html.escape(c.row_id)}</h3><div class="strip">'
            f'<figure>{_thumb(c.paths.get("source"))}<figcaption>source</figcaption></figure>'
            f'<figure>{_thumb(c.paths.get("target"))}<figcaption>target</figcaption></figure>'
            f'<figure>{_thumb(c.paths.get("mask"), True, derived)}<figcaption>{mask_caption}</figcaption></figure>'
            f'</div><ul>{flags}</ul></div>')
    more = (f"<p>The first {len(shown)} flagged rows are shown; all {len(flagged)} are in check.jsonl.</p>"
            if len(shown) < len(flagged) else "")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>qie check-dataset: {html.escape(source)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:24px;background:#fafafa}}.card{{background:#fff;border:1px solid #ddd;
border-radius:8px;padding:12px;margin:12px 0;display:inline-block;vertical-align:top;width:440px;margin-right:12px}}
.strip{{display:flex;gap:8px}}figure{{margin:0;text-align:center}}img{{max-width:{THUMB}px;max-height:{THUMB}px;
border:1px solid #ccc}}.none{{width:{THUMB}px;height:{THUMB}px;display:flex;align-items:center;justify-content:center;
color:#999;border:1px dashed #ccc}}h3{{margin:0 0 8px;font-size:15px}}ul{{margin:8px 0 0;padding-left:18px;font-size:13px}}
</style></head><body><h1>qie check-dataset</h1><p>{html.escape(source)}: {len(checks)} rows checked, {len(flagged)} flagged
({html.escape(summary)}).</p>{f'<p><i>{html.escape(note)}</i></p>' if note else ''}{more}{''.join(cards)}</body></html>"""
    path = out_dir / "check.html"
    atomic_write_text(path, page)
    return path
