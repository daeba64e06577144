"""A LoRA's alpha from its safetensors metadata, as PEFT would apply it.

diffusers (>= 0.33) keeps ``lora_alpha`` (and PEFT's ``alpha_pattern`` / ``rank_pattern``, ``use_rslora``)
only in the safetensors metadata key ``lora_adapter_metadata``; :func:`config_alpha` applies it per module.
Every alpha, from metadata or from a ``<module>.alpha`` tensor, passes :func:`checked_alpha`.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping

# diffusers (>= 0.33) stores the PEFT LoraConfig of each component as JSON under this
# safetensors metadata key: ``{"transformer.r": 4, "transformer.lora_alpha": 8,
# "transformer.alpha_pattern": {...}, ...}`` from a pipeline's ``save_lora_weights``, the
# same keys without the component prefix from a model's ``save_lora_adapter``.
ADAPTER_METADATA_KEY = "lora_adapter_metadata"


def adapter_config(metadata: Mapping[str, str], source: str = "<memory>") -> dict[str, Any] | None:
    """The DiT's PEFT ``LoraConfig`` dict from diffusers' ``lora_adapter_metadata``, or None."""
    raw = metadata.get(ADAPTER_METADATA_KEY)
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA {source}: metadata {ADAPTER_METADATA_KEY!r} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"LoRA {source}: metadata {ADAPTER_METADATA_KEY!r} is not a JSON object")
    if any("." in k for k in config):  # a pipeline's file: one prefixed config per component
        config = {k[len("transformer."):]: v for k, v in config.items() if k.startswith("transformer.")}
    return config or None


def checked_alpha(alpha: float, where: str) -> float:
    """A LoRA alpha that scales the delta sensibly: finite and positive. Zero would silently
    disable the module and a negative value invert it."""
    if not math.isfinite(alpha):
        raise ValueError(f"{where} is {alpha}; the file is damaged")
    if alpha <= 0:
        raise ValueError(f"{where} is {alpha:g}; a LoRA alpha must be positive (0 would switch the module off, a "
                         "negative value invert it). Fix or drop the alpha; to invert a LoRA give a negative strength")
    return alpha


def _number(value: Any, field: str, source: str) -> float:
    """A number from the adapter metadata, or ValueError naming the file and the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        value = repr(value)  # falls through to the error below
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"LoRA {source}: {ADAPTER_METADATA_KEY} field {field!r} is {value!r}, not a number; "
                         "fix or remove that metadata field") from None


def _pattern_value(patterns: Any, name: str, field: str, source: str) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup (``peft.utils.other.get_pattern_key``):
    a key matches a module path that it ends, as a regular expression after a dot."""
    if patterns is not None and not isinstance(patterns, Mapping):
        raise ValueError(f"LoRA {source}: {ADAPTER_METADATA_KEY} field {field!r} is not a JSON object of "
                         "module pattern -> value; fix or remove that metadata field")
    for key, value in (patterns or {}).items():
        try:
            found = re.match(rf"(.*\.)?({key})$", name)
        except re.error as e:
            raise ValueError(f"LoRA {source}: {ADAPTER_METADATA_KEY} field {field!r} holds the pattern {key!r}, "
                             f"which is not a valid regular expression ({e}); fix or remove it") from None
        if found:
            return value
    return None


def config_alpha(config: Mapping[str, Any], name: str, rank: int, source: str) -> float | None:
    """Module ``name``'s alpha from a PEFT config, in our ``alpha / rank`` convention."""
    r_field = "rank_pattern"
    r = _pattern_value(config.get("rank_pattern"), name, "rank_pattern", source)
    if not r:
        r, r_field = config.get("r"), "r"
    alpha_field = "alpha_pattern"
    alpha = _pattern_value(config.get("alpha_pattern"), name, "alpha_pattern", source)
    if alpha is None:
        alpha, alpha_field = config.get("lora_alpha"), "lora_alpha"
    if alpha is None:
        return None
    if r is not None and _number(r, r_field, source) != rank:
        raise ValueError(f"LoRA {source}: {ADAPTER_METADATA_KEY} gives rank {r} for {name}, but its "
                         f"tensors have rank {rank}; the metadata does not describe this file")
    alpha = checked_alpha(_number(alpha, alpha_field, source),
                           f"LoRA {source}: {ADAPTER_METADATA_KEY} field {alpha_field!r} for {name}")
    if config.get("use_rslora"):  # PEFT scales rsLoRA by alpha / sqrt(r)
        alpha *= math.sqrt(rank)
    return alpha
