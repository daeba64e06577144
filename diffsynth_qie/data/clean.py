"""``qie check-dataset --write_clean``: the metadata without the rows that were flagged or that the reader
skipped, written from the **original records** (every field of a kept row survives, every prompt alternative
included), with the image paths made relative to the new file's folder. The format follows the new file's
extension (``.jsonl``, ``.csv``, else a JSON list). The rows left out are listed, each with why."""
from __future__ import annotations

import csv
import io
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..utils.atomic import atomic_write_text
from .formats import FieldNames, default_dataset_name, load_records, record_row_id

log = logging.getLogger(__name__)


def _path_fields(f: FieldNames) -> tuple[str, ...]:
    return (f.image_field, f.edit_image_field, f.target_field, f.source_field, f.back_mask_field, f.ref_gt_field)


class _Rebase:
    """``os.path.relpath((base / p).resolve(), here)`` for many files in few folders: each folder's real path, its
    path from ``here`` and which of its entries are links are worked out once (one listing: a file that is itself a
    link is still followed), instead of one ``lstat`` per path component and one ``relpath`` per file."""

    def __init__(self, base: Path, here: Path):
        self.base, self.here = str(base), here
        self.folders: dict[str, tuple[str, str, frozenset]] = {}

    def __call__(self, p: str) -> str:
        full = os.path.join(self.base, p)
        folder, name = os.path.split(full)
        if name in ("", ".", ".."):
            return os.path.relpath(Path(full).resolve(), self.here)
        found = self.folders.get(folder)
        if found is None:
            real = str(Path(folder).resolve())
            found = self.folders[folder] = (real, os.path.relpath(real, self.here), _links(real))
        real, rel, links = found
        if name in links:
            return os.path.relpath(Path(real, name).resolve(), self.here)
        return name if rel == "." else os.path.join(rel, name)


def _links(folder: str) -> frozenset:
    """The names of ``folder``'s entries that are links (none when it cannot be listed: a missing folder)."""
    try:
        with os.scandir(folder) as entries:
            return frozenset(e.name for e in entries if e.is_symlink())
    except OSError:
        return frozenset()


def _moved(value: Any, from_csv: bool, rebase: _Rebase) -> Any:
    """A path field's value with each relative path re-based (``rebase``) from the metadata's folder to the new
    file's (absolute paths and URLs as they were)."""

    def one(p: Any) -> Any:
        if not isinstance(p, str) or not p.strip() or "://" in p or os.path.isabs(os.path.expanduser(p)):
            return p
        return rebase(p)

    if isinstance(value, str) and from_csv and value.strip().startswith("["):
        try:
            return [one(p) for p in json.loads(value)]  # (a CSV writer encodes it again)
        except (json.JSONDecodeError, TypeError):
            return value
    return [one(p) for p in value] if isinstance(value, list) else one(value)


def _dumps(records: list[dict], out: Path) -> str:
    suffix = out.suffix.lower()
    if suffix == ".jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if suffix == ".csv":
        columns = list(dict.fromkeys(k for r in records for k in r))
        buf = io.StringIO(newline="")
        writer = csv.DictWriter(buf, columns)
        writer.writeheader()
        for r in records:
            writer.writerow({k: json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else v
                             for k, v in r.items()})
        return buf.getvalue()
    return json.dumps(records, indent=1, ensure_ascii=False) + "\n"


def clean_records(metadata: str | os.PathLike, flagged: Mapping[str, Sequence[str]],
                  skipped: Mapping[str, str], fields: FieldNames | None = None
                  ) -> tuple[list[tuple[int, Any]], list[dict], bool]:
    """``(kept, dropped, from_csv)``: the metadata's ``(index, record)`` pairs kept, and one entry per record
    left out (``record``: its index, ``row_id``, ``why``). ``flagged``: row id -> its flags (a record is left
    out when its row or its inverse row is flagged); ``skipped``: row id -> why the reader skipped it."""
    f = fields or FieldNames()
    path = Path(metadata)
    records, from_csv = load_records(path)
    dataset = default_dataset_name(path)
    kept, dropped, seen = [], [], set()
    for idx, rec in records:
        rid = record_row_id(rec, idx, dataset, f)
        if not isinstance(rec, dict):
            why = "skipped by the reader: not a JSON object"
        elif rid in seen:
            why = "skipped by the reader: duplicate id"
        elif rid in skipped:
            why = f"skipped by the reader: {skipped[rid]}"
        else:
            flags = [*flagged.get(rid, ()), *(f"{k} (inverse row)" for k in flagged.get(f"{rid}#inverse", ()))]
            why = "flagged: " + ", ".join(flags) if flags else None
        seen.add(rid)
        if why is None:
            kept.append((idx, rec))
        else:
            dropped.append({"record": idx, "row_id": rid, "why": why})
    return kept, dropped, from_csv


def write_clean(metadata: str | os.PathLike, out: str | os.PathLike, flagged: Mapping[str, Sequence[str]],
                skipped: Mapping[str, str], base: str | os.PathLike | None = None,
                fields: FieldNames | None = None) -> tuple[int, list[dict]]:
    """Write the kept records to ``out``; returns ``(kept count, dropped entries)`` (see :func:`clean_records`)."""
    f = fields or FieldNames()
    kept, dropped, from_csv = clean_records(metadata, flagged, skipped, f)
    base_dir = Path(base) if base is not None else Path(metadata).parent
    rebase, path_fields = _Rebase(base_dir, Path(out).resolve().parent), _path_fields(f)
    moved = [{k: (_moved(v, from_csv, rebase) if k in path_fields and v is not None else v)
              for k, v in rec.items()} for _, rec in kept]
    atomic_write_text(out, _dumps(moved, Path(out)))
    return len(kept), dropped
