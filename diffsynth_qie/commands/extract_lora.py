"""`qie extract-lora`: the low-rank difference between a fine-tuned DiT and its base, as a LoRA.

Per-module SVD of ``W_tuned - W_base`` truncated to ``--rank`` or to the rank that keeps
``--energy`` of the difference's squared singular values (see ``lora/extract.py``).
"""
from __future__ import annotations

import argparse
import logging

from ..utils.cli_checks import checked

log = logging.getLogger(__name__)
# output flags: leftovers of killed runs in their directories are removed before a run (cli.main)
OUTPUTS = {"out": "file"}
INPUTS = ("base", "tuned")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", required=True, metavar="DIR_OR_PRESET",
                        help="the base model (directory with transformer/, its transformer/ folder, or a preset)")
    parser.add_argument("--tuned", required=True, metavar="DIR",
                        help="the fully fine-tuned model, same layout and keys as --base")
    parser.add_argument("--out", required=True, metavar="LORA.safetensors", help="output LoRA (our format)")
    parser.add_argument("--rank", type=checked(int, 0, 1 << 16), default=None,
                        help="LoRA rank per module (with --energy: the largest rank allowed)")
    parser.add_argument("--energy", type=checked(float, 0, 1), default=None,
                        help="keep the smallest rank holding this fraction of each delta's squared "
                             "singular values (e.g. 0.9)")
    parser.add_argument("--keep_other", action="store_true",
                        help="also store changed tensors that are not 2-D weights (biases, norms) as full weights")


def run(args: argparse.Namespace) -> int:
    from ..lora.export import save_lora
    from ..lora.extract import extract_lora, extraction_metadata

    if not str(args.out).endswith(".safetensors"):
        raise ValueError(f"--out {args.out} must end in .safetensors")
    state, report = extract_lora(args.base, args.tuned, rank=args.rank, energy=args.energy,
                                 keep_other=args.keep_other)
    save_lora(args.out, state, metadata=extraction_metadata(args.base, args.tuned, args.rank, args.energy))
    log.info("wrote %s: %d module(s)", args.out, report.modules)
    return 0
