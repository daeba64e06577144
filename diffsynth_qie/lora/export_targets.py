"""The runtimes ``qie export-lora --format`` writes for, as data: one :class:`ExportTarget` per format.

Torch-free, so ``qie export-lora``'s choices and help come from this table without importing the writers.
A target names its writer (``"module:function"``, a function ``(LoraState, **options) -> {key: tensor}``),
the options it takes, and whether its file folds alpha into ``lora_A`` (a scale of 1). Adding a format: its
writer function (``lora/export.py`` or a module of its own) and one entry here.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ExportTarget:
    name: str
    help: str  # what its file holds, for --help
    writer: str  # "module:function": (LoraState, **options) -> dict of tensors
    options: tuple[str, ...] = ()  # keyword options of the writer (each a `qie export-lora` flag)
    alpha_folded: bool = False  # alpha / rank multiplied into lora_A: the file's own scale is 1

    def write_fn(self) -> Callable:
        module, _, name = self.writer.partition(":")
        return getattr(importlib.import_module(module), name)


EXPORT_TARGETS: dict[str, ExportTarget] = {t.name: t for t in (
    ExportTarget("comfyui", "diffusion_model.<module>.lora_A/lora_B.weight + .alpha (+ .set_weight for full "
                 "module weights)", "diffsynth_qie.lora.export:comfyui_state_dict"),
    ExportTarget("diffusers", "transformer.<module>.lora_A/lora_B.weight with alpha folded in",
                 "diffsynth_qie.lora.export:diffusers_state_dict", options=("drop_full_weights",),
                 alpha_folded=True),
)}


def export_target(name: str) -> ExportTarget:
    if name not in EXPORT_TARGETS:
        raise ValueError(f"unknown export format {name!r}; choose one of {', '.join(EXPORT_TARGETS)}")
    return EXPORT_TARGETS[name]
