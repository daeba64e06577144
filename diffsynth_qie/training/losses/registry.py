"""The loss registry: ``--loss NAME`` -> loss function (see ``sft.py`` for the signature).

Its own module so that the losses never import each other: ``sft.py`` (``"sft"``) and
``lbm.py`` (``"lbm"``) both build on ``common.py``, and only this module knows both.
"""
from __future__ import annotations

from typing import Callable

import torch

from .lbm import lbm_loss
from .sft import flow_match_sft_loss

LossFn = Callable[..., tuple[torch.Tensor, dict[str, "float | torch.Tensor"]]]

LOSSES: dict[str, LossFn] = {"sft": flow_match_sft_loss, "lbm": lbm_loss}


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"--loss {name!r} is not available in this build (available: {', '.join(sorted(LOSSES))})")
    return LOSSES[name]
