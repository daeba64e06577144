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

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from ..utils.atomic import atomic_save
from .export_targets import EXPORT_TARGETS
from .formats import load_lora_state, parse_lora_state_dict
from .state import FORMAT_NAME, FORMAT_VERSION, LoraState
from .writers import _cpu, comfyui_state_dict, diffusers_state_dict  # noqa: F401  (the writers, re-exported)

log = logging.getLogger(__name__)


def _default_module_names(state: LoraState, family: str = "qwen-image-edit") -> list[str]:
    """Module names of a family's DiT (DiffSynth's class, one block, built on the meta device), for
    resolving kohya names when no model is at hand; as many blocks as the LoRA uses."""
    import inspect

    from ..models.family import get_family

    cls = get_family(family).component_type("dit")
    # every optional module too (Qwen-Image-Edit-2511's additional timestep embedding)
    kwargs = {"use_additional_t_cond": True} if "use_additional_t_cond" in inspect.signature(cls).parameters else {}
    with torch.device("meta"):
        dit = cls(num_layers=1, **kwargs)
    names = [n for n, _ in dit.named_modules() if n]
    # block indices of kohya (transformer_blocks_3_) and dotted (transformer_blocks.3.) names alike
    blocks = [int(m.group(1)) for k in [*state.modules, *state.full]
              for m in [re.match(r"transformer_blocks[._](\d+)[._]", k)] if m]
    out = [n for n in names if not n.startswith("transformer_blocks")]
    for i in range(max(blocks, default=-1) + 1):
        out += [n.replace("transformer_blocks.0", f"transformer_blocks.{i}", 1)
                for n in names if n.startswith("transformer_blocks.0")]
    return out


def resolved(state: LoraState) -> LoraState:
    """Kohya names resolved against the DiT of the family whose module names they all match."""
    if not state.underscore_names:
        return state
    from ..models.family import FAMILIES

    errors = []
    for family in FAMILIES:
        try:
            return state.resolve(_default_module_names(state, family))
        except ValueError as e:
            errors.append(e)
    raise errors[0]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items() if v is not None}
    atomic_save(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    return path


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
