"""Writing LoRAs: our canonical format, and exports for ComfyUI and diffusers.

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
from .adapter_metadata import ADAPTER_METADATA_KEY
from .export_targets import EXPORT_TARGETS, export_target
from .formats import load_lora_state, parse_lora_state_dict
from .state import FORMAT_NAME, FORMAT_VERSION, LoraState, listing

log = logging.getLogger(__name__)

EXPORT_FORMATS = tuple(EXPORT_TARGETS)  # the names of export_targets.EXPORT_TARGETS


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
    blocks = [int(m.group(1)) for k in state.modules for m in [re.match(r"transformer_blocks_(\d+)_", k)] if m]
    out = [n for n in names if not n.startswith("transformer_blocks")]
    for i in range(max(blocks, default=-1) + 1):
        out += [n.replace("transformer_blocks.0", f"transformer_blocks.{i}", 1)
                for n in names if n.startswith("transformer_blocks.0")]
    return out


def _resolved(state: LoraState) -> LoraState:
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


def _warn_unknown_modules(state: LoraState) -> None:
    """Say so when a LoRA names modules that neither family's DiT has (another model's LoRA, or a damaged file):
    the export still writes them, and no Qwen DiT would load them."""
    from ..models.family import FAMILIES

    known = set().union(*(_default_module_names(state, family) for family in FAMILIES))
    names = set(state.modules) | {n.rsplit(".", 1)[0] for n in state.full}  # (full weights: "<module>.weight")
    unknown = sorted(names - known)
    if unknown:
        log.warning("LoRA %s names %d module(s) that no Qwen-Image DiT has (another model's LoRA?): %s", state.source,
                    len(unknown), listing(unknown))


def _cpu(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=dtype or t.dtype).contiguous().clone()


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Path:
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
    state = _resolved(state)
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
    return _write(Path(path), tensors, info)


def comfyui_state_dict(state: LoraState) -> dict[str, torch.Tensor]:
    """ComfyUI keys: ``diffusion_model.<module>.lora_A/lora_B.weight``, ``.alpha``, ``.set_weight``."""
    state = _resolved(state)
    out: dict[str, torch.Tensor] = {}
    for name, mod in sorted(state.modules.items()):
        out[f"diffusion_model.{name}.lora_A.weight"] = _cpu(mod.A)
        out[f"diffusion_model.{name}.lora_B.weight"] = _cpu(mod.B)
        if mod.alpha is not None:
            out[f"diffusion_model.{name}.alpha"] = torch.tensor(float(mod.alpha), dtype=torch.float32)
    for name, tensor in sorted(state.full.items()):
        target = name[: -len(".weight")] if name.endswith(".weight") else name
        out[f"diffusion_model.{target}.set_weight"] = _cpu(tensor)
    return out


def diffusers_state_dict(state: LoraState, drop_full_weights: bool = False) -> dict[str, torch.Tensor]:
    """diffusers keys: ``transformer.<module>.lora_A/lora_B.weight``, alpha folded into ``lora_A``."""
    state = _resolved(state)
    if state.full and not drop_full_weights:
        raise ValueError(f"LoRA {state.source} holds full module weights ({listing(list(state.full))}) that "
                         "diffusers' LoRA loader cannot load; export with --format comfyui, or pass "
                         "--drop_full_weights to export only the LoRA part")
    if state.full:
        log.warning("dropping %d full module weight(s) for the diffusers export: %s",
                    len(state.full), listing(list(state.full)))
    out: dict[str, torch.Tensor] = {}
    for name, mod in sorted(state.modules.items()):
        a = mod.A if mod.alpha is None else (mod.A.float() * mod.scale).to(mod.A.dtype)
        out[f"transformer.{name}.lora_A.weight"] = _cpu(a)
        out[f"transformer.{name}.lora_B.weight"] = _cpu(mod.B)
    return out


# metadata keys that state a LoRA's rank or alpha (ours, kohya's, PEFT-style): not copied into an export
SCALE_KEYS = frozenset({"alpha", "rank", "lora_alpha", "lora_rank", "network_alpha", "network_dim",
                        "ss_network_alpha", "ss_network_dim"})


def export_lora(in_path: str | os.PathLike, out_path: str | os.PathLike, fmt: str, **options) -> Path:
    """Convert any supported LoRA file to a runtime's key names (``fmt``: an ``EXPORT_TARGETS`` name;
    ``options``: that target's writer options, e.g. ``drop_full_weights`` for diffusers)."""
    target = export_target(fmt)
    unknown = sorted(k for k, v in options.items() if v and k not in target.options)
    if unknown:
        takes = [t.name for t in EXPORT_TARGETS.values() if unknown[0] in t.options]
        raise ValueError(f"--{unknown[0]} does not apply to --format {fmt}; it applies to --format "
                         f"{' / '.join(takes) or '(none)'}")
    options = {k: v for k, v in options.items() if k in target.options}
    state = load_lora_state(in_path)
    _warn_unknown_modules(_resolved(state))
    tensors = target.write_fn()(state, **options)
    # alpha is written as .alpha tensors or folded into lora_A; a copied lora_adapter_metadata, or plain
    # alpha/rank keys of the source, would make a tool apply it a second time.
    metadata = {k: v for k, v in state.metadata.items()
                if k not in ("format", "format_version", ADAPTER_METADATA_KEY) and k.lower() not in SCALE_KEYS}
    metadata.update(format=fmt, converted_by=FORMAT_NAME, source_format=state.format)
    ranks = sorted({m.rank for m in state.modules.values()})
    if target.alpha_folded and len(ranks) == 1:  # folded: the file's own scale alpha / rank is 1
        metadata.update(rank=str(ranks[0]), alpha=str(ranks[0]), alpha_folded_into_lora_A="true")
    out = _write(Path(out_path), tensors, metadata)
    log.info("wrote %s LoRA %s (%d tensors, from %s format)", fmt, out, len(tensors), state.format)
    return out
