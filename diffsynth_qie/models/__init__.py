"""Models: presets (which weights, which flags), pipeline loading, the batched DiT forward,
encoding, and the samplers' pure math.

Importing this package stays cheap (no torch/diffsynth): ``load_pipeline`` is imported on
first access.
"""
from __future__ import annotations

import importlib

from .presets import PRESETS, Preset, get_preset

_LAZY = {
    "load_pipeline": "loading", "resolve_model_configs": "loading",
}

__all__ = ["PRESETS", "Preset", "get_preset", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
