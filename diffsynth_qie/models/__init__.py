"""Models: presets (which weights, which flags), the tiny model, pipeline loading.

Importing this package stays cheap (no torch/diffsynth): ``load_pipeline``,
``build_tiny`` and friends are imported on first access.
"""
from __future__ import annotations

import importlib

from .presets import PRESETS, Preset, get_preset

_LAZY = {
    "load_pipeline": "loading", "resolve_model_configs": "loading",
    "build_tiny": "tiny", "ensure_tiny": "tiny", "register_tiny_model_configs": "tiny",
}

__all__ = ["PRESETS", "Preset", "get_preset", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
