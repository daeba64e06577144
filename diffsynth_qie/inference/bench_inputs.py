"""The input side of the public edit benchmarks: a benchmark folder as it ships, read as rows to edit.

``qie eval-edits --bench DIR`` edits every row (sources and instructions, no targets) and writes the
generations in the benchmark's own layout (``bench_layout.py``), ready for its official scorer. Sources in
docs/SCORECARD.md.

- ``imgedit`` (ImgEdit-Bench, huggingface.co/datasets/sysuyy/ImgEdit ``Benchmark.tar`` with the
  ``basic_edit.json`` of github.com/PKU-YuanGroup/ImgEdit ``Benchmark/``): a JSON file mapping each key to
  ``{"id": <source path>, "prompt": <instruction>, "edit_type": ...}``; ``id`` is relative to the folder's
  ``singleturn/`` (the tarball's), else ``sources/`` (what ``--export imgedit`` writes), else the folder itself.
  The JSON is ``DIR/basic_edit.json``, else ``DIR/edit.json``. ``id`` and ``prompt`` must be text (anything else
  is named, not sent as its string).
- ``gedit`` (GEdit-Bench, huggingface.co/datasets/stepfun-ai/GEdit-Bench): the dataset's parquet files under
  ``DIR`` (``DIR/data/train-*.parquet`` after ``huggingface-cli download ... --local-dir DIR``), columns
  ``key``, ``task_type``, ``instruction``, ``instruction_language`` and ``input_image`` (``{"bytes", "path"}``).
  Reading parquet needs ``pyarrow``.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from PIL import Image

IMGEDIT_JSON = ("basic_edit.json", "edit.json")
IMGEDIT_ROOTS = ("singleturn", "sources", ".")
GEDIT_FIELDS = ("key", "task_type", "instruction_language")


@dataclass
class BenchRow:
    """One benchmark row: its source image, instruction and the fields its layout keys on."""

    source: Image.Image
    prompt: str
    extra: dict = field(default_factory=dict)  # key, task_type, instruction_language, edit_type


def detect(bench_dir: str | Path) -> str:
    """``"imgedit"`` or ``"gedit"``, from what ``bench_dir`` holds; a clear error otherwise."""
    root = Path(bench_dir)
    if not root.is_dir():
        raise ValueError(f"--bench {bench_dir}: not a directory; give a GEdit-Bench or ImgEdit-Bench folder "
                         "(docs/SCORECARD.md)")
    if any((root / name).is_file() for name in IMGEDIT_JSON):
        return "imgedit"
    if next(root.rglob("*.parquet"), None) is not None:
        return "gedit"
    raise ValueError(f"--bench {bench_dir}: neither an ImgEdit-Bench folder ({' or '.join(IMGEDIT_JSON)}) nor "
                     "GEdit-Bench's parquet files; see docs/SCORECARD.md for both layouts")


def read_bench(bench_dir: str | Path, limit: Optional[int] = None) -> tuple[str, list[BenchRow]]:
    """(layout, rows) of a benchmark folder, the first ``limit`` rows (all with None)."""
    from .bench_layout import check_unique

    layout = detect(bench_dir)
    rows = imgedit_rows(bench_dir, limit) if layout == "imgedit" else gedit_rows(_parquet_records(bench_dir), limit)
    if not rows:
        raise ValueError(f"--bench {bench_dir}: no rows to edit")
    check_unique(layout, [r.extra for r in rows], f"--bench {bench_dir}")  # before anything is edited
    return layout, rows


def _text(value, where: str, field: str) -> str:
    """``value`` as the text it must be: a string with something visible, else one line naming it."""
    from ..utils.text import is_empty_prompt

    if not isinstance(value, str) or is_empty_prompt(value):
        raise ValueError(f"{where}: {field!r} must be a non-empty text, got {json.dumps(value, ensure_ascii=False)}; "
                         "fix the row or drop it")
    return value


def imgedit_rows(bench_dir: str | Path, limit: Optional[int] = None) -> list[BenchRow]:
    from ..data.images import load_rgb

    root = Path(bench_dir)
    meta_file = next(root / n for n in IMGEDIT_JSON if (root / n).is_file())
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{meta_file}: not readable JSON ({e})") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_file}: expected a JSON object mapping each key to {{id, prompt, edit_type}}")
    rows = []
    for key, item in list(meta.items())[:limit]:
        if not isinstance(item, dict) or "id" not in item or "prompt" not in item:
            raise ValueError(f"{meta_file}: row {key!r} needs 'id' (the source image) and 'prompt'")
        where = f"{meta_file}: row {key!r}"
        source, prompt = _text(item["id"], where, "id"), _text(item["prompt"], where, "prompt")
        path = next((root / r / source for r in IMGEDIT_ROOTS if (root / r / source).is_file()), None)
        if path is None:
            raise ValueError(f"{where}: source {source} is in none of "
                             f"{', '.join(str(root / r) for r in IMGEDIT_ROOTS)}")
        rows.append(BenchRow(load_rgb(path), prompt, {"key": str(key), "edit_type": str(item.get("edit_type", "custom"))}))
    return rows


def gedit_rows(records: Iterable[dict], limit: Optional[int] = None) -> list[BenchRow]:
    """GEdit-Bench records (the parquet's rows as dicts) as rows; ``input_image`` is ``{"bytes": ...}``."""
    from ..data.images import to_rgb

    rows = []
    for i, rec in enumerate(records):
        if limit is not None and i >= limit:
            break
        image = rec.get("input_image")
        data = image.get("bytes") if isinstance(image, dict) else None
        if not data or "instruction" not in rec:
            raise ValueError(f"GEdit-Bench row {rec.get('key', i)!r} has no input_image bytes or no instruction")
        prompt = _text(rec["instruction"], f"GEdit-Bench row {rec.get('key', i)!r}", "instruction")
        rows.append(BenchRow(to_rgb(Image.open(io.BytesIO(data))), prompt,
                             {k: str(rec[k]) for k in GEDIT_FIELDS if rec.get(k) is not None}))
    return rows


def _parquet_records(bench_dir: str | Path) -> Iterable[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError(f"--bench {bench_dir} holds GEdit-Bench's parquet files; reading them needs pyarrow: "
                         "`pip install pyarrow`") from e
    for path in sorted(Path(bench_dir).rglob("*.parquet")):
        yield from pq.read_table(path).to_pylist()
