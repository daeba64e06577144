"""The serving runtimes' LoRA loaders, transcribed: their own module names and key rules, as test fixtures.

ComfyUI, SGLang, vLLM-Omni, musubi-tuner and Nunchaku need GPU kernels or are not on the package index, so the
small key-handling part of each loader is written down here from its source (cited per function), independently
of the package's rules, and returns the weight deltas the runtime would apply, keyed by the runtime's own weight
names. A loader that refuses the whole file raises :class:`Refused`. diffusers is installed and run for real
(``test_diffusers_roundtrip.py``).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

_A = (".lora_A.weight", ".lora_down.weight")
_B = (".lora_B.weight", ".lora_up.weight")


class Refused(Exception):
    """The runtime refuses the whole file."""


def _under(name: str) -> str:
    return name.replace(".", "_")


# --- ComfyUI ------------------------------------------------------------------------------------------------------
def comfyui_weights(linears: set[str], fused: bool) -> dict[str, bool]:
    """ComfyUI's Qwen-Image weight names (diffusers' names) -> whether fused; a fused 2.1 checkpoint holds
    ``img_mlp.gate_up`` = [gate_layer; proj] (comfy/ldm/qwen_image21/model.py)."""
    out = {n: False for n in linears}
    if fused:
        for n in [n for n in linears if n.endswith("img_mlp.gate_layer")]:
            del out[n], out[n.replace("gate_layer", "proj")]
            out[n.replace("gate_layer", "gate_up")] = True
    return out


def comfyui_load(tensors: dict[str, torch.Tensor], weights: dict[str, bool], half_rows: int = 0,
                 ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """comfy/lora.py (Comfy-Org/ComfyUI): ``model_lora_keys_unet`` maps each weight ``diffusion_model.<k>.weight``
    as ``lora_unet_<k_>`` and ``diffusion_model.<k>``, and for QwenImage as ``<k>``, ``transformer.<k>``,
    ``lycoris_<k_>``; a fused ``gate_up`` maps its halves (row offsets) only in those three forms. ``load_lora``
    reads ``<x>.alpha`` (scale ``alpha / rank``, else 1) and ``<x>.lora_up/lora_B(.default).weight`` /
    ``lora_down/lora_A``; ``.set_weight`` replaces a weight. Keys left over: "lora key not loaded"."""
    key_map: dict[str, tuple[str, tuple[int, int] | None]] = {}
    for k, fused in weights.items():
        targets = [(k, None)]
        if fused:
            targets = [(k.replace("gate_up", "gate_layer"), (0, half_rows)), (k.replace("gate_up", "proj"),
                                                                               (half_rows, half_rows))]
        key_map[f"lora_unet_{_under(k)}"] = (k, None)
        key_map[f"diffusion_model.{k}"] = (k, None)
        for name, rows in targets:
            for form in (name, f"transformer.{name}", f"lycoris_{_under(name)}"):
                key_map[form] = (k, rows)
    deltas: dict[str, torch.Tensor] = {}
    loaded = set()
    for x, (weight, rows) in key_map.items():
        up = next((f"{x}{s}" for s in (".lora_up.weight", ".lora_B.weight", ".lora_B.default.weight") if f"{x}{s}" in tensors), None)
        down = next((f"{x}{s}" for s in (".lora_down.weight", ".lora_A.weight", ".lora_A.default.weight") if f"{x}{s}" in tensors), None)
        if up is None or down is None:
            continue
        alpha = tensors.get(f"{x}.alpha")
        scale = 1.0 if alpha is None else float(alpha) / tensors[down].shape[0]
        delta = scale * tensors[up].double() @ tensors[down].double()
        if rows is not None:
            full = deltas.get(weight, torch.zeros(2 * half_rows, delta.shape[1], dtype=torch.float64))
            full[rows[0]:rows[0] + rows[1]] += delta
            delta = full
        deltas[weight] = delta
        loaded |= {up, down, f"{x}.alpha"}
    for k in tensors:
        if k.endswith(".set_weight") and k[: -len(".set_weight")].removeprefix("diffusion_model.") in weights:
            loaded.add(k)
    return deltas, sorted(set(tensors) - loaded)


# --- SGLang ---------------------------------------------------------------------------------------------------------
def sglang_load(tensors: dict[str, torch.Tensor], metadata: dict[str, str], linears: set[str], qwen21: bool,
                ) -> dict[str, torch.Tensor]:
    """SGLang diffusion (python/sglang/multimodal_gen/runtime/pipelines_core/lora/peft_adapter.py and the LoRA
    pipeline): strips ``diffusion_model.`` / ``base_model.model.`` (``transformer.`` only where the model config's
    ``lora_param_names_mapping`` maps it: Qwen-Image-2.1); ``lora_down/up`` read as ``lora_A/B``; per-module
    ``.alpha`` read with ``int()``; metadata ``lora_alpha`` / ``network_alpha`` / ``alpha`` of a single-rank file
    must be a positive integer and is the default alpha; modules its model lacks are dropped silently."""
    prefixes = ("diffusion_model.", "base_model.model.") + (("transformer.",) if qwen21 else ())
    strip = {k: next((k[len(p):] for p in prefixes if k.startswith(p)), k) for k in tensors}
    a_keys = {strip[k][: -len(s)]: k for k in tensors for s in _A if strip[k].endswith(s)}
    ranks = {tensors[k].shape[0] for k in a_keys.values()}
    default = None
    if len(ranks) == 1:
        for field in ("lora_alpha", "network_alpha", "alpha"):
            if field in metadata:
                value = float(metadata[field])
                if not (value > 0 and value.is_integer()):
                    raise Refused(f"safetensors metadata {field!r} must be a positive integer")
                default = int(value)
    deltas = {}
    for module, a in a_keys.items():
        b = next(k for k in tensors for s in _B if strip[k] == module + s)
        if module not in linears:
            continue
        alpha_key = next((k for k in tensors if strip[k] == module + ".alpha"), None)
        alpha = int(float(tensors[alpha_key])) if alpha_key else default
        scale = 1.0 if alpha is None else alpha / tensors[a].shape[0]
        deltas[module] = scale * tensors[b].double() @ tensors[a].double()
    return deltas


# --- vLLM-Omni ------------------------------------------------------------------------------------------------------
def vllm_omni_layers(linears: set[str], qwen21: bool, newest: bool = False) -> dict[str, list[str]]:
    """vLLM-Omni's Qwen-Image transformers (vllm_omni/diffusion/models/qwen_image/qwen_image_transformer.py,
    .../qwen_image_21/...): its LoRA-capable layers (vLLM ``LinearBase``), each with the diffusers sub-modules
    it packs (``stacked_params_mapping``). ``attn.to_out`` is a ``RowParallelLinear`` itself (no ModuleList);
    q/k/v are one ``QKVParallelLinear`` (``to_qkv``, Edit also ``add_kv_proj``). Qwen-Image-Edit's
    ``img_mod.1``, ``txt_mod.1``, ``img_in``, ``txt_in``, ``proj_out``, ``norm_out.linear`` and the timestep
    linears are plain ``nn.Linear`` there (``newest``: ``ReplicatedLinear`` too); every 2.1 linear is a layer."""
    layers: dict[str, list[str]] = {}
    for n in sorted(linears):
        m = re.fullmatch(r"(transformer_blocks\.\d+\.attn)\.(to|add)_([qkv])(_proj)?", n)
        if m:
            packed = f"{m[1]}.to_qkv" if m[2] == "to" else f"{m[1]}.add_kv_proj"
            layers.setdefault(packed, [])
            continue
        name = n[: -len(".0")] if n.endswith("attn.to_out.0") else n
        block_layer = re.fullmatch(r"transformer_blocks\.\d+\.(attn\.(to_out|to_add_out)|(img|txt)_mlp\.net\.(0\.proj|2))",
                                   name)
        if qwen21 or newest or block_layer:
            layers[name] = [n]
    for packed in [p for p, subs in layers.items() if not subs]:
        stem, kind = packed.rsplit(".", 1)
        layers[packed] = [f"{stem}.{s}" for s in (("to_q", "to_k", "to_v") if kind == "to_qkv" else
                                                  ("add_q_proj", "add_k_proj", "add_v_proj"))]
    return layers


def _vllm_apply(loras: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float, layers: dict[str, list[str]],
                targets: list[str] | None) -> dict[str, torch.Tensor]:
    """DiffusionLoRAManager (vllm_omni/diffusion/lora/manager.py): ``expected_lora_modules`` are the layers' leaf
    names plus the packed sub-names; vLLM's ``LoRAModel.from_local_checkpoint`` refuses the adapter when a
    module's leaf is not one of them; a layer takes a LoRA when ``target_modules`` match it (``.*\\.<t>$``, or for
    a packed layer one of its sub-names); its weights are looked up by full, component-relative, then leaf name;
    a packed layer stacks its sub-modules' deltas (``lora_B * scale``)."""
    expected = {p.rsplit(".", 1)[-1] for p in layers} | {s.rsplit(".", 1)[-1] for subs in layers.values()
                                                          for s in subs if len(subs) > 1}
    unexpected = [m for m in loras if m.rsplit(".", 1)[-1] not in expected]
    if unexpected:
        raise Refused(f"expected target modules in {sorted(expected)} but received {unexpected[:3]}")

    def matches(name: str) -> bool:
        return targets is None or any(re.match(rf".*\.{t}$", name) or t == name for t in targets)

    deltas = {}
    for layer, subs in layers.items():
        full = f"transformer.{layer}"
        parts = [layer] if len(subs) == 1 else [s for s in subs]
        if not (matches(full) or (len(subs) > 1 and any(matches(f"transformer.{s}") for s in subs))):
            continue
        found = [loras.get(f"transformer.{p}") or loras.get(p) for p in parts]
        if not any(f is not None for f in found):
            continue
        blocks = [None if f is None else scaling * f[1].double() @ f[0].double() for f in found]
        shape = next(b for b in blocks if b is not None).shape
        deltas[layer] = torch.cat([b if b is not None else torch.zeros(shape, dtype=torch.float64)
                                   for b in blocks]) if len(blocks) > 1 else blocks[0]
    return deltas


def _check_one_rank(loras: dict, r: int, config: dict) -> None:
    """vllm_omni/diffusion/lora/utils.py ``validate_generic_peft_ranks`` (its newest loader): no per-module
    ``rank_pattern`` / ``alpha_pattern``, and every module's rank equal to the config's ``r``."""
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise Refused(f"adapter_config.json declares a non-empty {field!r}")
    off = {m: a.shape[0] for m, (a, b) in loras.items() if a.shape[0] != r or b.shape[1] != r}
    if off:
        raise Refused(f"LoRA tensor rank does not match the global PEFT config r={r}: {sorted(off.items())[:3]}")


def vllm_omni_load_folder(folder: Path, layers: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """A PEFT folder: vLLM's ``PEFTHelper`` (``r``, ``lora_alpha``, ``target_modules``; scaling ``lora_alpha /
    r``) and ``parse_fine_tuned_lora_name`` (``base_model.model.`` stripped, only ``.lora_A/B.weight``)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    loras: dict[str, list] = {}
    for key, t in load_file(str(folder / "adapter_model.safetensors")).items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight", key)
        if not m:
            raise Refused(f"{key} is unsupported LoRA weight")
        loras.setdefault(m[1], [None, None])["AB".index(m[2])] = t
    _check_one_rank(loras, config["r"], config)
    return _vllm_apply({k: tuple(v) for k, v in loras.items()}, config["lora_alpha"] / config["r"], layers,
                       config.get("target_modules"))


def vllm_omni_load_file(tensors: dict[str, torch.Tensor], layers: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """A single file: ``convert_single_file_lora`` (vllm_omni/diffusion/lora/utils.py): one root prefix of
    ``base_model.model.`` / ``diffusion_model.`` / ``transformer.`` stripped, ``lora_down/up`` or ``lora_A/B`` and
    ``.alpha`` (folded into B) only, else "Unrecognized key"; a module path resolves when its leaf is a supported
    module, or its leaf is an index and its parent's leaf is (``attn.to_out.0`` -> ``attn.to_out``); one that does
    not refuses the file; the config is ``r = lora_alpha =`` the largest rank (then the newest rank check)."""
    expected = {p.rsplit(".", 1)[-1] for p in layers} | {s.rsplit(".", 1)[-1] for subs in layers.values()
                                                          for s in subs if len(subs) > 1}
    modules: dict[str, dict] = {}
    for key, t in tensors.items():
        name = next((key[len(r):] for r in ("base_model.model.", "diffusion_model.", "transformer.")
                     if key.startswith(r)), key)
        part = next(((name[: -len(s)], "A") for s in _A if name.endswith(s)), None) or next(
            ((name[: -len(s)], "B") for s in _B if name.endswith(s)), None)
        if part is None and name.endswith(".alpha"):
            part = (name[: -len(".alpha")], "alpha")
        if part is None:
            raise Refused(f"Unrecognized key in single-file LoRA checkpoint: {key}")
        modules.setdefault(part[0], {})[part[1]] = t
    loras = {}
    for path, parts in sorted(modules.items()):
        leaf, parent = path.rsplit(".", 1)[-1], path.rsplit(".", 1)[0]
        resolved = path if leaf in expected else parent if leaf.isdigit() and parent.rsplit(".", 1)[-1] in expected \
            else None
        if resolved is None:
            raise Refused(f"{path} does not match any supported LoRA module of this pipeline")
        b = parts["B"] * (float(parts["alpha"]) / parts["A"].shape[0]) if "alpha" in parts else parts["B"]
        loras[resolved] = (parts["A"], b)
    r = max(a.shape[0] for a, _ in loras.values())
    _check_one_rank(loras, r, {})
    return _vllm_apply(loras, 1.0, layers, None)


# --- musubi-tuner -------------------------------------------------------------------------------------------------
def musubi_load(tensors: dict[str, torch.Tensor], linears: set[str]) -> dict[str, torch.Tensor]:
    """musubi-tuner (src/musubi_tuner/utils/lora_utils.py, the merge hook; networks/lora_qwen_image*.py): for each
    Linear inside the transformer blocks, ``lora_unet_<name with _>.lora_down/lora_up.weight`` and ``.alpha``
    (missing: the rank); other keys are not used (a warning)."""
    deltas = {}
    for n in linears:
        if not n.startswith("transformer_blocks."):
            continue
        stem = f"lora_unet_{_under(n)}"
        if f"{stem}.lora_down.weight" in tensors and f"{stem}.lora_up.weight" in tensors:
            down, up = tensors[f"{stem}.lora_down.weight"], tensors[f"{stem}.lora_up.weight"]
            alpha = float(tensors.get(f"{stem}.alpha", down.shape[0]))
            deltas[n] = alpha / down.shape[0] * up.double() @ down.double()
    return deltas


def stacked(deltas: dict[str, torch.Tensor], parts: list[str]) -> torch.Tensor | None:
    """Our deltas of ``parts`` stacked by rows, as a packed layer holds them (a missing part: zero rows)."""
    present = [deltas[p] for p in parts if p in deltas]
    if not present:
        return None
    return torch.cat([deltas[p].double() if p in deltas else torch.zeros(present[0].shape, dtype=torch.float64)
                      for p in parts]) if len(parts) > 1 else present[0].double()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return math.inf if got.shape != want.shape else float((got - want).norm() / want.norm().clamp_min(1e-30))
