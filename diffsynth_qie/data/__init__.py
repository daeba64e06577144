"""Dataset layer: metadata formats -> rows, image/mask loading, validation, demo data.

Typical use (cache writer)::

    rows, skipped = prepare_rows(metadata, base_dir, skipped_path=out / "skipped.jsonl")
    for row in rows:
        target = load_rgb(row.target)
        w, h = fit_to_budget(*target.size, max_pixels)
        target = resize_to(target, (w, h))

Only PIL, numpy and the standard library are imported here (no torch).
"""
from .formats import (DatasetConfig, FieldNames, default_dataset_name, detect_format, prepare_rows,
                      prepare_rows_from_config, read_rows)
from .images import (MASK_THRESHOLD, fit_to_budget, image_bytes_hash, load_mask, load_rgb, resize_mask, resize_to,
                     to_mask, to_rgb)
from .rows import (DEFAULT_MAX_BAD_FRACTION, EditRow, SkippedRow, check_bad_fraction, check_row, validate_rows,
                   write_skipped)

__all__ = [
    "DatasetConfig", "FieldNames", "default_dataset_name", "detect_format", "prepare_rows",
    "prepare_rows_from_config", "read_rows",
    "MASK_THRESHOLD", "fit_to_budget", "image_bytes_hash", "load_mask", "load_rgb", "resize_mask", "resize_to",
    "to_mask", "to_rgb",
    "DEFAULT_MAX_BAD_FRACTION", "EditRow", "SkippedRow", "check_bad_fraction", "check_row", "validate_rows",
    "write_skipped",
]
