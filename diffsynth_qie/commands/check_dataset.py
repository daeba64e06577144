"""`qie check-dataset`: flag the pairs that would spoil an edit LoRA, with a visual report (``data/check.py``)."""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
OUTPUTS = {"out": "dir", "write_clean": "file"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..data.check import CheckConfig
    from ..utils.config_cli import add_dataclass_args

    parser.add_argument("metadata", metavar="METADATA", help="metadata file (any format `qie cache` reads)")
    parser.add_argument("--out", required=True, metavar="DIR", help="where check.html and check.jsonl go")
    parser.add_argument("--dataset_base", default=None, metavar="DIR", help="directory the image paths are relative to")
    parser.add_argument("--holdout", default=None, metavar="FILE", help="held-out metadata: its targets count as duplicates")
    parser.add_argument("--auto_mask", action="store_true",
                        help="show, for rows without a mask, the mask `qie cache --auto_mask diff` would derive")
    parser.add_argument("--write_clean", default=None, metavar="JSON",
                        help="also write the metadata without the flagged rows (DiffSynth JSON)")
    add_dataclass_args(parser, CheckConfig, title="thresholds")


def default_thresholds():
    """The default :class:`~..data.check.CheckConfig` (for callers that run the check with no flags of their own)."""
    from ..data.check import CheckConfig

    return CheckConfig()


def _rows(path: str, base) -> list:
    from ..data.formats import read_rows

    return read_rows(path, base)


def _as_task(row) -> dict:
    return {"row_id": row.row_id, "target": str(row.target),
            "source": str(row.edit_images[0]) if row.edit_images else None,
            "mask": str(row.back_mask) if row.back_mask else None}


def run(args: argparse.Namespace) -> int:
    from ..data.check import CheckConfig, check_rows
    from ..data.check_report import write_outputs
    from ..utils.atomic import atomic_write_text
    from ..utils.config_cli import dataclass_from_args

    rows = _rows(args.metadata, args.dataset_base)
    holdout = _rows(args.holdout, None) if args.holdout else []
    checks, note = check_rows([_as_task(r) for r in rows], dataclass_from_args(CheckConfig, args),
                              [_as_task(r) for r in holdout])
    page = write_outputs(args.out, checks, note, str(args.metadata), derived_masks=getattr(args, "auto_mask", False))
    flagged = {c.index for c in checks if c.flags}
    log.info("%d of %d rows flagged; report: %s (one line per flagged row in %s)", len(flagged), len(rows), page,
             Path(args.out) / "check.jsonl")
    if note:
        log.info("direction check: %s", note)
    if args.write_clean:
        here = Path(args.write_clean).resolve().parent

        def rel(p):
            return os.path.relpath(Path(p).resolve(), here) if p else None

        clean = [{k: v for k, v in {"prompt": r.prompts[0], "image": rel(r.target),
                                    "edit_image": [rel(p) for p in r.edit_images] or None,
                                    "back_mask": rel(r.back_mask), "ref_gt": rel(r.ref_gt)}.items() if v is not None}
                 for i, r in enumerate(rows) if i not in flagged]
        atomic_write_text(args.write_clean, json.dumps(clean, indent=1, ensure_ascii=False) + "\n")
        log.info("wrote %s: %d clean rows", args.write_clean, len(clean))
    return 0
