"""`qie make-tiny`: build the tiny Qwen-Image-Edit on disk (see ``models/tiny.py``).

The result has the real repositories' layout, so every other command takes it via
``--model tiny --model_dir DIR``. Idempotent: an existing complete build from the
same seed is kept unless ``--force``.
"""
from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory (the model's root; created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed -> byte-identical weights)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if --out already holds a complete tiny model from this seed")


def run(args: argparse.Namespace) -> int:
    from ..models.tiny import ensure_tiny, is_complete, looks_like_tiny_dir

    out = Path(args.out)
    if not looks_like_tiny_dir(out):
        raise ValueError(f"--out {out} exists and holds files that are not part of a tiny model; "
                         "pick an empty or new directory")
    if is_complete(out, seed=args.seed) and not args.force:
        log.info("tiny model already complete in %s (seed %d); --force rebuilds it", out, args.seed)
        return 0
    if args.force and out.exists():
        shutil.rmtree(out)  # safe: looks_like_tiny_dir checked it holds only tiny-model files
    ensure_tiny(out, seed=args.seed)
    log.info("tiny Qwen-Image-Edit written to %s (use it with: --model tiny --model_dir %s)", out, out)
    return 0
