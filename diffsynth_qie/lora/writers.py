"""The key layouts of the export targets: one function per target, ``(LoraState, **options) -> {key: tensor}``.

Each follows its row of ``export_targets.EXPORT_TARGETS`` (prefix, pair names, kohya underscores, alpha as a
float tensor or folded into lora_A, fused layouts); which modules a runtime loads is checked before a writer runs
(``export_check``). The rules and the runtimes' source files are in ``docs/LORA_RUNTIMES.md``.
"""
from __future__ import annotations

import logging

import torch

from .export_targets import EXPORT_TARGETS, ExportTarget, Fused
from .state import LoraModule, LoraState, listing

log = logging.getLogger(__name__)


def _cpu(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=dtype or t.dtype).contiguous().clone()


def folded_A(mod: LoraModule) -> torch.Tensor:
    """lora_A with ``alpha / rank`` multiplied in (the pair's scale becomes 1)."""
    return mod.A if mod.alpha is None else (mod.A.float() * mod.scale).to(mod.A.dtype)


def _prefix(target: ExportTarget, name: str) -> str:
    """The target's prefix, or its family rule's ``half_prefix`` for a part of a fused module (ComfyUI 2.1's
    ``img_mlp.gate_layer`` / ``proj``: on a fused ``gate_up`` checkpoint ComfyUI maps them only as ``<k>``,
    ``transformer.<k>`` or ``lycoris_<k>``; bare ``<k>`` is also what diffusers' converter prefixes right)."""
    for rule in target.families.values():
        if rule.half_prefix is not None and any(name.endswith("." + p) for f in rule.fused for p in f.parts):
            return rule.half_prefix
    return target.prefix


def layout_state_dict(state: LoraState, target: ExportTarget) -> dict[str, torch.Tensor]:
    """``state``'s LoRA pairs under ``target``'s key names (at one rank where the target wants it); full weights
    as ComfyUI ``.set_weight`` patches where the target applies them (elsewhere the export check has dropped or
    refused them)."""
    down, up = target.pair
    out: dict[str, torch.Tensor] = {}
    if target.uniform_rank:
        state = uniform_rank(state)
    for name, mod in sorted(state.modules.items()):
        key = _prefix(target, name) + (name.replace(".", "_") if target.underscore else name)
        out[f"{key}.{down}.weight"] = _cpu(folded_A(mod) if target.alpha_folded else mod.A)
        out[f"{key}.{up}.weight"] = _cpu(mod.B)
        if not target.alpha_folded and (mod.alpha is not None or target.underscore):
            # kohya's loaders take a missing alpha as the rank: written anyway, so no tool guesses
            out[f"{key}.alpha"] = torch.tensor(float(mod.alpha if mod.alpha is not None else mod.rank))
    if target.full_weights:
        for name, tensor in sorted(state.full.items()):
            module = name[: -len(".weight")] if name.endswith(".weight") else name
            out[f"{target.prefix}{module}.set_weight"] = _cpu(tensor)
    return out


def comfyui_state_dict(state: LoraState) -> dict[str, torch.Tensor]:
    """ComfyUI keys: ``diffusion_model.<module>.lora_A/lora_B.weight``, ``.alpha``, ``.set_weight``."""
    from .resolve import resolved

    return layout_state_dict(resolved(state), EXPORT_TARGETS["comfyui"])


def diffusers_state_dict(state: LoraState, drop_full_weights: bool = False) -> dict[str, torch.Tensor]:
    """diffusers keys: ``transformer.<module>.lora_A/lora_B.weight``, alpha folded into ``lora_A``."""
    from .resolve import resolved

    state = resolved(state)
    if state.full and not drop_full_weights:
        raise ValueError(f"LoRA {state.source} holds full module weights ({listing(list(state.full))}) that "
                         "diffusers' LoRA loader cannot load; export with --format comfyui, or pass "
                         "--drop_full_weights to export only the LoRA part")
    if state.full:
        log.warning("dropping %d full module weight(s) for the diffusers export: %s",
                    len(state.full), listing(list(state.full)))
    return layout_state_dict(state, EXPORT_TARGETS["diffusers"])


def kohya_state_dict(state: LoraState) -> dict[str, torch.Tensor]:
    """kohya / musubi-tuner keys: ``lora_unet_<module with _>.lora_down/lora_up.weight`` and ``.alpha``."""
    from .resolve import resolved

    return layout_state_dict(resolved(state), EXPORT_TARGETS["kohya"])


def sglang_state_dict(state: LoraState) -> dict[str, torch.Tensor]:
    """SGLang keys: ``diffusion_model.<module>.lora_A/lora_B.weight``, alpha folded (SGLang reads alpha as an int)."""
    from .resolve import resolved

    return layout_state_dict(resolved(state), EXPORT_TARGETS["sglang"])


def vllm_state_dict(state: LoraState) -> dict[str, torch.Tensor]:
    """vLLM-Omni's single-file keys ``transformer.<module>.lora_A/lora_B.weight``, alpha folded, every module at
    the largest rank (the PEFT folder renames them to ``base_model.model.<module>``,
    ``export_check.write_peft_folder``)."""
    from .resolve import resolved

    return layout_state_dict(resolved(state), EXPORT_TARGETS["vllm-omni"])


def uniform_rank(state: LoraState) -> LoraState:
    """Every module at the LoRA's largest rank: lora_A (alpha folded in) padded with zero rows, lora_B with zero
    columns, so each delta is unchanged. vLLM-Omni applies one rank from its config to every module, and its newest
    loader refuses a file whose modules differ in rank."""
    from dataclasses import replace

    top = max(state.ranks, default=0)
    if len(state.ranks) <= 1:
        return state
    log.info("one rank for every module: modules of rank %s padded with zeros to rank %d (the same deltas)",
             ", ".join(map(str, sorted(state.ranks - {top}))), top)
    padded = {}
    for name, mod in state.modules.items():
        a, b = folded_A(mod), mod.B
        extra = top - mod.rank
        padded[name] = LoraModule(A=torch.cat([a, a.new_zeros(extra, a.shape[1])]),
                                  B=torch.cat([b, b.new_zeros(b.shape[0], extra)], dim=1))
    return replace(state, modules=padded)


def fuse(parts: list[LoraModule | None]) -> LoraModule:
    """The exact LoRA of a row-stacked fused weight from its parts' pairs (alpha folded in): A stacked by rows,
    B block-diagonal (a missing part: zero rows of the others' height)."""
    present = [m for m in parts if m is not None]
    rows = present[0].B.shape[0]
    a = torch.cat([folded_A(m).float() for m in present])
    b = torch.zeros(rows * len(parts), a.shape[0], dtype=torch.float32)
    col = 0
    for i, m in enumerate(parts):
        if m is not None:
            b[i * rows:(i + 1) * rows, col:col + m.rank] = m.B.float()
            col += m.rank
    dtype = present[0].A.dtype
    return LoraModule(A=a.to(dtype), B=b.to(dtype))


def fused_modules(state: LoraState, fused: tuple[Fused, ...]) -> dict[str, LoraModule]:
    """``state``'s modules with every group of ``fused`` parts replaced by one fused pair."""
    out = dict(state.modules)
    for f in fused:
        stems = {n[: -len(p)] for n in state.modules for p in f.parts if n.endswith("." + p)}
        for stem in sorted(stems):
            parts = [out.pop(stem + p, None) for p in f.parts]
            out[stem + f.name] = fuse(parts)
    return out


def nunchaku_state_dict(state: LoraState) -> dict[str, torch.Tensor]:
    """Nunchaku's converter's keys: ``transformer.blocks.<n>.<module>.lora_A/lora_B.weight``, q/k/v fused."""
    from .resolve import resolved

    target = EXPORT_TARGETS["nunchaku"]
    rule = next(iter(target.families.values()))
    out: dict[str, torch.Tensor] = {}
    for name, mod in sorted(fused_modules(resolved(state), rule.fused).items()):
        key = "transformer." + name.replace("transformer_blocks.", "blocks.", 1)
        out[f"{key}.lora_A.weight"] = _cpu(folded_A(mod))
        out[f"{key}.lora_B.weight"] = _cpu(mod.B)
    return out
