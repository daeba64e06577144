"""`qie export-lora`: convert a LoRA (any format we read) for one runtime, checked against its rules.

The targets and their rules are the table ``diffsynth_qie/lora/export_targets.py``; the runtimes' source
files behind each rule are cited in ``docs/LORA_RUNTIMES.md``.
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
    parser.add_argument("--drop_unsupported", action="store_true",
                        help="write the modules the runtime loads and drop the rest (listed, with their share "
                             "of the LoRA's delta); without it such an export stops with that list")
    parser.add_argument("in_path", metavar="IN", help="LoRA file (ours, DiffSynth/PEFT, diffusers, ComfyUI or kohya)")
    parser.add_argument("out_path", metavar="OUT", help="output .safetensors file (written atomically); for vllm-omni "
                        "a folder name writes a PEFT adapter folder")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..lora.export import export_lora
    from ..utils.atomic import check_output_file

    if Path(args.in_path).resolve() == Path(args.out_path).resolve():
        raise ValueError(f"OUT {args.out_path} is the input LoRA itself; write the export to another file")
    check_output_file(args.out_path, "OUT")
    export_lora(args.in_path, args.out_path, args.fmt, drop_full_weights=args.drop_full_weights,
                drop_unsupported=args.drop_unsupported)
    log_schedule(args.in_path, args.fmt)
    return 0


def log_schedule(in_path: str, fmt: str) -> None:
    """Say the sampling schedule the LoRA declares (a few-step LoRA of ``qie train --loss dmd``, a Lightning
    line): our tools read it from the file's metadata, the runtimes do not, so their user sets it by hand."""
    from ..models.samplers.declared import declared_schedule

    schedule, where = declared_schedule(in_path)
    if schedule is not None:
        log.info("%s declares its sampling schedule (%s): %s. %s does not read it from the file: sample with these "
                 "steps, CFG and sigmas there", in_path, where, schedule.describe(), fmt)
