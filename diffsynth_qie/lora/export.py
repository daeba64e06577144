"""Writing LoRAs: our canonical format (:func:`save_lora`), and :func:`export_lora` for every runtime of
``export_targets`` (checked in ``export_check``, key layouts in ``writers``; rules in ``docs/LORA_RUNTIMES.md``).

What the target tools accept (checked against their sources)
-----------------------------------------------------------
- ComfyUI ``comfy/lora.py`` (Comfy-Org/ComfyUI), ``model_lora_keys_unet``: for every
  model weight ``diffusion_model.<k>.weight`` it maps ``diffusion_model.<k>`` (the
  "generic lora format") and ``lora_unet_<k with _>``; for ``comfy.model_base.QwenImage``
  additionally bare ``<k>``, ``transformer.<k>`` and ``lycoris_<k with _>``; non-weight
  keys (biases) map to themselves. ``load_lora`` reads ``<x>.alpha`` and, through
  ``comfy/weight_adapter/lora.py: LoRAAdapter.load``, ``<x>.lora_up/lora_down.weight``,
  ``<x>.lora_B/lora_A.weight`` and (newer versions) ``<x>.lora_B.default.weight``; the
  patch is ``W += strength * alpha / rank * up @ down``. Full tensors: ``<x>.set_weight``
  replaces the weight (``"set"`` patch). Our ComfyUI export therefore writes
  ``diffusion_model.<module>.lora_A.weight`` / ``lora_B.weight`` / ``.alpha`` and
  ``diffusion_model.<module>.set_weight`` / ``diffusion_model.<module>.bias.set_weight``.
- diffusers ``loaders/lora_conversion_utils.py: _convert_non_diffusers_qwen_lora_to_diffusers``
  (used by ``QwenImageLoraLoaderMixin.lora_state_dict`` when it sees ``.alpha``,
  ``lora_unet_``, ``diffusion_model.`` or ``default.`` keys): for ``lora_A``/``lora_B``
  keys it *drops* ``.alpha`` (scale 1), and the pipeline rejects any key without
  "lora" ("Invalid LoRA checkpoint"). Our diffusers export therefore writes only
  ``transformer.<module>.lora_A.weight`` / ``lora_B.weight`` with ``alpha / rank`` folded
  into ``lora_A``, and refuses full module weights unless asked to drop them.
- Users hit exactly this: DiffSynth-trained LoRAs log "lora key not loaded" in ComfyUI,
  fixed by dropping ``.default`` and prefixing ``diffusion_model.``
  (github.com/nv-tlabs/ChronoEdit issue 22).
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from .export_targets import EXPORT_TARGETS
from .export_check import write_safetensors
from .formats import load_lora_state, parse_lora_state_dict
from .resolve import resolved
from .state import FORMAT_NAME, FORMAT_VERSION, LoraState
from .writers import _cpu, comfyui_state_dict, diffusers_state_dict  # noqa: F401  (the writers, re-exported)

log = logging.getLogger(__name__)


def save_lora(path: str | os.PathLike, state_dict: Mapping[str, torch.Tensor] | LoraState,
              metadata: Mapping[str, Any] | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write a LoRA in our canonical format, atomically.

    ``state_dict`` is a LoRA in any supported key format (typically the trainable
    parameters of a PEFT-injected DiT: ``<module>.lora_A.default.weight``, plus any
    fully trained ``<module>.weight``) or a :class:`LoraState`. ``metadata`` keys
    ``rank``, ``alpha``, ``target_modules``, ``preset`` (and any others) are stored as
    JSON strings; ``alpha`` is PEFT's ``lora_alpha`` of the run and becomes each
    module's ``.alpha`` where the module has none and alpha != its rank.
    """
    state = state_dict if isinstance(state_dict, LoraState) else parse_lora_state_dict(state_dict, source=str(path))
    state = resolved(state)
    metadata = dict(metadata or {})
    run_alpha = metadata.get("alpha")
    tensors: dict[str, torch.Tensor] = {}
    for name, mod in sorted(state.modules.items()):
        alpha = mod.alpha if mod.alpha is not None else (float(run_alpha) if run_alpha is not None else None)
        tensors[f"{name}.lora_A.weight"] = _cpu(mod.A, dtype)
        tensors[f"{name}.lora_B.weight"] = _cpu(mod.B, dtype)
        if alpha is not None and not math.isclose(alpha, mod.rank):
            tensors[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    for name, tensor in sorted(state.full.items()):
        tensors[name] = _cpu(tensor, dtype)
    ranks = sorted(state.ranks)
    info = {"rank": ranks[0] if len(ranks) == 1 else (ranks or None), "target_modules": sorted(state.modules),
            "full_weights": sorted(state.full)}
    info.update(metadata)
    info.update(format=FORMAT_NAME, format_version=FORMAT_VERSION)
    return write_safetensors(Path(path), tensors, info)


EXPORT_FORMATS = tuple(EXPORT_TARGETS)  # the names of export_targets.EXPORT_TARGETS


def export_lora(in_path: str | os.PathLike, out_path: str | os.PathLike, fmt: str, **options) -> Path:
    """Convert any supported LoRA file to a runtime's key names, checked against the runtime's rules first and
    read back after (``fmt``: an ``EXPORT_TARGETS`` name; ``options``: ``drop_unsupported`` and the target's
    writer options, e.g. ``drop_full_weights`` for diffusers). See ``export_check.export_checked``."""
    from .export_check import checked_options, export_checked

    checked_options(fmt, {k: v for k, v in options.items() if k != "drop_unsupported"})
    return export_checked(load_lora_state(in_path), out_path, fmt, **options).path


def export_path(lora_path: str | os.PathLike, fmt: str) -> Path:
    """Where ``qie train --export fmt`` writes: ``lora_<fmt>.safetensors`` beside the LoRA (a folder for a
    PEFT-folder target)."""
    from .export_targets import export_target

    return Path(lora_path).with_name(f"lora_{fmt}" + ("" if export_target(fmt).folder else ".safetensors"))


def export_beside(lora_path: str | os.PathLike, formats: str, drop_unsupported: bool = False) -> list[Path]:
    """``qie train --export``: each format of ``formats`` ("comfyui,diffusers") written beside ``lora_path``
    through the same check as ``qie export-lora`` (an earlier export of the same name is replaced;
    ``drop_unsupported``: its ``--drop_unsupported``)."""
    import shutil

    from .export_check import export_checked
    from .export_targets import export_names

    state = load_lora_state(lora_path)
    written = []
    for fmt in export_names(formats):
        out = export_path(lora_path, fmt)
        if out.is_dir() and {p.name for p in out.iterdir()} <= {"adapter_model.safetensors", "adapter_config.json"}:
            shutil.rmtree(out)
        written.append(export_checked(state, out, fmt, drop_unsupported=drop_unsupported).path)
    return written
