"""``qie check-dataset`` on a labelled benchmark of real photos: precision and recall per flag, and pairs/s.

    python -m benchmarks.pairs_bench [--side 384] [--repeats 3] [--speed 40] [--workers 2] [--keep DIR]

The photos are the ones scikit-image ships (``skimage/data``, the ``dev`` extra installs it); the cases and their
labels are data (``tests/assets/pairs_bench.json``, or ``benchmarks.pairs_cases`` with ``--repeats``). Every
case is rendered into a temporary folder at ``--side`` px (long side): clean edits of many kinds and planted
problems of each kind the check claims (see ``pairs_cases.py``). The check runs on it as a user would, and
each flag is scored against the labels: a flag raised on a row not labelled with it is a false positive.
``--speed N`` times N pairs at 1024x1024 with ``--workers`` processes.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import io
import json
import logging
import random
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont, ImageOps

log = logging.getLogger("pairs_bench")
CASES = Path(__file__).resolve().parents[1] / "tests" / "assets" / "pairs_bench.json"
RGB = {"red": (215, 40, 35), "blue": (40, 70, 215), "green": (40, 170, 60), "yellow": (235, 205, 30),
       "purple": (140, 50, 175), "orange": (240, 130, 20)}


def photo_dir() -> Path:
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("scikit-image is not installed: pip install scikit-image (the dev extra has it)")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


@functools.lru_cache(maxsize=None)
def _open(name: str) -> Image.Image:
    return Image.open(photo_dir() / name).convert("RGB")


def _photo(name: str, aspect, side: int, shift=(0, 0), zoom: float = 1.0) -> Image.Image:
    """The largest centred crop of ``name`` with ``aspect`` (80 % of it, so a shift or a zoom out stays inside), moved by
    ``shift`` output px and zoomed by ``zoom``, at ``side`` px on its long side."""
    im = _open(name)
    aw, ah = aspect
    w, h = (side, round(side * ah / aw)) if aw >= ah else (round(side * aw / ah), side)
    w, h = w // 8 * 8, h // 8 * 8
    cw = min(im.width, im.height * aw / ah) * 0.8
    ch = cw * ah / aw
    k = cw / w  # photo px per output px
    cx, cy = im.width / 2 + shift[1] * k, im.height / 2 + shift[0] * k
    cw, ch = cw / zoom, ch / zoom
    return im.resize((w, h), Image.Resampling.LANCZOS, box=(cx - cw / 2, cy - ch / 2, cx + cw / 2, cy + ch / 2))


def _region(size, box, pad: int = 0) -> tuple[Image.Image, tuple[int, int, int, int]]:
    w, h = size
    x0, y0 = int(box[0] * w), int(box[1] * h)
    x1, y1 = int((box[0] + box[2]) * w), int((box[1] + box[3]) * h)
    m = Image.new("L", size, 0)
    ImageDraw.Draw(m).ellipse((x0 - pad, y0 - pad, x1 + pad, y1 + pad), fill=255)
    return m, (x0, y0, x1, y1)


def _soft(m: Image.Image) -> Image.Image:
    return m.filter(ImageFilter.GaussianBlur(2))


def apply_edit(src: Image.Image, e: dict, side: int) -> tuple[Image.Image, Image.Image]:
    """``(target, mask)``: the edit ``e`` applied to ``src``; the mask covers it with a margin."""
    op, size = e["op"], src.size
    if op == "none":
        return src.copy(), Image.new("L", size, 0)
    if op in ("grade", "style"):
        if op == "grade":
            a = (np.asarray(src, np.float64) / 255) ** e["gamma"] * np.array(e["gains"]) * 255
            out = Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))
        else:
            out = ImageOps.posterize(src.filter(ImageFilter.SMOOTH_MORE), 3).filter(ImageFilter.EDGE_ENHANCE)
        return out, Image.new("L", size, 255)
    m, (x0, y0, x1, y1) = _region(size, e["box"])
    out = src.copy()
    if op == "recolour":
        lum = np.asarray(src.convert("L"), np.float64)[..., None] / 255
        tint = Image.fromarray(np.clip((0.45 + 0.9 * lum) * np.array(RGB[e["colour"]]), 0, 255).astype(np.uint8))
        out.paste(tint, (0, 0), _soft(m))
    elif op == "insert":
        donor = _photo(e["donor"], (1, 1), side).resize((x1 - x0, y1 - y0))
        framed = ImageOps.expand(donor.crop((4, 4, donor.width - 4, donor.height - 4)), 4, fill=(250, 250, 250))
        out.paste(framed, (x0, y0))
        m = Image.new("L", size, 0)
        m.paste(255, (x0, y0, x1, y1))
    elif op in ("remove", "move"):  # (the source gets an object, see build(); the target is the photo's own)
        dy, dx = e.get("offset", (0, 0))
        obj = _photo(e.get("donor", "astronaut.png"), (1, 1), side).resize((x1 - x0, y1 - y0))
        if op == "move":
            out.paste(obj, (x0 + dx, y0 + dy), m.crop((x0, y0, x1, y1)))
            moved = Image.new("L", size, 0)
            moved.paste(m.crop((x0, y0, x1, y1)), (x0 + dx, y0 + dy))
            m = Image.fromarray(np.maximum(np.asarray(m), np.asarray(moved)))
    elif op == "text":
        draw = ImageDraw.Draw(out)
        font = ImageFont.load_default(size=max(12, (y1 - y0) // 2))
        bright = np.asarray(src.convert("L").crop((x0, y0, x1, y1))).mean() > 128
        draw.text((x0, y0), e["text"], fill=(10, 10, 10) if bright else (250, 250, 250), font=font,
                  stroke_width=1, stroke_fill=(128, 128, 128))
        l, t, r, b = draw.textbbox((x0, y0), e["text"], font=font, stroke_width=1)
        m = Image.new("L", size, 0)
        m.paste(255, (l, t, r, b))
    return out, m.filter(ImageFilter.MaxFilter(9))


def _save(im: Image.Image, path: Path, quality: int | None = None) -> str:
    if quality is not None or path.suffix == ".jpg":
        im.save(path.with_suffix(".jpg"), quality=quality or 92)
        return path.with_suffix(".jpg").name
    im.save(path)
    return path.name


def _reencode(im: Image.Image, quality: int) -> Image.Image:
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=quality)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def build(cases: list[dict], out: Path, side: int = 256) -> tuple[Path, dict[str, list[str]]]:
    """Render ``cases`` into ``out``; returns the metadata file and the labels (row id -> expected flags)."""
    out.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict] = {}
    sources: dict[str, str] = {}
    for c in cases:
        p, rid, e = c.get("problem") or {}, c["id"], c["edit"]
        kind = p.get("kind")
        if kind == "duplicate_of":
            records[rid] = {**records[p["of"]], "id": rid}
            continue
        if kind == "reencoded_of":
            orig = records[p["of"]]
            rec = {**orig, "id": rid}
            for key in ("image", "edit_image"):
                rec[key] = _save(Image.open(out / orig[key]).convert("RGB"), out / f"{rid}_{key}", p["quality"])
            records[rid] = rec
            continue
        src = _photo(c["photo"], c["aspect"], side)
        if c["source_fmt"] == "jpg":
            src = _reencode(src, 92)
        if kind in (None, "outside"):  # the photo's shared source file
            if c["source"] not in sources:
                sources[c["source"]] = _save(src, out / f"{c['source']}_src.{c['source_fmt']}")
            src_name = sources[c["source"]]
        else:
            src_name = None
        base = src
        if kind == "shift":
            base = _photo(c["photo"], c["aspect"], side, shift=(p["dy"], p["dx"]))
        elif kind == "zoom":
            base = _photo(c["photo"], c["aspect"], side, zoom=p["factor"])
        elif kind == "wrong_source":
            base = _photo(p["photo"], c["aspect"], side)
        if e["op"] in ("remove", "move"):  # the source holds the object the target removes or moves
            m, (x0, y0, x1, y1) = _region(base.size, e["box"])
            obj = _photo(e.get("donor", "astronaut.png"), (1, 1), side).resize((x1 - x0, y1 - y0))
            with_obj = src.copy()
            with_obj.paste(obj, (x0, y0), m.crop((x0, y0, x1, y1)))
            target, mask = apply_edit(base, e, side)
            src, src_name = with_obj, None
        else:
            target, mask = apply_edit(base, e, side)
        if kind == "reencode":
            target = _reencode(src, p["quality"])
        elif kind == "outside":  # a second recolour, away from the edit's region
            box = p["box"]
            ex = e["box"]
            if box[0] < ex[0] + ex[2] and ex[0] < box[0] + box[2] and box[1] < ex[1] + ex[3] and ex[1] < box[1] + box[3]:
                box = [0.02 if ex[0] + ex[2] / 2 > 0.5 else 0.98 - box[2], box[1], box[2], box[3]]
            target, _ = apply_edit(target, {"op": "recolour", "box": box, "colour": p["colour"]}, side)
        if kind == "reversed":
            src, target = target, src
        rec = {"id": rid, "prompt": e["prompt"],
               "image": _save(target, out / f"{rid}_t.png"),
               "edit_image": src_name or _save(src, out / f"{rid}_s.{c['source_fmt']}")}
        if c["mask"] != "none":
            if c["mask"] == "full":
                mask = Image.new("L", target.size, 255)
            elif c["mask"] == "empty":
                mask = Image.new("L", target.size, 0)
            elif c["mask"] == "wrong_size":
                w, h = target.size
                mask = mask.resize((h, h) if w != h else (w, w * 3 // 4), Image.Resampling.NEAREST)
            rec["back_mask"] = _save(mask, out / f"{rid}_m.png")
        records[rid] = rec
    meta = out / "metadata.json"
    meta.write_text(json.dumps(list(records.values()), indent=0))
    return meta, {c["id"]: c["expect"] for c in cases}


def score(checks, labels: dict[str, list[str]], severity_of=None) -> dict[str, dict]:
    """Per flag: tp, fp, fn, precision, recall, severity; plus ``_clean``: clean rows with an error flag."""
    severity_of = severity_of or (lambda name: "error")
    got = {c.row_id: set(c.flags) for c in checks}
    names = sorted({f for fl in got.values() for f in fl} | {f for e in labels.values() for f in e})
    table = {}
    for name in names:
        tp = sum(1 for r, e in labels.items() if name in e and name in got.get(r, ()))
        fp = sum(1 for r, e in labels.items() if name not in e and name in got.get(r, ()))
        fn = sum(1 for r, e in labels.items() if name in e and name not in got.get(r, ()))
        table[name] = {"tp": tp, "fp": fp, "fn": fn, "severity": severity_of(name),
                       "precision": tp / (tp + fp) if tp + fp else 1.0, "recall": tp / (tp + fn) if tp + fn else 1.0}
    clean = [r for r, e in labels.items() if not e]
    bad = [r for r in clean if any(severity_of(f) == "error" for f in got.get(r, ()))]
    table["_clean"] = {"rows": len(clean), "with_error": len(bad), "ids": bad}
    return table


def _severity():
    try:
        from diffsynth_qie.data.check_rules import severity
    except ImportError:  # (a check without severities: every flag counts as an error)
        return None
    return severity


def run_benchmark(cases, side: int, workers: int, folder: Path):
    from diffsynth_qie.commands.check_dataset import _as_task
    from diffsynth_qie.data.check import CheckConfig, check_rows
    from diffsynth_qie.data.formats import read_rows

    meta, labels = build(cases, folder, side)
    start = time.perf_counter()
    checks, _ = check_rows([_as_task(r) for r in read_rows(meta)], CheckConfig(workers=workers), show_progress=False)
    return score(checks, labels, _severity()), len(checks) / (time.perf_counter() - start), checks


def speed(n: int, workers: int, folder: Path) -> float:
    """Pairs/s of the check on ``n`` 1024x1024 pairs (local recolours of the photos)."""
    from diffsynth_qie.data.check import CheckConfig, check_rows

    rng, rows = random.Random(0), []
    names = json.loads(CASES.read_text())
    for i in range(n):
        c = names[i % len(names)]
        src = _photo(c["photo"], (1, 1), 1024)
        tgt, mask = apply_edit(src, {"op": "recolour", "box": [rng.uniform(0.1, 0.6), 0.3, 0.25, 0.25],
                                     "colour": "blue"}, 1024)
        rows.append({"row_id": f"s{i}", "prompt": "make it blue", "target": str(folder / _save(tgt, folder / f"{i}t.png")),
                     "source": str(folder / _save(src, folder / f"{i}s.png")),
                     "mask": str(folder / _save(mask, folder / f"{i}m.png"))})
    start = time.perf_counter()
    check_rows(rows, CheckConfig(workers=workers), show_progress=False)
    return n / (time.perf_counter() - start)


def format_table(table: dict) -> str:
    lines = [f"{'flag':24} {'severity':8} {'tp':>4} {'fp':>4} {'fn':>4} {'precision':>9} {'recall':>7}"]
    for name, t in table.items():
        if not name.startswith("_"):
            lines.append(f"{name:24} {t['severity']:8} {t['tp']:4d} {t['fp']:4d} {t['fn']:4d} "
                         f"{t['precision']:9.1%} {t['recall']:7.1%}")
    c = table["_clean"]
    lines.append(f"clean rows with an error flag: {c['with_error']} of {c['rows']} {c['ids'][:8]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=0, help="0: the tests' cases; N: N draws per photo")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--speed", type=int, default=40, help="1024x1024 pairs to time (0: none)")
    parser.add_argument("--keep", default=None, help="build into this folder and keep it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from benchmarks.pairs_cases import cases as draw

    cases = draw(args.repeats) if args.repeats else json.loads(CASES.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        table, rate, _ = run_benchmark(cases, args.side, args.workers, folder / "bench")
        log.info("%d cases at %d px (%.1f rows/s with %d workers):\n%s", len(cases), args.side, rate, args.workers,
                 format_table(table))
        if args.speed:
            (folder / "speed").mkdir(parents=True, exist_ok=True)
            log.info("speed: %.1f pairs/s at 1024x1024 with %d workers", speed(args.speed, args.workers,
                                                                                folder / "speed"), args.workers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
