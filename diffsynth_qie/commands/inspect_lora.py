"""`qie inspect-lora FILE [--json]`: family and preset, rank/alpha, modules by kind, schedule metadata, and one
row per runtime of ``lora/export_targets.py``: loads as-is / loads after `qie export-lora --format X` / cannot."""
from __future__ import annotations

import argparse
import json
import logging
import sys

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="FILE", help="LoRA file (ours, DiffSynth/PEFT, diffusers, ComfyUI or kohya)")
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")


def run(args: argparse.Namespace) -> int:
    from ..lora.inspect import describe, describe_text

    try:
        info = describe(args.path)
    except ValueError as e:
        if not args.json:
            raise
        # --json: a script reading stdout gets an object for a damaged file too
        sys.stdout.write(json.dumps({"file": str(args.path), "error": str(e)}, indent=1) + "\n")
        log.error("%s", e)
        return 2
    sys.stdout.write((json.dumps(info, indent=1) if args.json else describe_text(info)) + "\n")
    return 0
