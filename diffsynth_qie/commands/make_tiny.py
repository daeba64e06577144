"""`qie make-tiny`: build a locally built preset's model on disk: the tiny Qwen-Image-Edit (``tiny/build.py``) or,
with ``--model tiny-2.1``, the tiny Qwen-Image-2.1 (``tiny/qwen21.py``). The choices are the presets with a
``Preset.provider``; the provider's module says how to build (its ``MAKE_TINY``: ``replaceable``, ``complete``,
``ensure``, ``what``).

The result has the real repositories' layout, so every other command takes it via
``--model tiny --model_dir DIR``. Idempotent: an existing complete build from the
same seed is kept unless ``--force``.

``--pretrained`` builds the pretrained tiny base of ``--model`` (``tiny`` or ``tiny-2.1``) instead
(``training/pretrain_tiny.py``):
a VAE and DiT that draw flat shapes, so a LoRA visibly learns an edit on CPU. It is
installed from the weights shipped with the package when they match the recipe
(seconds), otherwise trained (a few minutes of one CPU thread); either way once.
"""
from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

from ..models.preset_flags import preset_type
from ..utils.cli_checks import INT64_MAX, checked

log = logging.getLogger(__name__)


PRETRAINED_PRESET = "tiny"  # --pretrained: the tiny Qwen-Image-Edit's pretrained base (training/pretrain_tiny.py)


def buildable() -> dict:
    """Preset name -> description, for every preset built locally (``Preset.provider``)."""
    from ..models.presets import PRESETS

    return {name: p.description for name, p in PRESETS.items() if p.provider}


def local_build(preset_name: str) -> dict:
    """The ``MAKE_TINY`` hooks of the preset's provider module."""
    import importlib

    from ..models.presets import get_preset

    module = get_preset(preset_name).provider.partition(":")[0]
    return getattr(importlib.import_module(module), "MAKE_TINY")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    models = buildable()
    parser.add_argument("--model", default=PRETRAINED_PRESET, type=preset_type(lambda p: p.provider),
                        metavar="PRESET",
                        help="which model to build: " + "; ".join(f"{n}: {d}" for n, d in models.items()))
    parser.add_argument("--out", default=None,
                        help="output directory (the model's root; created if missing). Required without "
                             "--pretrained; with it, default $QIE_HOME/models/Qwen-Image-Edit-tiny-pretrained "
                             "(Qwen-Image-2.1-tiny-pretrained with --model tiny-2.1)")
    parser.add_argument("--seed", type=checked(int, 0, INT64_MAX), default=0, help="weight seed (same seed -> byte-identical weights)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if --out already holds a complete tiny model from this seed")
    parser.add_argument("--pretrained", action="store_true",
                        help="the pretrained tiny base (trained VAE + DiT) of --model (tiny or tiny-2.1) for the "
                             "CPU demo")
    parser.add_argument("--retrain", action="store_true",
                        help="with --pretrained: train it even when the shipped weights match the recipe")
    parser.add_argument("--write_shipped", default=None, metavar="DIR",
                        help="with --pretrained: also copy the built DiT/VAE and their recipe record to DIR "
                             "(how the package's shipped copy is made)")


def run(args: argparse.Namespace) -> int:
    from ..utils.logging import library_warnings_once

    library_warnings_once()  # building the text encoder config warns about its RoPE keys (harmless)
    if args.pretrained:
        return _run_pretrained(args)
    if args.out is None:
        raise ValueError("--out is required (or pass --pretrained for the pretrained base's default directory)")
    out = Path(args.out)
    hooks = local_build(args.model)
    if _build(out, args, **hooks):
        log.info("%s written to %s (use it with: --model %s --model_dir %s)", hooks["what"], out, args.model, out)
    return 0


def _build(out: Path, args: argparse.Namespace, replaceable, complete, ensure, what: str) -> bool:
    """Build a tiny model into ``out`` unless it is already complete (``--force`` rebuilds); True if built."""
    if not replaceable(out):
        raise ValueError(f"--out {out} exists and holds files that are not part of a tiny model; "
                         "pick an empty or new directory")
    if complete(out, seed=args.seed) and not args.force:
        log.info("%s already complete in %s (seed %d); --force rebuilds it", what, out, args.seed)
        return False
    if args.force and out.exists():
        shutil.rmtree(out)  # safe: ``replaceable`` checked it holds only tiny-model files
    ensure(out, seed=args.seed)
    return True


def _run_pretrained(args: argparse.Namespace) -> int:
    from ..tiny import pretrained as tiny_pretrained
    from ..training.pretrain_tiny import ensure_pretrained_tiny

    base = tiny_pretrained.base_for(args.model)  # --pretrained: the tiny presets with a pretrained base
    out = Path(args.out) if args.out else tiny_pretrained.default_dir(base)
    if not local_build(args.model)["replaceable"](out):
        raise ValueError(f"--out {out} exists and holds files that are not part of a tiny model; "
                         "pick an empty or new directory")
    ensure_pretrained_tiny(out, seed=args.seed, rebuild=args.retrain or args.force, model=args.model)
    if args.write_shipped:
        log.info("shipped copy written to %s", tiny_pretrained.write_shipped(out, Path(args.write_shipped), base))
    log.info("pretrained tiny base in %s (use it with: --model %s --model_dir %s)", out, args.model, out)
    return 0
