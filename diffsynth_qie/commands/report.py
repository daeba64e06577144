"""`qie report OUTPUT_DIR`: one self-contained HTML page about a training run.

Loss (raw and smoothed), learning rate, every validation metric over steps, and the
validation strips of each validation step, images inlined; see
``diffsynth_qie/training/report.py``.
"""
from __future__ import annotations

import argparse

from ..utils.cli_checks import checked


# output flags: leftovers of killed runs in their directories are removed before a run (cli.main)
OUTPUTS = {"out": "file", "output_dir": "dir"}
INPUTS = ("output_dir",)  # (read and written: its loss.jsonl in, report.html out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="the --output_dir of a `qie train` run")
    parser.add_argument("--out", default=None,
                        help="where to write the page (default: OUTPUT_DIR/report.html; written atomically)")
    parser.add_argument("--smoothing", type=checked(float, 0, 1), default=0.9,
                        help="exponential moving average weight of the smoothed loss curve, in [0, 1)")
    parser.add_argument("--select_by", default=None, metavar="METRIC",
                        help="mark the best step (and its checkpoint) by this logged metric, e.g. val_edit_psnr, and "
                             "show the worst rows of the last validation by it")
    parser.add_argument("--worst", type=checked(int, 1, 100), default=3, help="worst rows shown with --select_by")


def run(args: argparse.Namespace) -> int:
    from ..training.report import write_report

    write_report(args.output_dir, args.out, args.smoothing, args.select_by, args.worst)  # logs "report: <path>"
    return 0
