"""Parameter counts of a Qwen-Image DiT, taken from the real module classes or a checkpoint's header.

``qie plan`` needs the bytes per block, per linear and per LoRA target, never the weights:
the real 20 B model is built on the ``meta`` device (``with torch.device("meta"): QwenImageDiT()``,
no memory, seconds), and a ``--model_dir`` checkpoint is read from its safetensors headers only.
"""
from __future__ import annotations

import functools
import glob
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

_BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.")


@dataclass(frozen=True)
class DiTCensus:
    """What the memory planner needs to know about a DiT and its LoRA targets.

    ``lora_features`` is the sum of ``in + out`` features over the targeted linears (a rank-r
    LoRA has ``r * lora_features`` parameters); ``lora_token_targets`` counts, per block, the
    targeted linears that run on every token of one stream (image or text), whose rank-r
    intermediate is kept for backward (the ``*_mod`` linears run once per sample).
    """

    dim: int
    num_layers: int
    params: int
    block_params: int  # the largest block
    linear_weight_params: int  # weights of every nn.Linear (what FP8 stores in one byte)
    linear_out_features: int  # one FP8 scale per output channel
    lora_features: int
    lora_token_targets: int
    text_encoder_params: int = 0
    vae_params: int = 0
    # a DiT that caches its prefix's keys and values across steps (Qwen-Image-2.1's text + reference prefix):
    # the width of one block's keys (and of its values), else 0
    prefix_kv_width: int = 0

    def lora_params(self, rank: int) -> int:
        return rank * self.lora_features


def _matches(name: str, targets: Sequence[str]) -> bool:
    # PEFT's rule for a list of target names: the module's full name or its dotted suffix.
    return any(name == t or name.endswith("." + t) for t in targets)


def census_from_shapes(shapes: Mapping[str, Sequence[int]], linears: Iterable[str],
                       targets: Sequence[str], streams: int = 2, **extra) -> DiTCensus:
    """A census from parameter name -> shape and the names of the linear modules (``streams``: token streams
    per block with their own targets: 2 for Qwen-Image-Edit's image and text, 1 for Qwen-Image-2.1)."""
    linears = set(linears)
    blocks: dict[int, int] = {}
    for name, shape in shapes.items():
        m = _BLOCK.match(name)
        if m:
            blocks[int(m.group(1))] = blocks.get(int(m.group(1)), 0) + _numel(shape)
    lin_w = {n: shapes[n + ".weight"] for n in linears if n + ".weight" in shapes}
    targeted = {n: s for n, s in lin_w.items() if _matches(n, targets)}
    if not targeted:
        raise ValueError(f"no linear matches the LoRA targets {list(targets)}; name modules such as to_q img_in")
    in_block = [n for n in targeted if _BLOCK.match(n)]
    token_wise = sum(1 for n in in_block if "_mod." not in n)
    first = _BLOCK.match(in_block[0]).group(0) if in_block else None
    per_block_tokens = sum(1 for n in in_block if n.startswith(first) and "_mod." not in n) if first else 0
    assert not blocks or token_wise == per_block_tokens * len(blocks), "blocks differ in their LoRA targets"
    if "img_in.weight" not in shapes:
        raise ValueError("not a Qwen-Image DiT: no img_in.weight among its parameters")
    return DiTCensus(
        dim=int(shapes["img_in.weight"][0]), num_layers=len(blocks),
        params=sum(_numel(s) for s in shapes.values()), block_params=max(blocks.values(), default=0),
        linear_weight_params=sum(_numel(s) for s in lin_w.values()),
        linear_out_features=sum(int(s[0]) for s in lin_w.values()),
        lora_features=sum(int(s[0]) + int(s[1]) for s in targeted.values()),
        # each stream has the same targets (to_q / add_q_proj, ...): per stream, a share of them
        lora_token_targets=per_block_tokens // streams if per_block_tokens > 1 else per_block_tokens,
        **extra)


def census_from_module(module, targets: Sequence[str], streams: int = 2, **extra) -> DiTCensus:
    import torch

    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    linears = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    return census_from_shapes(shapes, linears, targets, streams, **extra)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def census_from_files(files: Sequence[str | Path], targets: Sequence[str], streams: int = 2) -> DiTCensus:
    """A census from a checkpoint's safetensors headers (no tensor is read)."""
    if not files:
        raise ValueError("no DiT weight files given; pass --model_dir with a transformer/ folder")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        shapes.update(_header_shapes(Path(f)))
    # 2-D weights are linears in this DiT (no embeddings or convolutions); diffusers' key names
    # differ from DiffSynth's only in ways that keep the suffixes the targets use.
    linears = [k[: -len(".weight")] for k, s in shapes.items() if k.endswith(".weight") and len(s) == 2]
    return census_from_shapes(shapes, linears, targets, streams)


def dit_files(model_dir: str | Path, pattern: str) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(str(Path(model_dir) / pattern)))


@functools.lru_cache(maxsize=16)
def preset_census(preset_name: str, with_encoders: bool = True, num_layers: int | None = None) -> DiTCensus:
    """The census of a preset's DiT, built on the ``meta`` device (the tiny model at its real sizes);
    ``num_layers``: of a shallower copy (what ``qie plan --verify --verify_blocks N`` runs)."""
    import torch

    from ..models.presets import family_of, get_preset

    preset = get_preset(preset_name)
    family = family_of(preset)
    with torch.device("meta"):
        dit = build_dit(preset, num_layers)
        extra = _encoder_params(family) if with_encoders and not preset.is_tiny else {}
    return census_from_module(dit, preset.lora_target_modules, family.streams, **extra,
                              prefix_kv_width=prefix_kv_width(dit))


def prefix_kv_width(dit) -> int:
    """The width of a block's cached keys, for a DiT whose forward takes a prefix KV cache (``kv_cache``);
    0 for one that recomputes every token at every step."""
    import inspect

    if "kv_cache" not in inspect.signature(type(dit).forward).parameters:
        return 0
    return int(getattr(dit, "inner_dim", 0) or dit.img_in.weight.shape[0])


def build_dit(preset, num_layers: int | None = None):
    """The preset's DiT class at its real sizes (DiffSynth registers every Qwen DiT with default
    arguments), built on the current default device and dtype. ``num_layers`` overrides the
    depth (a shallower copy of the same blocks). A tiny preset's builder module gives its own."""
    import importlib

    from ..models.presets import family_of

    depth = {} if num_layers is None else {"num_layers": num_layers}
    if preset.is_tiny:
        return importlib.import_module(preset.provider.partition(":")[0]).tiny_dit(num_layers)
    return family_of(preset).component_type("dit")(**depth)


def _encoder_params(family) -> dict[str, int]:
    import torch

    from ..utils.logging import library_warnings_once

    library_warnings_once()  # the Qwen2.5-VL config's RoPE warnings are not news
    with torch.device("meta"):
        te, vae = family.component_type("text_encoder")(), family.component_type("vae")()
    return {"text_encoder_params": sum(p.numel() for p in te.parameters()),
            "vae_params": sum(p.numel() for p in vae.parameters())}
