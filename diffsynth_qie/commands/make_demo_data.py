"""`qie make-demo-data`: write the synthetic shapes editing dataset (see ``data/demo.py``)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..utils.cli_checks import INT64_MAX, checked

log = logging.getLogger(__name__)
# output flags: leftovers of killed runs in their directories are removed before a run (cli.main)
OUTPUTS = {"out": "tree"}  # (images/ too)
INPUTS = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--num_pairs", type=checked(int, 0), default=36, help="number of edit pairs")
    parser.add_argument("--seed", type=checked(int, 0, INT64_MAX), default=0, help="random seed (same seed -> identical files)")
    parser.add_argument("--mixed_sizes", action=argparse.BooleanOptionalAction, default=True,
                        help="mix 64-128 px sizes and aspect ratios (--no-mixed_sizes: all 64x64)")
    parser.add_argument("--format", choices=["diffsynth", "firered", "both"], default="diffsynth",
                        help="metadata.json (DiffSynth), metadata.jsonl (FireRed-style, with inverse and "
                             "text-to-image rows), or both over the same images")
    parser.add_argument("--task", choices=["mixed", "red_circle_blue"], default="mixed",
                        help="mixed edits (move, remove, recolour, swatch), or the CPU demo's one edit "
                             "'make the red circle blue' (64x64, metadata.json + held-out heldout.json)")
    parser.add_argument("--num_heldout", type=checked(int, 0), default=8, help="red_circle_blue: held-out pairs")


def run(args: argparse.Namespace) -> int:
    from ..data.demo import make_demo_data, make_demo_jsonl

    out = Path(args.out)
    if args.task == "red_circle_blue":
        from ..data.demo import make_recolour_demo

        make_recolour_demo(out, num_pairs=args.num_pairs, num_heldout=args.num_heldout, seed=args.seed)
        log.info("wrote %s (%d pairs) and %s (%d held-out pairs)", out / "metadata.json", args.num_pairs,
                 out / "heldout.json", args.num_heldout)
        return 0
    written = []
    if args.format in ("diffsynth", "both"):
        make_demo_data(out, num_pairs=args.num_pairs, seed=args.seed, mixed_sizes=args.mixed_sizes)
        written.append(out / "metadata.json")
    if args.format in ("firered", "both"):
        make_demo_jsonl(out, num_pairs=args.num_pairs, seed=args.seed, mixed_sizes=args.mixed_sizes)
        written.append(out / "metadata.jsonl")
    for p in written:
        log.info("wrote %s (%d pairs, images in %s)", p, args.num_pairs, out / "images")
    if args.format != "diffsynth":
        log.info("metadata.jsonl has text-to-image rows: read it with --t2i_mode")
    return 0
