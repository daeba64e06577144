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
from .utils.cli_checks import check_numbers
from .utils.logging import setup_logging
from .utils.user_errors import os_error_line

# name -> (module under diffsynth_qie.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny": ("make_tiny", "build the tiny Qwen-Image-Edit model on disk (tests, demo)"),
    "make-demo-data": ("make_demo_data", "write a small synthetic editing dataset"),
    "check-dataset": ("check_dataset", "flag misaligned, identical, duplicate, reversed or badly masked pairs, "
                                       "with a visual report"),
    "make-dataset": ("make_dataset", "DiffSynth metadata (JSON/JSONL) from folders of images, checked in parallel"),
    "edit": ("edit", "edit image(s) with a prompt, optional mask, LoRA and LBM sampling"),
    "cache": ("cache", "phase 1: cache prompt embeddings and VAE latents"),
    "train": ("train", "phase 2: train a LoRA on the DiT from the cache"),
    "eval-edits": ("eval_edits", "held-out PSNR to the target, without and with LoRA(s)"),
    "export-lora": ("export_lora", "convert a LoRA for ComfyUI, diffusers, musubi, SGLang, vLLM-Omni or Nunchaku, checked"),
    "inspect-lora": ("inspect_lora", "what a LoRA holds, and where it loads as-is, after qie export-lora, or not"),
    "plan": ("plan", "predict peak GPU memory / host RAM and the cheapest options that fit a GPU"),
    "merge-lora": ("merge_lora", "merge LoRA(s) into the DiT and write it as a base model (bf16/fp8)"),
    "extract-lora": ("extract_lora", "extract a LoRA (per-module SVD) from a fully fine-tuned DiT"),
    "report": ("report", "one HTML page about a training run: loss, lr, validation metrics and strips"),
}

log = logging.getLogger("diffsynth_qie")
INTERRUPTED = "every file written so far is complete (writes are whole or not at all); run the command again"
VERBOSE_HELP = "debug logging, including what DiffSynth and ModelScope print while loading models"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qie", description=__doc__.splitlines()[0])
    parser.add_argument("--log_level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), help="logging level (default: INFO)")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        # also after the subcommand (`qie train ... --verbose`); SUPPRESS keeps a top-level --verbose
        p.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
        mod = importlib.import_module(f"diffsynth_qie.commands.{module}")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _interrupted=getattr(mod, "interrupted", None),
                       _outputs=getattr(mod, "OUTPUTS", {}), _inputs=getattr(mod, "INPUTS", ()),
                       _writes=getattr(mod, "WRITES", {}), _names=flag_names(p))
    return check_numbers(parser)  # finite numbers within declared bounds, for every command


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each destination as the user spells it: its flag, or a positional's metavar."""
    return {a.dest: a.option_strings[-1] if a.option_strings else str(a.metavar or a.dest.upper())
            for a in parser._actions}


def refuse_overwriting_inputs(args: argparse.Namespace) -> None:
    """No output path of the command (``OUTPUTS``, ``WRITES``) may be one of its inputs (``INPUTS``)."""
    from .utils.paths import refuse_inputs_as_outputs

    refuse_inputs_as_outputs(args, getattr(args, "_inputs", ()), getattr(args, "_outputs", {}),
                             getattr(args, "_writes", {}), getattr(args, "_names", {}))


def remove_leftovers_of(args: argparse.Namespace) -> None:
    """Before a command writes: the leftovers of its killed runs in the directories it writes into (its
    ``OUTPUTS`` flags: a file's directory, a directory, or a directory and its subdirectories)."""
    from pathlib import Path

    from .utils.atomic import clean_leftovers

    for dest, kind in getattr(args, "_outputs", {}).items():
        value = getattr(args, dest, None)
        if not value:
            continue
        top = Path(value).parent if kind == "file" else Path(value)
        dirs = [top] + ([d for d in top.iterdir() if d.is_dir()] if kind == "tree" and top.is_dir() else [])
        for directory in dirs:
            clean_leftovers(directory)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging("DEBUG" if args.verbose else args.log_level)
    try:
        refuse_overwriting_inputs(args)
        remove_leftovers_of(args)
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
    except KeyboardInterrupt:  # Ctrl-C: what is safe, and exit 130 as a shell expects
        hint = getattr(args, "_interrupted", None)
        log.error("interrupted: %s", hint(args) if hint else INTERRUPTED)
        return 130
    except OSError as e:  # permissions, read-only mounts, bad paths: one line; anything else is a bug
        line = os_error_line(e)
        if line is None:
            raise
        log.error("%s", line)
        return 1
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
