"""Metadata formats -> :class:`EditRow` lists.

Supported (auto-detected by extension, then content, then field names):

- **DiffSynth** metadata as JSON (a list of objects), JSONL or CSV, fields
  ``prompt``, ``image`` (target), ``edit_image`` (one path or a list; in CSV a
  JSON-encoded list or a single path), optional ``back_mask``, ``ref_gt`` and ``rejected`` (a preference
  row: the target is the chosen output, ``docs/PREFERENCE.md``).
- **FireRed-style JSONL** (also as JSON list or CSV), recognised by its
  ``target_image`` field: ``source_image`` (path, list, or null = text-to-image),
  ``instruction``/``instruction_cn`` (prompt alternatives) and optional
  ``inverse_instruction``/``inverse_instruction_cn``. A row with an inverse
  text and exactly one source also yields an *inverse* row (source and target
  swapped) unless ``disable_inverse``.

Either format may have an ``id`` field; otherwise the row id is
``<dataset>:<index>`` (0-based record index; for JSONL the 0-based line number),
stable as long as the file is only appended to. Parsing never opens images:
:func:`prepare_rows` adds validation, ``skipped.jsonl`` and the bad-row limit.

File-level problems (invalid JSON, missing required columns) raise ValueError;
row-level problems (no target, t2i row without ``t2i_mode``, duplicate id)
make the row a :class:`SkippedRow`.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

from .fields import DatasetConfig, FieldNames  # noqa: F401 (re-exported: the CLI's dataset flags)
from .rows import (DEFAULT_MAX_BAD_FRACTION, EditRow, SkippedRow, check_bad_fraction, log_skip,
                   validate_rows, write_skipped)

log = logging.getLogger(__name__)

T2I_REASON = "no source image; pass --t2i_mode for text-to-image rows"


# ---------------------------------------------------------------- file readers

def _read_json_list(path: Path, text: str) -> list[tuple[int, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno}); "
                         "fix the file (a .json metadata file must be one JSON list of objects)") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of row objects, got {type(data).__name__}; "
                         "wrap the rows in [...] or write one object per line as .jsonl")
    return list(enumerate(data))


def _read_jsonl(path: Path, text: str) -> list[tuple[int, Any]]:
    out = []
    for i, line in enumerate(text.split("\n")):  # (splitlines also splits at U+2028 inside strings)
        if not line.strip():
            continue
        try:
            out.append((i, json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i + 1}: invalid JSON line ({e.msg}, column {e.colno}); "
                             "fix or delete that line (JSONL needs one complete JSON object per line)") from e
    return out


def _read_csv(path: Path, text: str) -> list[tuple[int, Any]]:
    reader = csv.DictReader(io.StringIO(text, newline=""))  # quoted newlines stay in their cell
    if not reader.fieldnames:
        raise ValueError(f"{path}: CSV has no header row; the first line must name the columns")
    repeated = sorted({name for name in reader.fieldnames if reader.fieldnames.count(name) > 1})
    if repeated:  # csv.DictReader would keep the last column of a name and silently drop the others
        raise ValueError(f"{path}: the header names column(s) {', '.join(map(repr, repeated))} more than once; "
                         "rename or remove the duplicates (only one column per field is read)")
    out = []
    for i, rec in enumerate(reader):
        if None in rec:
            raise ValueError(f"{path}:{reader.line_num}: more cells than header columns; "
                             "quote cells that contain commas")
        out.append((i, {k: (v if v != "" else None) for k, v in rec.items()}))
    return out


def read_utf8(path: Path, what: str = "metadata file") -> str:
    """A text file's content (UTF-8, a byte-order mark dropped); ValueError naming the file when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e}); save the {what} as UTF-8") from e


def load_records(path: Path) -> tuple[list[tuple[int, Any]], bool]:
    """``(records, from_csv)``: (index, record) pairs, and whether cells are CSV strings."""
    text = read_utf8(path)
    suffix = path.suffix.lower()
    stripped = text.lstrip()
    if suffix == ".csv":
        return _read_csv(path, text), True
    if suffix == ".jsonl":
        return _read_jsonl(path, text), False
    if stripped.startswith("{"):  # JSON lines, whatever the extension ...
        try:  # ... unless the whole file is one JSON object (e.g. {"rows": [...]})
            whole = json.loads(text)
        except json.JSONDecodeError:
            return _read_jsonl(path, text), False
        if isinstance(whole, dict) and "\n" in text.strip():
            return _read_json_list(path, text), False  # raises "expected a JSON list"
        return _read_jsonl(path, text), False
    if suffix == ".json" or stripped.startswith("["):
        return _read_json_list(path, text), False
    return _read_csv(path, text), True


# ---------------------------------------------------------------- row parsing

def _is_empty(v: Any) -> bool:
    return v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v)


def _text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, list):  # DiffSynth allows a list of alternatives in some exports
        return " ".join(str(x) for x in v)
    return str(v).strip()


class _RowError(Exception):
    def __init__(self, fieldname: str, path: str | None, reason: str):
        self.fieldname, self.path, self.reason = fieldname, path, reason


def _path_list(v: Any, fieldname: str, from_csv: bool) -> list[str]:
    """A field that holds one path or a list of paths (CSV: JSON-encoded list)."""
    if _is_empty(v):
        return []
    if isinstance(v, str) and from_csv and v.strip().startswith("["):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise _RowError(fieldname, None, f"cell is not a valid JSON list ({e.msg}): {v!r}") from e
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(x, str) and x.strip() for x in v):
        return list(v)
    raise _RowError(fieldname, None, f"expected a path or a list of paths, got {v!r}")


def _resolve(p: str, base: Path, fieldname: str) -> Path:
    if "://" in p:
        raise _RowError(fieldname, p, "URLs are not supported; download the images and use local paths")
    q = os.path.expanduser(p) if p.startswith("~") else p  # (os.path: a Path per step costs more than the row)
    return Path(q) if os.path.isabs(q) else base / q


def _one_path(v: Any, fieldname: str, base: Path, required: bool) -> Path | None:
    if _is_empty(v):
        if required:
            raise _RowError(fieldname, None, "missing value")
        return None
    if not isinstance(v, str):
        raise _RowError(fieldname, None, f"expected one path, got {v!r}")
    return _resolve(v, base, fieldname)


def detect_format(records: list[tuple[int, Any]], fields_: FieldNames) -> str:
    """'firered' when any row has the FireRed target field, else 'diffsynth'."""
    keys: set[str] = set()
    for _, rec in records:
        if isinstance(rec, dict):
            keys.update(rec)
    if fields_.target_field in keys:
        return "firered"
    if fields_.image_field in keys:
        return "diffsynth"
    raise ValueError(f"cannot tell the metadata format: no row has {fields_.image_field!r} (DiffSynth target) "
                     f"or {fields_.target_field!r} (FireRed target); fields found: {sorted(keys)[:20]}. "
                     "Rename the fields or pass --image_field / --target_field.")


def _parse_record(rec: dict, row_id: str, fmt: str, base: Path, f: FieldNames, dataset: str,
                  from_csv: bool, disable_inverse: bool, t2i_mode: bool) -> list[EditRow]:
    if fmt == "firered":
        target = _one_path(rec.get(f.target_field), f.target_field, base, True)
        sources = [_resolve(p, base, f.source_field) for p in _path_list(rec.get(f.source_field), f.source_field, from_csv)]
        prompts = [t for t in (_text(rec.get(f.instruction_field)), _text(rec.get(f.instruction_cn_field))) if t]
        inverse_prompts = [t for t in (_text(rec.get(f.inverse_instruction_field)),
                                       _text(rec.get(f.inverse_instruction_cn_field))) if t]
        source_name = f.source_field
    else:
        target = _one_path(rec.get(f.image_field), f.image_field, base, True)
        sources = [_resolve(p, base, f.edit_image_field)
                   for p in _path_list(rec.get(f.edit_image_field), f.edit_image_field, from_csv)]
        raw = rec.get(f.prompt_field)
        if raw is None and f.prompt_field not in rec:  # DiffSynth rows written with FireRed's prompt fields
            raw = [rec.get(f.instruction_field), rec.get(f.instruction_cn_field)]
        prompts = [t for t in (_text(x) for x in raw)] if isinstance(raw, list) else [_text(raw)]
        prompts = [p for p in prompts if p]
        inverse_prompts = []
        source_name = f.edit_image_field
    if not sources and not t2i_mode:
        raise _RowError(source_name, None, T2I_REASON)
    back_mask = _one_path(rec.get(f.back_mask_field), f.back_mask_field, base, False)
    ref_gt = _one_path(rec.get(f.ref_gt_field), f.ref_gt_field, base, False)
    rejected = _one_path(rec.get(f.rejected_field), f.rejected_field, base, False)
    assert target is not None
    rows = [EditRow(row_id=row_id, prompts=prompts, target=target, edit_images=sources,
                    back_mask=back_mask, ref_gt=ref_gt, dataset=dataset, inverse=False, rejected=rejected)]
    if inverse_prompts and len(sources) == 1 and not disable_inverse:
        # The edit region is the same in both directions; ref_gt and a rejected output
        # describe the forward target only, so the inverse row has neither.
        rows.append(EditRow(row_id=f"{row_id}#inverse", prompts=inverse_prompts, target=sources[0],
                            edit_images=[target], back_mask=back_mask, ref_gt=None, dataset=dataset,
                            inverse=True))
    return rows


def default_dataset_name(metadata_path: str | os.PathLike) -> str:
    """The metadata file's directory name (FireRed convention: one directory per dataset)."""
    p = Path(metadata_path).resolve()
    return p.parent.name or p.stem


def record_row_id(rec: Any, idx: int, dataset: str, f: FieldNames) -> str:
    """A record's row id: its id field, else ``<dataset>:<index>``."""
    if isinstance(rec, dict) and not _is_empty(rec.get(f.id_field)):
        return str(rec[f.id_field])
    return f"{dataset}:{idx}"


def read_rows(metadata_path: str | os.PathLike, base_dir: str | os.PathLike | None = None, *,
              dataset_name: str | None = None, fields: FieldNames | None = None,
              disable_inverse: bool = False, t2i_mode: bool = False,
              skipped: list[SkippedRow] | None = None) -> list[EditRow]:
    """Parse a metadata file into rows (no image is opened).

    Rows that cannot be parsed (no target, t2i without ``t2i_mode``, URL paths,
    duplicate id, non-object records) are logged and appended to ``skipped``
    when given, so they count in ``skipped.jsonl`` and the bad-row fraction.
    """
    path = Path(metadata_path)
    if not path.is_file():
        raise FileNotFoundError(f"metadata file not found: {path}")
    f = fields or FieldNames()
    base = Path(base_dir) if base_dir is not None else path.parent
    if not base.is_dir():
        raise ValueError(f"dataset base directory {base} does not exist; pass the directory "
                         "the image paths in the metadata are relative to")
    dataset = dataset_name or default_dataset_name(path)
    records, from_csv = load_records(path)
    if not records:
        return []
    fmt = detect_format(records, f)
    rows: list[EditRow] = []
    seen: dict[str, int] = {}
    for idx, rec in records:
        row_id = record_row_id(rec, idx, dataset, f)
        try:
            if not isinstance(rec, dict):
                raise _RowError("row", None, f"expected a JSON object, got {type(rec).__name__}")
            if row_id in seen:
                raise _RowError(f.id_field, None, f"duplicate id (first used by record {seen[row_id]})")
            seen[row_id] = idx
            rows.extend(_parse_record(rec, row_id, fmt, base, f, dataset, from_csv, disable_inverse, t2i_mode))
        except _RowError as e:
            s = SkippedRow(row_id, e.fieldname, e.path, e.reason)
            log_skip(s)
            if skipped is not None:
                skipped.append(s)
    log.info("read %d rows (%s format, dataset %r) from %s", len(rows), fmt, dataset, path)
    return rows


def prepare_rows(metadata_path: str | os.PathLike, base_dir: str | os.PathLike | None = None, *,
                 dataset_name: str | None = None, fields: FieldNames | None = None,
                 disable_inverse: bool = False, t2i_mode: bool = False, check_images: bool = True,
                 max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
                 skipped_path: str | os.PathLike | None = None) -> tuple[list[EditRow], list[SkippedRow]]:
    """Read + validate + write ``skipped.jsonl`` (if ``skipped_path``) + enforce the bad-row limit.

    The one call a cache writer needs. Returns ``(good_rows, skipped)``.
    """
    skipped: list[SkippedRow] = []
    rows = read_rows(metadata_path, base_dir, dataset_name=dataset_name, fields=fields,
                     disable_inverse=disable_inverse, t2i_mode=t2i_mode, skipped=skipped)
    n_total = len(rows) + len(skipped)
    good, bad = validate_rows(rows, check_images=check_images)
    skipped.extend(bad)
    if skipped_path is not None:
        write_skipped(skipped_path, skipped)
    check_bad_fraction(n_total, skipped, max_bad_fraction, metadata_path, skipped_path)
    return good, skipped


def prepare_rows_from_config(cfg: DatasetConfig, fields_: FieldNames | None = None, *,
                             check_images: bool = True, skipped_path: str | os.PathLike | None = None
                             ) -> tuple[list[EditRow], list[SkippedRow]]:
    """:func:`prepare_rows` driven by the CLI dataclasses."""
    if not cfg.dataset_metadata:
        raise ValueError("no dataset given; pass --dataset_metadata FILE (e.g. from `qie make-demo-data`)")
    return prepare_rows(cfg.dataset_metadata, cfg.dataset_base, dataset_name=cfg.dataset_name, fields=fields_,
                        disable_inverse=cfg.disable_inverse, t2i_mode=cfg.t2i_mode, check_images=check_images,
                        max_bad_fraction=cfg.max_bad_fraction, skipped_path=skipped_path)

