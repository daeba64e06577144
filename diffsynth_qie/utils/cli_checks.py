"""Number flags checked once, where the command line meets the code: finite values within declared bounds.

:func:`check_numbers` walks a parser (and its subcommands) after the flags are declared and wraps the
``type`` of every ``float`` flag (a finite number: ``nan``/``inf`` are refused) and of every flag named in
:data:`BOUNDS` (its range). A bad value is then argparse's own one-line usage error naming the flag
(exit 2), in every command and in ``app_gradio.py``, before anything loads. Dataclass fields declare their
range with ``cli_help(..., min=..., max=...)`` (``utils/config_cli.py``) and get the same check.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Optional

INT64_MAX = 2 ** 63 - 1
# flag -> (lowest, highest) accepted; None = unbounded on that side
BOUNDS: dict[str, tuple[Optional[float], Optional[float]]] = {
    "seed": (0, INT64_MAX),
    "gpu_memory_gb": (0.5, 1 << 20),
    "prompt_tokens": (1, 1 << 20), "max_prompt_tokens": (1, 1 << 20),
    "resolution": (16, 1 << 16), "height": (16, 1 << 16), "width": (16, 1 << 16), "max_pixels": (256, 1 << 32),
    "batch_size": (1, 1 << 16), "num_gpus": (1, 1 << 16), "lora_rank": (0, 1 << 16), "rank": (0, 1 << 16),
    "ref_images": (0, 64), "blocks_to_swap": (0, 1 << 10), "verify_blocks": (0, 1 << 10),
    "steps": (1, 10000), "edit_steps": (1, 10000), "lbm_steps": (1, 4), "validation_steps": (1, 10000),
    "row": (0, None), "limit": (0, None), "num_heldout": (0, None), "num_pairs": (0, None), "workers": (0, 1024),
    "num_workers": (0, 1024),
    "cfg": (0, 100), "validation_cfg_scale": (0, 100), "lora_scale": (-100, 100),
    "mask_blend": (0, 1), "strength": (0, 1), "mask_feather": (0, 4096), "lbm_noise": (0, 10), "cfg_dropout": (0, 1),
    "smoothing": (0, 1), "energy": (0, 1), "min_lr_ratio": (0, 1),
    "gradient_accumulation_steps": (1, 1 << 16), "max_steps": (0, None), "num_epochs": (1, None),
    "save_every": (0, None), "keep_last": (0, None), "validate_every": (0, None), "num_validation": (0, None),
    "log_every": (1, None), "warmup_steps": (0, None), "max_grad_norm": (0, None), "weight_decay": (0, None),
    "learning_rate": (0, None), "lora_alpha": (0, None),
}


def checked(kind: Callable, lo: Optional[float] = None, hi: Optional[float] = None) -> Callable:
    """An argparse ``type``: ``kind(text)``, finite, and within ``[lo, hi]``."""
    def parse(text: str):
        value = kind(text)
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            span = f"from {lo} to {hi}" if lo is not None and hi is not None else \
                (f"at least {lo}" if lo is not None else f"at most {hi}")
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a value {span}")
        return value

    parse.__name__ = getattr(kind, "__name__", "number")
    parse.qie_checked = True
    return parse


def check_numbers(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Wrap the ``type`` of every number flag of ``parser`` and its subcommands (see the module docstring)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                check_numbers(sub)
            continue
        kind = action.type
        if kind not in (int, float) or getattr(kind, "qie_checked", False):
            continue
        lo, hi = BOUNDS.get(action.dest, (None, None))
        if kind is float or lo is not None or hi is not None:
            action.type = checked(kind, lo, hi)
    return parser
