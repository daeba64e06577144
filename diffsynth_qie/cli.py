"""`qie` command line: one subcommand per job.

Each subcommand lives in ``diffsynth_qie/commands/<name>.py`` and exposes
``add_arguments(parser)`` and ``run(args) -> int | None``. Command modules keep
heavy imports (torch, diffsynth) inside ``run`` so ``qie --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .utils.atomic import DiskFullError
from .utils.logging import setup_logging

# name -> (module under diffsynth_qie.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny": ("make_tiny", "build the tiny Qwen-Image-Edit model on disk (tests, demo)"),
    "make-demo-data": ("make_demo_data", "write a small synthetic editing dataset"),
    "make-dataset": ("make_dataset", "DiffSynth metadata (JSON/JSONL) from folders of images, checked in parallel"),
    "edit": ("edit", "edit image(s) with a prompt, optional mask, LoRA and LBM sampling"),
    "cache": ("cache", "phase 1: cache prompt embeddings and VAE latents"),
    "train": ("train", "phase 2: train a LoRA on the DiT from the cache"),
    "eval-edits": ("eval_edits", "held-out PSNR to the target, without and with LoRA(s)"),
    "export-lora": ("export_lora", "convert a LoRA to ComfyUI or diffusers key names"),
    "plan": ("plan", "predict peak GPU memory / host RAM and the cheapest options that fit a GPU"),
    "merge-lora": ("merge_lora", "merge LoRA(s) into the DiT and write it as a base model (bf16/fp8)"),
    "extract-lora": ("extract_lora", "extract a LoRA (per-module SVD) from a fully fine-tuned DiT"),
    "report": ("report", "one HTML page about a training run: loss, lr, validation metrics and strips"),
}

log = logging.getLogger("diffsynth_qie")
VERBOSE_HELP = "debug logging, including what DiffSynth and ModelScope print while loading models"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qie", description=__doc__.splitlines()[0])
    parser.add_argument("--log_level", default="INFO", help="logging level (default: INFO)")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        # also after the subcommand (`qie train ... --verbose`); SUPPRESS keeps a top-level --verbose
        p.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
        mod = importlib.import_module(f"diffsynth_qie.commands.{module}")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging("DEBUG" if args.verbose else args.log_level)
    try:
        code = args._run(args)
    except ValueError as e:  # user errors: one clear line, no traceback
        log.error("%s", e)
        return 2
    except FileNotFoundError as e:
        log.error("%s", e)
        return 2
    except DiskFullError as e:  # one line naming the full disk and what is safe
        log.error("%s", e)
        return 1
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
