"""LoRA files: read every common key format, merge into the DiT, switch, save, export.


Why this module exists: users' most common complaint about trainers is that a LoRA
from one tool does not load in another, and that a mismatching LoRA is silently
ignored. Here every format is normalised to one canonical form, every key is either
used or reported, and a LoRA that does not fit the model raises ``ValueError``.


The work is split by job: ``state`` (the in-memory form), ``formats`` (reading every
format), ``apply`` (checking and merging), ``branch`` (unmerged adapter branches),
``manager`` (switching on a loaded model), ``export`` (writing), ``merge`` (into the DiT
files, shard by shard) and ``extract`` (SVD of a fine-tune). This package gathers their
public names, imported on first access so that importing one submodule stays cheap.

Canonical format (what :func:`save_lora` writes, "diffsynth_qie")
------------------------------------------------------------------
Exactly what DiffSynth's ``pipe.load_lora(pipe.dit, path, alpha=...)`` loads:

- ``<module>.lora_A.weight`` ``[rank, in]`` and ``<module>.lora_B.weight`` ``[out, rank]``,
  ``<module>`` being the DiT's own module path (``transformer_blocks.0.attn.to_q``,
  ``transformer_blocks.0.attn.to_out.0``, ``transformer_blocks.0.img_mlp.net.0.proj``,
  ``transformer_blocks.0.img_mod.1``, ``img_in``, ``proj_out`` ...). DiffSynth's
  ``QwenImageDiT`` has no state-dict converter, so these are also the diffusers and
  ComfyUI module names of Qwen-Image.
- optional ``<module>.alpha`` (0-dim float32): the delta is ``alpha / rank * B @ A``;
  without it ``B @ A``. Written only when alpha != rank (PEFT's ``lora_alpha`` differs
  from ``r``), so LoRAs trained with DiffSynth's default (alpha = rank) have none.
- optional full module weights under their parameter names (``img_in.weight``,
  ``img_in.bias``) for modules trained fully rather than with LoRA.
- safetensors metadata: ``format``, ``format_version``, ``rank``, ``alpha``,
  ``target_modules``, ``preset`` and whatever the trainer adds (JSON strings).


DiffSynth's convention, as read in diffsynth 2.1.12
---------------------------------------------------
- Training (``diffusion/training_module.py``): ``add_lora_to_model`` calls PEFT's
  ``inject_adapter_in_model(LoraConfig(r, lora_alpha=r if None, target_modules))``;
  ``ModelLogger.save_model`` (``diffusion/logger.py``) keeps the trainable parameters
  (``export_trainable_state_dict``), strips ``remove_prefix_in_ckpt`` and saves keys
  ``<module>.lora_A.default.weight`` / ``lora_B.default.weight``, no alpha.
- Loading (``pipe.load_lora`` -> ``utils/lora/general.py: GeneralLoRALoader``): keys
  containing ``lora_B`` (or ``lora_up``) name a module; one extra component after
  ``lora_B`` (PEFT's adapter name) is dropped, a leading ``diffusion_model.`` is
  dropped, ``<module>.alpha`` multiplies ``lora_A`` by ``alpha / rank``; the LoRA is
  fused as ``W += alpha_arg * B @ A``. Modules absent from the model and non-LoRA
  keys are silently skipped, and ``transformer.`` / ``base_model.model.`` prefixes
  are *not* stripped -- hence this module.

"""
from __future__ import annotations

import importlib

_LAZY = {
    **dict.fromkeys(["MAX_DELTA_RATIO", "LoadReport", "apply_lora", "match_lora", "peft_state_dict"], "apply"),
    **dict.fromkeys(["EXPORT_FORMATS", "comfyui_state_dict", "diffusers_state_dict", "export_lora",
                     "save_lora"], "export"),
    **dict.fromkeys(["ADAPTER_METADATA_KEY", "adapter_config"], "adapter_metadata"),
    **dict.fromkeys(["MAX_ABS_VALUE", "check_tensors", "load_lora_state", "parse_lora_state_dict"], "formats"),
    "LoraManager": "manager",
    **dict.fromkeys(["FORMAT_NAME", "FORMAT_VERSION", "LoraModule", "LoraState"], "state"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
