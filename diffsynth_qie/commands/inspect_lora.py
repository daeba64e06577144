"""`qie inspect-lora FILE [--json]`: family and preset, rank/alpha, modules by kind, schedule metadata, and one
row per runtime of ``lora/export_targets.py``: loads as-is / loads after `qie export-lora --format X` / cannot."""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="FILE", help="LoRA file (ours, DiffSynth/PEFT, diffusers, ComfyUI or kohya)")
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")


def run(args: argparse.Namespace) -> int:
    from ..lora.inspect import describe, describe_text

    info = describe(args.path)
    sys.stdout.write((json.dumps(info, indent=1) if args.json else describe_text(info)) + "\n")
    return 0
