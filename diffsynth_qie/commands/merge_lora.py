"""`qie merge-lora`: merge LoRA(s) into the DiT and write it as a base model (see ``lora/merge.py``).

The output keeps the input's shard files, key names and index, so DiffSynth, diffusers
and ComfyUI load it as a base model; shards are processed one at a time.
"""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)
# output flags: leftovers of killed runs in their directories are removed before a run (cli.main)
OUTPUTS = {"out": "tree"}
INPUTS = ("base", "lora")

# Mirrors lora_merge.MERGE_DTYPES; kept here so `qie --help` does not import torch.
DTYPES = ("bf16", "fp8", "fp32", "same")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..models.preset_flags import preset_list

    parser.add_argument("base", metavar="BASE_DIR_OR_PRESET",
                        help="model directory in the repository's layout (with transformer/), its transformer/ "
                             f"folder, or a preset name ({preset_list(lambda p: not p.is_tiny, 'or')}) whose "
                             "weights are downloaded")
    parser.add_argument("--lora", action="append", required=True, metavar="FILE[:SCALE]",
                        help="LoRA to merge, any format `qie edit` reads, with an optional scale "
                             "(default 1); repeatable, applied in order")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output model directory (the DiT goes to DIR/transformer/)")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES,
                        help="output dtype: bf16; fp8 (2-D weights as float8_e4m3fn, plain cast without scale "
                             "tensors, the rest bf16); fp32; same (each tensor keeps its input dtype)")
    parser.add_argument("--no_link_components", dest="link_components", action="store_false",
                        help="do not symlink the base's text encoder, VAE, tokenizer and processor into --out")


def run(args: argparse.Namespace) -> int:
    from ..lora.merge import merge_loras, parse_lora_spec

    report = merge_loras(args.base, [parse_lora_spec(s) for s in args.lora], args.out, dtype=args.dtype,
                         link_components=args.link_components)
    log.info("merged model: %s (%d shard file(s), largest %.1f MB)", report.out_dir, len(report.files),
             report.largest_shard_bytes / 2**20)
    return 0
