"""`qie export-lora`: convert a LoRA (any format we read) to ComfyUI or diffusers key names.

The key names and alpha handling of each target are documented, with the sources
they were checked against, in ``diffsynth_qie/lora/export.py``.
"""
from __future__ import annotations

import argparse
import logging

from ..lora.export_targets import EXPORT_TARGETS

log = logging.getLogger(__name__)
# output flags: leftovers of killed runs in their directories are removed before a run (cli.main)
OUTPUTS = {"out_path": "file"}
INPUTS = ("in_path",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", required=True, choices=tuple(EXPORT_TARGETS), dest="fmt",
                        help="; ".join(f"{t.name}: {t.help}" for t in EXPORT_TARGETS.values()))
    parser.add_argument("--drop_full_weights", action="store_true",
                        help="diffusers only: export just the LoRA part when the file also holds fully "
                             "trained module weights (diffusers cannot load those)")
    parser.add_argument("in_path", metavar="IN", help="LoRA file (ours, DiffSynth/PEFT, diffusers, ComfyUI or kohya)")
    parser.add_argument("out_path", metavar="OUT", help="output .safetensors file (written atomically)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..lora.export import export_lora
    from ..utils.atomic import check_output_file

    if Path(args.in_path).resolve() == Path(args.out_path).resolve():
        raise ValueError(f"OUT {args.out_path} is the input LoRA itself; write the export to another file")
    check_output_file(args.out_path, "OUT")
    export_lora(args.in_path, args.out_path, args.fmt, drop_full_weights=args.drop_full_weights)
    return 0
