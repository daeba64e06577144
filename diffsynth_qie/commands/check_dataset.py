"""`qie check-dataset`: flag the pairs that would spoil an edit LoRA, with a visual report (``data/check.py``)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)
OUTPUTS = {"out": "dir", "write_clean": "file"}
INPUTS = ("metadata", "holdout")
WRITES = {"out": ("check.jsonl", "check.html", "dropped.jsonl")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..data.check import CheckConfig
    from ..data.check_report import MAX_CARDS
    from ..utils.cli_checks import checked
    from ..utils.config_cli import add_dataclass_args

    parser.add_argument("metadata", metavar="METADATA", help="metadata file (any format `qie cache` reads)")
    parser.add_argument("--out", required=True, metavar="DIR", help="where check.html and check.jsonl go")
    parser.add_argument("--dataset_base", default=None, metavar="DIR", help="directory the image paths are relative to")
    parser.add_argument("--holdout", default=None, metavar="FILE", help="held-out metadata: its targets count as duplicates")
    parser.add_argument("--auto_mask", action="store_true",
                        help="show, for rows without a mask, the mask `qie cache --auto_mask diff` would derive")
    parser.add_argument("--write_clean", default=None, metavar="FILE",
                        help="also write the metadata without the rows flagged at --drop's severities and the rows "
                             "the reader skipped: "
                             "the original records, paths made relative to FILE's folder, in FILE's format "
                             "(.jsonl, .csv, else JSON); the rows left out are listed in --out's dropped.jsonl")
    parser.add_argument("--drop", choices=("error", "warning", "hint"), default="error",
                        help="--write_clean leaves out rows with a flag of this severity or worse (default: errors only)")
    parser.add_argument("--vl_check", default=None, metavar="DIR",
                        help="also score each edit against its instruction with the Qwen2.5-VL weights in DIR (the "
                             "model's text encoder folder; off by default, needs a GPU for any real dataset)")
    parser.add_argument("--report_rows", type=checked(int, 0, 100000), default=MAX_CARDS, metavar="N",
                        help="check.html shows the first N flagged rows (all of them are in check.jsonl)")
    add_dataclass_args(parser, CheckConfig, title="thresholds")


def default_thresholds():
    """The default :class:`~..data.check.CheckConfig` (for callers that run the check with no flags of their own)."""
    from ..data.check import CheckConfig

    return CheckConfig()


def _rows(path: str, base, skipped: Optional[list] = None) -> list:
    """The rows to check; a preference row whose rejected image is its target again is refused as the cache
    refuses it (one line each, and listed with the reader's skipped rows)."""
    from ..data.formats import read_rows
    from ..data.rows import identical_pair, log_skip

    rows, out = read_rows(path, base, skipped=skipped), []
    for row in rows:
        try:
            bad = identical_pair(row)
        except (ValueError, OSError):  # a missing or unreadable image: the check's own measurements report it
            bad = None
        if bad is None:
            out.append(row)
        else:
            log_skip(bad)
            if skipped is not None:
                skipped.append(bad)
    return out


def _as_task(row) -> dict:
    return {"row_id": row.row_id, "target": str(row.target),
            "source": str(row.edit_images[0]) if row.edit_images else None,
            "mask": str(row.back_mask) if row.back_mask else None, "prompt": row.prompts[0] if row.prompts else None}


def run(args: argparse.Namespace) -> int:
    from ..data.check import CheckConfig, check_rows
    from ..data.check_report import MAX_CARDS, write_outputs
    from ..utils.config_cli import dataclass_from_args

    skipped: list = []
    rows = _rows(args.metadata, args.dataset_base, skipped)
    holdout = _rows(args.holdout, None) if args.holdout else []
    judge = None
    if getattr(args, "vl_check", None):
        from ..data.check_vl import VLJudge

        judge = VLJudge.load(args.vl_check)  # (refuses a folder without weights before any row is measured)
    checks, note = check_rows([_as_task(r) for r in rows], dataclass_from_args(CheckConfig, args),
                              [_as_task(r) for r in holdout])
    if judge is not None:
        judge.flag_rows(checks)
    page = write_outputs(args.out, checks, note, str(args.metadata), derived_masks=getattr(args, "auto_mask", False),
                         max_cards=getattr(args, "report_rows", MAX_CARDS))
    from ..data.check_report import summary_line
    from ..data.check_rules import SEVERITIES, severity

    worst = SEVERITIES[:SEVERITIES.index(getattr(args, "drop", "error")) + 1]
    flagged = {c.row_id: [f for f in c.flags if severity(f) in worst] for c in checks}
    flagged = {k: v for k, v in flagged.items() if v}
    log.info("%s; report: %s (one line per flagged row in %s)", summary_line(checks), page,
             Path(args.out) / "check.jsonl")
    if skipped:
        log.info("%d row(s) the reader skipped (not checked): %s", len(skipped),
                 "; ".join(f"{s.row_id}: {s.reason}" for s in skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    if note:
        log.info("direction check: %s", note)
    if getattr(args, "write_clean", None):
        _write_clean(args, flagged, {s.row_id: f"{s.field}: {s.reason}" for s in skipped})
    return 0


def _write_clean(args: argparse.Namespace, flagged: dict, skipped: dict) -> None:
    """The original records without the flagged and skipped ones; the dropped ones listed in dropped.jsonl."""
    from ..data.check_report import json_line
    from ..data.clean import write_clean
    from ..utils.atomic import atomic_write_text

    kept, dropped = write_clean(args.metadata, args.write_clean, flagged, skipped, base=args.dataset_base)
    listing = Path(args.out) / "dropped.jsonl"
    atomic_write_text(listing, "".join(json_line(d) for d in dropped))
    log.info("wrote %s: %d of %d records kept, %d left out (each with why in %s)", args.write_clean, kept,
             kept + len(dropped), len(dropped), listing)
    for d in dropped[:10]:
        log.info("  left out record %d (%s): %s", d["record"], d["row_id"], d["why"])
    if len(dropped) > 10:
        log.info("  ... and %d more in %s", len(dropped) - 10, listing)
