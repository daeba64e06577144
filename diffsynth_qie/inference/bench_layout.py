"""Generations written in the public edit benchmarks' layouts, so their official scorers run on them.

Layouts (sources in docs/SCORECARD.md):

- ``gedit`` (GEdit-Bench, stepfun-ai/Step1X-Edit ``GEdit-Bench``): ``DIR/fullset/<task_type>/<language>/<key>.png``
  for the edit and ``<key>_SRCIMG.png`` beside it for the source; the scorer (VIEScore) walks
  ``fullset``. Rows without ``task_type`` / ``instruction_language`` fields go under ``custom`` / ``en``.
- ``imgedit`` (ImgEdit-Bench, PKU-YuanGroup/ImgEdit ``Benchmark``): ``DIR/<key>.png`` for every edit and
  ``DIR/edit.json`` mapping each key to ``{"id": <source file>, "prompt": <instruction>, "edit_type": ...}``, the
  ``--edit_json`` its ``step2_basic_bench.py`` reads (with ``--result_img_folder DIR``); the sources are copied
  to ``DIR/sources/`` and ``id`` is relative to it (its ``--origin_img_root``).

A key is the row's ``key`` field where it has one, else its position, zero-padded; in a file name it keeps
letters, digits, ``.``, ``_`` and ``-`` (others become ``_``) and its first 80 characters. Two rows whose keys
would write one file (``a/b`` and ``a_b``, or keys equal in their first 80 characters) are refused, naming both
(:func:`check_unique`), before anything is edited.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Sequence

from PIL import Image

from ..utils.atomic import atomic_save, atomic_write_text

LAYOUTS = ("gedit", "imgedit")


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:80] or "_"


def folder_name(column: str) -> str:
    """The folder of a scorecard column's generations (``base``, ``lora``, ``lora+turbo@4`` -> ``lora_turbo_4``)."""
    return _safe(column.replace("+", "_").replace("@", "_"))


def row_key(k: int, extra: Optional[dict]) -> str:
    key = (extra or {}).get("key")
    return _safe(str(key)) if key is not None else f"{k:05d}"


def edit_file(layout: str, k: int, extra: Optional[dict]) -> str:
    """Where the ``k``-th row's edit goes in ``layout``, relative to the output folder."""
    extra, key = extra or {}, row_key(k, extra)
    if layout == "gedit":
        return (f"fullset/{_safe(str(extra.get('task_type', 'custom')))}/"
                f"{_safe(str(extra.get('instruction_language', 'en')))}/{key}.png")
    return f"{key}.png"


def check_unique(layout: str, extras: Sequence[Optional[dict]], where: str = "--export") -> None:
    """Refuse two rows that would write the same file in ``layout`` (ValueError naming both and the file)."""
    seen: dict[str, int] = {}
    for k, extra in enumerate(extras):
        name = edit_file(layout, k, extra)
        if name in seen:
            first, second = (str((extras[j] or {}).get("key", f"{j:05d}")) for j in (seen[name], k))
            raise ValueError(f"{where}: rows {first!r} and {second!r} would both be written as {name} (a file name "
                             "keeps letters, digits, '.', '_' and '-' of a key, and its first 80 characters); "
                             "give one of them another key")
        seen[name] = k


def export(layout: str, out_dir: str | Path, sources: Sequence[Image.Image], prompts: Sequence[str],
           outputs: Sequence[Image.Image], extras: Optional[Sequence[Optional[dict]]] = None) -> list[Path]:
    """Write ``outputs`` (with their ``sources`` and ``prompts``) in ``layout``; returns the edit files written.
    ``extras``: per row, the benchmark fields it carries (``key``, ``task_type``, ``instruction_language``,
    ``edit_type``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"--export {layout!r}: choose one of {', '.join(LAYOUTS)}")
    if not len(sources) == len(prompts) == len(outputs):
        raise ValueError(f"export needs one source, prompt and output per row, got {len(sources)}, {len(prompts)}, "
                         f"{len(outputs)}")
    extras = list(extras) if extras is not None else [None] * len(outputs)
    check_unique(layout, extras)
    root, written, meta = Path(out_dir), [], {}
    for k, (src, prompt, out, extra) in enumerate(zip(sources, prompts, outputs, extras)):
        key, edit = row_key(k, extra), root / edit_file(layout, k, extra)
        extra = extra or {}
        if layout == "gedit":
            source = edit.with_name(f"{key}_SRCIMG.png")
        else:
            source = root / "sources" / f"{key}.png"
            meta[key] = {"id": f"{key}.png", "prompt": prompt, "edit_type": extra.get("edit_type", "custom")}
        atomic_save(edit, lambda p, im=out: im.save(p, format="PNG"))
        atomic_save(source, lambda p, im=src: im.convert("RGB").save(p, format="PNG"))
        written.append(edit)
    if layout == "imgedit":
        atomic_write_text(root / "edit.json", json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    return written
