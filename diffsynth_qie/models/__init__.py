"""Models: the registries (``presets.py``, ``family.py``, ``family_ops.py``, ``preset_flags.py``) at the top,
one folder per model family (``qwen_image_edit/``, ``qwen_image_21/``: encoding, the DiT call, the family's
ops), the samplers together (``samplers/``: flow matching, LBM's bridge, schedules, Lightning), and loading
(``load/``: pipelines from a preset, hub look-ups, the DiT's weight files, host weights, devices, compile).

Importing this package stays cheap (no torch/diffsynth): ``load_pipeline`` is imported on
first access.
"""
from __future__ import annotations

import importlib

from .presets import PRESETS, Preset, get_preset

_LAZY = {
    "load_pipeline": "load.loading", "resolve_model_configs": "load.loading",
}

__all__ = ["PRESETS", "Preset", "get_preset", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
