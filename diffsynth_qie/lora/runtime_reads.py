"""How each runtime of ``export_targets`` reads a LoRA file's own keys and metadata (``qie inspect-lora``).

A reader takes the file as written (:class:`FileKeys`: its keys and shapes, its ``.alpha`` values, its metadata;
not our reader's normalised view) and the DiT's linears of the family (DiffSynth's names), and returns what the
runtime's loader does with it (:class:`Reading`): the modules it applies and at which scale ``alpha / rank``, the
keys it leaves unloaded, or why it refuses the whole file. ComfyUI's 2.1 is read twice: on the unfused model and
on the fused one (``img_mlp.gate_up``). The rules and the runtimes' source files are in ``docs/LORA_RUNTIMES.md``;
the tests hold each reader to the runtime's transcribed loader, or to the real one (diffusers).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from .export_targets import EXPORT_TARGETS, QWEN21

_PAIR = re.compile(r"^(?P<stem>.+?)\.(?P<kind>lora_A|lora_B|lora_down|lora_up)(?:\.(?P<slot>[^.]+))?\.weight$")
_FULL = (".set_weight", ".diff")  # ComfyUI's patches that replace or add to a weight


@dataclass(frozen=True)
class FileKeys:
    shapes: dict[str, tuple[int, ...]]
    alphas: dict[str, float]  # key -> value, for keys ending ".alpha"
    metadata: dict[str, str]

    @classmethod
    def of(cls, tensors: dict, metadata: dict[str, str]) -> "FileKeys":
        return cls({k: tuple(v.shape) for k, v in tensors.items()},
                   {k: float(v.float().reshape(-1)[0]) for k, v in tensors.items() if k.endswith(".alpha")},
                   dict(metadata))


@dataclass
class Reading:
    loaded: dict[str, float] = field(default_factory=dict)  # module (DiffSynth's name) -> scale applied
    full: set[str] = field(default_factory=set)  # full weights applied ("<module>.weight" / ".bias")
    unloaded: list[str] = field(default_factory=list)  # keys of the file the loader leaves unloaded
    refused: Optional[str] = None  # the whole file refused, and why


@dataclass
class _Pair:
    a: Optional[str] = None  # the lora_A / lora_down key
    b: Optional[str] = None
    kinds: set = field(default_factory=set)  # "lora_A" ... "lora_up" as named, and "slot:<PEFT adapter>" ("slot:")
    keys: list = field(default_factory=list)


def _pairs(keys, rename: Callable[[str], str] = lambda k: k) -> tuple[dict[str, _Pair], list[str]]:
    """stem -> its LoRA pair (after ``rename`` of each key); keys that are no LoRA pair or alpha apart."""
    pairs: dict[str, _Pair] = {}
    other = []
    for key in keys:
        name = rename(key)
        m = _PAIR.match(name)
        if m:
            p = pairs.setdefault(m["stem"], _Pair())
            if m["kind"] in ("lora_A", "lora_down"):
                p.a = key
            else:
                p.b = key
            p.kinds |= {m["kind"], f"slot:{m['slot'] or ''}"}
            p.keys.append(key)
        elif name.endswith(".alpha"):
            p = pairs.setdefault(name[: -len(".alpha")], _Pair())
            p.keys.append(key)
        else:
            other.append(key)
    return pairs, other


def _scale(f: FileKeys, p: _Pair, alpha: Optional[float] = None, truncate: bool = False) -> float:
    rank = f.shapes[p.a][0]
    value = next((f.alphas[k] for k in p.keys if k.endswith(".alpha")), alpha)
    if value is None:
        return 1.0
    return (int(value) if truncate else value) / rank


def _complete(p: _Pair, slots: Optional[tuple[str, ...]] = ("slot:",)) -> bool:
    """Both halves of the pair, under no PEFT adapter slot but ``slots`` (None: any one slot)."""
    used = {k for k in p.kinds if k.startswith("slot:")}
    return p.a is not None and p.b is not None and (len(used) == 1 if slots is None else used <= set(slots))


def _fold(name: str) -> str:
    return name[: -len(".0")] if name.endswith(".attn.to_out.0") else name


def read_comfyui(f: FileKeys, names: set[str], family: str) -> list[tuple[str, Reading]]:
    """comfy/lora.py: ``model_lora_keys_unet`` (every weight as ``diffusion_model.<k>`` and ``lora_unet_<k_>``;
    Qwen-Image also ``<k>``, ``transformer.<k>``, ``lycoris_<k_>``; on a fused 2.1 model ``img_mlp.gate_up`` is the
    weight and its halves map only as ``<k>``, ``transformer.<k>``, ``lycoris_<k_>``) and ``load_lora`` (a
    ``.alpha`` tensor or scale 1; metadata unread; full weights as ``.set_weight`` / ``.diff``)."""
    variants = [("", names, set())]
    if family == QWEN21:
        halves = {n for n in names if n.endswith(("img_mlp.gate_layer", "img_mlp.proj"))}
        variants = [("its unfused 2.1 model", names, set()), ("its fused 2.1 model", names - halves, halves)]
    out = []
    for label, weights, halves in variants:
        key_map: dict[str, list[str]] = {}
        for m in weights:
            forms = ["diffusion_model." + m, "lora_unet_" + m.replace(".", "_"), m, "transformer." + m,
                     "lycoris_" + m.replace(".", "_")]
            for form in forms:
                key_map[form] = [m]
            key_map[f"diffusion_model.{m}.bias"] = [m + ".bias"]
        for h in halves:
            for form in (h, "transformer." + h, "lycoris_" + h.replace(".", "_")):
                key_map[form] = [h]
            stem = h.rsplit(".", 1)[0] + ".gate_up"  # the fused weight itself: the generic forms only
            for form in ("diffusion_model." + stem, "lora_unet_" + stem.replace(".", "_")):
                key_map.setdefault(form, []).append(h)
        pairs, other = _pairs(f.shapes)
        reading = Reading()
        for stem, p in pairs.items():
            if stem in key_map and _complete(p, ("slot:", "slot:default")):
                reading.loaded.update({m: _scale(f, p) for m in key_map[stem]})
            else:
                reading.unloaded += p.keys
        for key in other:
            stem = next((key[: -len(s)] for s in _FULL if key.endswith(s)), None)
            if stem in key_map:
                reading.full.update(t if t.endswith(".bias") else t + ".weight" for t in key_map[stem])
            else:
                reading.unloaded.append(key)
        out.append((label, reading))
    return out


# diffusers' _convert_non_diffusers_qwen_lora_to_diffusers: kohya names back to dots
_TOP_LEVEL = {"img_in": "img_in", "txt_in": "txt_in", "proj_out": "proj_out", "norm_out_linear": "norm_out.linear",
              "time_text_embed_timestep_embedder_linear_1": "time_text_embed.timestep_embedder.linear_1",
              "time_text_embed_timestep_embedder_linear_2": "time_text_embed.timestep_embedder.linear_2"}
_KEPT = sorted([("to", "q"), ("to", "k"), ("to", "v"), ("to", "out"), ("add", "q"), ("add", "k"), ("add", "v"),
                ("txt", "mlp"), ("img", "mlp"), ("txt", "mod"), ("img", "mod"), ("add", "q", "proj"),
                ("add", "k", "proj"), ("add", "v", "proj"), ("to", "add", "out")], key=len, reverse=True)


def _diffusers_kohya_name(key: str) -> str:
    for flat, dotted in _TOP_LEVEL.items():
        if key == flat or key.startswith(flat + "."):
            return dotted + key[len(flat):]
    base, suffix = key.rsplit(".", 1) if "." in key else (key, "")
    head, _, tail = base[len("transformer_blocks_"):].partition(".")
    parts, merged, i = head.split("_"), [], 0
    while i < len(parts):
        gram = next((g for g in _KEPT if tuple(parts[i:i + len(g)]) == g), (parts[i],))
        merged.append("_".join(gram))
        i += len(gram)
    return f"transformer_blocks.{'.'.join(merged)}" + (f".{tail}" if tail else "") + (f".{suffix}" if suffix else "")


def read_diffusers(f: FileKeys, names: set[str], family: str) -> list[tuple[str, Reading]]:
    """diffusers' ``QwenImageLoraLoaderMixin``: a file with ``.alpha``, ``lora_unet_``, ``diffusion_model.`` or
    ``default.`` keys goes through the non-diffusers converter (alpha folded; any key it does not consume refuses
    the file; every key then gets ``transformer.``); a key without "lora" refuses the file; ``transformer.<module>``
    keys load, alpha from ``lora_adapter_metadata``; modules not in the model are unexpected keys."""
    from .adapter_metadata import adapter_config, config_alpha

    keys = list(f.shapes)
    reading = Reading()
    convert = any(k.endswith(".alpha") or k.startswith(("lora_unet_", "diffusion_model.")) or "default." in k
                  for k in keys)
    rename = {k: k for k in keys}
    if convert:
        rename = {k: k.removeprefix("diffusion_model.") for k in keys}
        if any(v.startswith("lora_unet_") for v in rename.values()):
            rename = {k: _diffusers_kohya_name(v.removeprefix("lora_unet_")) for k, v in rename.items()}
        rename = {k: "transformer." + v.replace("default.", "") for k, v in rename.items()}
    pairs, other = _pairs(keys, lambda k: rename[k])
    down = any("lora_down" in p.kinds for p in pairs.values())
    if convert and (other or any(p.a is not None and p.b is None for p in pairs.values())
                    or any(("lora_down" in p.kinds) != down for p in pairs.values() if p.a)):
        reading.refused = "keys its converter does not take (the state dict is not empty after conversion)"
        return [("", reading)]
    if any("lora" not in rename[k] for k in keys if not k.endswith(".alpha")):
        reading.refused = "keys without \"lora\" (full weights): Invalid LoRA checkpoint"
        return [("", reading)]
    config = None if convert else adapter_config(f.metadata)
    for stem, p in pairs.items():
        module = stem.removeprefix("transformer.")
        if not stem.startswith("transformer.") or module not in names or not _complete(p):
            reading.unloaded += p.keys
            continue
        alpha = config_alpha(config, module, f.shapes[p.a][0], "") if config else None
        reading.loaded[module] = _scale(f, p, alpha)
    return [("", reading)]


def read_sglang(f: FileKeys, names: set[str], family: str) -> list[tuple[str, Reading]]:
    """SGLang's diffusion LoRA loader: strips ``diffusion_model.``, ``base_model.model.`` and the PEFT adapter
    slot, and ``transformer.`` where the model config maps it (2.1); ``.alpha`` read with ``int()``; a metadata
    ``lora_alpha`` / ``network_alpha`` / ``alpha`` (single-rank files) must be an integer; modules, full weights
    and keys it does not know are dropped silently."""
    prefixes = ("diffusion_model.", "base_model.model.") + (("transformer.",) if family == QWEN21 else ())

    def strip(k: str) -> str:
        return next((k[len(p):] for p in prefixes if k.startswith(p)), k)

    pairs, other = _pairs(f.shapes, strip)
    reading = Reading(unloaded=list(other))
    ranks = {f.shapes[p.a][0] for p in pairs.values() if p.a}
    default = None
    if len(ranks) == 1:
        declared = {k: f.metadata[k] for k in ("lora_alpha", "network_alpha", "alpha") if k in f.metadata}
        for k, v in declared.items():
            try:
                value = float(v)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0 and value.is_integer()):
                reading.refused = f"its metadata {k!r} is {v!r}, not a positive integer"
                return [("", reading)]
            default = int(value) if default in (None, int(value)) else math.nan
        if default is not None and math.isnan(default):
            reading.refused = f"its metadata alphas disagree: {declared}"
            return [("", reading)]
    for stem, p in pairs.items():
        if stem in names and _complete(p, None):
            reading.loaded[stem] = _scale(f, p, default, truncate=True)
        else:
            reading.unloaded += p.keys
    return [("", reading)]


def read_vllm_omni(f: FileKeys, names: set[str], family: str) -> list[tuple[str, Reading]]:
    """vLLM-Omni's single-file loader (``convert_single_file_lora``): one root prefix stripped, ``lora_A/B`` or
    ``lora_down/up`` and ``.alpha`` (folded) only, every module must end in a layer its model has (a trailing
    ``.0`` folds onto ``to_out``), one rank (its newest loader); metadata unread. Anything else refuses the file."""
    rule = EXPORT_TARGETS["vllm-omni"].rule(family)
    layers = {_fold(n) for n in names if rule.accepts(n)}
    expected = {n.rsplit(".", 1)[-1] for n in layers} | {fz.name.rsplit(".", 1)[-1] for fz in rule.fused}
    roots = ("base_model.model.", "diffusion_model.", "transformer.")
    pairs, other = _pairs(f.shapes, lambda k: next((k[len(r):] for r in roots if k.startswith(r)), k))
    reading = Reading()
    bad = other + [k for p in pairs.values() for k in p.keys if not _complete(p)]
    if bad:
        reading.refused = f"{len(bad)} key(s) are no LoRA pair or alpha it knows ({bad[0]}, ...)"
        return [("", reading)]
    resolved = {}
    for stem in pairs:
        leaf, parent = stem.rsplit(".", 1)[-1], stem.rsplit(".", 1)[0]
        if leaf in expected:
            resolved[stem] = stem
        elif leaf.isdigit() and parent.rsplit(".", 1)[-1] in expected:
            resolved[stem] = parent
    unmatched = sorted(set(pairs) - set(resolved))
    if unmatched:
        reading.refused = f"{len(unmatched)} module(s) end in no layer of its model ({unmatched[0]}, ...)"
        return [("", reading)]
    ranks = sorted({f.shapes[p.a][0] for p in pairs.values()})
    if len(ranks) > 1:
        reading.refused = f"its modules have ranks {', '.join(map(str, ranks))}; its newest loader takes one rank"
        return [("", reading)]
    for stem, p in pairs.items():
        module = resolved[stem] + (".0" if resolved[stem].endswith(".attn.to_out") else "")
        if _fold(module) in layers:
            reading.loaded[module] = _scale(f, p)
        else:
            reading.unloaded += p.keys
    return [("", reading)]


def read_musubi(f: FileKeys, names: set[str], family: str) -> list[tuple[str, Reading]]:
    """musubi-tuner: ``lora_unet_<module with _>.lora_down/lora_up.weight`` and ``.alpha`` (else the rank), on the
    linears inside the transformer blocks; other keys are not used."""
    rule = EXPORT_TARGETS["kohya"].rule(family)
    lookup = {"lora_unet_" + n.replace(".", "_"): n for n in names if rule.accepts(n)}
    pairs, other = _pairs(f.shapes)
    reading = Reading(unloaded=list(other))
    for stem, p in pairs.items():
        if stem in lookup and p.kinds == {"lora_down", "lora_up", "slot:"}:
            reading.loaded[lookup[stem]] = _scale(f, p)
        else:
            reading.unloaded += p.keys
    return [("", reading)]


_NUNCHAKU = re.compile(r"transformer\.blocks\.\d+\.(attn\.(to_qkv|add_qkv_proj|to_out\.0|to_add_out)|(img|txt)_mod\.1"
                       r"|(img|txt)_mlp\.net\.(0\.proj|2))\.lora_[AB]\.weight")


def read_nunchaku(f: FileKeys, names: set[str], family: str) -> list[tuple[str, Reading]]:
    """Nunchaku's converter reads its own layout only: ``transformer.blocks.<n>.<module>`` with q/k/v fused."""
    other = [k for k in f.shapes if not _NUNCHAKU.fullmatch(k)]
    return [("", Reading(refused=f"it reads transformer.blocks.<n>.<module> keys with q/k/v fused, not {other[0]}")
             if other else Reading())]


READERS: dict[str, Callable[[FileKeys, set, str], list]] = {
    "comfyui": read_comfyui, "diffusers": read_diffusers, "kohya": read_musubi, "sglang": read_sglang,
    "vllm-omni": read_vllm_omni, "nunchaku": read_nunchaku}
