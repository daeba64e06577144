"""The runtimes ``qie export-lora --format`` writes for, and what each loads, as data: one :class:`ExportTarget`
per runtime.

Torch-free, so ``qie export-lora``'s choices and help, ``qie inspect-lora``'s rows, ``--lora_targets serving``
and the README's "where will my LoRA load" table all come from this one table. Each rule's source file in the
runtime's repository is cited in ``docs/LORA_RUNTIMES.md``. A target names:

- the key layout it writes: ``prefix`` + module path (``underscore``: kohya's ``.`` -> ``_``) + ``pair`` names;
- ``accepted_prefixes``: the prefixes the runtime maps (documentation; how each runtime reads a file's own keys,
  for ``qie inspect-lora``, is ``runtime_reads.py``);
- where alpha goes: ``"tensor"`` (a float ``<module>.alpha``) or ``"folded"`` (``alpha / rank`` multiplied into
  lora_A; the runtime ignores or truncates alpha, or wants an integer);
- ``full_weights``: whether the runtime applies fully trained module weights;
- ``folder_names``: module-path renames for its PEFT folder, where the runtime's model names a module otherwise;
- ``uniform_rank``: every module written at the LoRA's largest rank (zero-padded, the same delta);
- per family (``families``; a family not listed cannot have this target) a :class:`FamilyRule`: the modules the
  runtime can put a LoRA on and its fused layouts.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Callable, Optional

EDIT, QWEN21 = "qwen-image-edit", "qwen-image-2.1"  # models.family names (a test keeps them equal)

# Qwen-Image-Edit's linears that are vLLM parallel layers (LinearBase); img/txt_mod.1, img_in, txt_in,
# proj_out and the embedders are plain nn.Linear there, and nn.Linear takes no LoRA.
_EDIT_PARALLEL = r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|(img|txt)_mlp\.net\.(0\.proj|2))"
_BLOCKS = r"transformer_blocks\.\d+\..+"  # inside a transformer block


@dataclass(frozen=True)
class Fused:
    """A module the runtime's model holds as one weight where DiffSynth's DiT has ``parts`` (stacked by rows)."""

    name: str  # e.g. "attn.to_qkv"
    parts: tuple[str, ...]  # e.g. ("attn.to_q", "attn.to_k", "attn.to_v")


@dataclass(frozen=True)
class FamilyRule:
    modules: Optional[str] = None  # regex a module path must fully match; None: every linear of the DiT
    fused: tuple[Fused, ...] = ()  # fused layouts of the runtime's checkpoints for this family
    write_fused: bool = False  # the file must hold the fused module (parts fused exactly, rank summed)
    half_prefix: Optional[str] = None  # prefix for the parts of a fused module (mapped only under it)

    def accepts(self, module: str) -> bool:
        return self.modules is None or re.fullmatch(self.modules, module) is not None


@dataclass(frozen=True)
class ExportTarget:
    name: str
    runtime: str  # the runtime's name, for tables
    help: str  # what its file holds, for --help
    writer: str  # "module:function": (LoraState, **options) -> dict of tensors
    prefix: str
    accepted_prefixes: tuple[str, ...]
    families: dict
    pair: tuple[str, str] = ("lora_A", "lora_B")
    underscore: bool = False
    alpha: str = "tensor"  # "tensor": float <module>.alpha; "folded": into lora_A, none written
    full_weights: bool = False
    folder: bool = False  # a PEFT folder (adapter_model.safetensors + adapter_config.json) unless OUT is a file
    options: tuple[str, ...] = ()  # keyword options of the writer (each a `qie export-lora` flag)
    folder_names: tuple[tuple[str, str], ...] = ()  # (DiffSynth suffix, the runtime's) for module paths in a folder
    uniform_rank: bool = False  # every module at the largest rank (zero-padded): the runtime wants one rank

    @property
    def alpha_folded(self) -> bool:
        """alpha / rank multiplied into lora_A: the file's own scale is 1."""
        return self.alpha == "folded"

    def rule(self, family: str) -> Optional[FamilyRule]:
        return self.families.get(family)

    def write_fn(self) -> Callable:
        module, _, name = self.writer.partition(":")
        return getattr(importlib.import_module(module), name)


_W = "diffsynth_qie.lora.writers:"
EXPORT_TARGETS: dict[str, ExportTarget] = {t.name: t for t in (
    ExportTarget(
        "comfyui", "ComfyUI", "diffusion_model.<module>.lora_A/lora_B.weight + .alpha (+ .set_weight for full "
        "module weights); 2.1's img_mlp.gate_layer/proj as bare <module> keys (load on a fused gate_up too, and in "
        "diffusers)",
        _W + "comfyui_state_dict", prefix="diffusion_model.", full_weights=True,
        accepted_prefixes=("diffusion_model.", "lora_unet_", "", "transformer.", "lycoris_"),
        families={EDIT: FamilyRule(),
                  QWEN21: FamilyRule(fused=(Fused("img_mlp.gate_up", ("img_mlp.gate_layer", "img_mlp.proj")),),
                                     half_prefix="")}),
    ExportTarget(
        "diffusers", "diffusers", "transformer.<module>.lora_A/lora_B.weight with alpha folded in",
        _W + "diffusers_state_dict", prefix="transformer.", alpha="folded", options=("drop_full_weights",),
        accepted_prefixes=("transformer.", "diffusion_model.", "lora_unet_"),
        families={EDIT: FamilyRule(), QWEN21: FamilyRule()}),
    ExportTarget(
        "kohya", "musubi-tuner", "lora_unet_<module with _>.lora_down/lora_up.weight + .alpha (kohya / musubi-tuner)",
        _W + "kohya_state_dict", prefix="lora_unet_", underscore=True, pair=("lora_down", "lora_up"),
        accepted_prefixes=("lora_unet_",),
        families={EDIT: FamilyRule(modules=_BLOCKS), QWEN21: FamilyRule(modules=_BLOCKS)}),
    ExportTarget(
        "sglang", "SGLang", "diffusion_model.<module>.lora_A/lora_B.weight, alpha folded (SGLang reads it as an "
        "integer), integer metadata alpha = rank", _W + "sglang_state_dict", prefix="diffusion_model.",
        alpha="folded", accepted_prefixes=("diffusion_model.", "", "base_model.model."),
        families={EDIT: FamilyRule(), QWEN21: FamilyRule()}),
    ExportTarget(
        "vllm-omni", "vLLM-Omni", "a PEFT folder (adapter_model.safetensors: base_model.model.<module>.lora_A/B in "
        "vLLM-Omni's module names, adapter_config.json), or with OUT *.safetensors one file of "
        "transformer.<module>.lora_A/B; alpha folded, one rank",
        _W + "vllm_state_dict", prefix="transformer.", alpha="folded", folder=True, uniform_rank=True,
        # vLLM-Omni's Qwen-Image attention holds its output projection as `to_out` itself (no ModuleList)
        folder_names=((".attn.to_out.0", ".attn.to_out"),),
        accepted_prefixes=("base_model.model.", "diffusion_model.", "transformer."),
        families={EDIT: FamilyRule(modules=_EDIT_PARALLEL, fused=(
                      Fused("attn.to_qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
                      Fused("attn.add_kv_proj", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")))),
                  QWEN21: FamilyRule(fused=(Fused("attn.to_qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),))}),
    ExportTarget(
        "nunchaku", "Nunchaku", "transformer.blocks.<n>.<module>.lora_A/lora_B.weight as its converter reads, "
        "q/k/v fused into to_qkv / add_qkv_proj, alpha folded", _W + "nunchaku_state_dict",
        prefix="transformer.", alpha="folded", accepted_prefixes=("transformer.", "base_model.model."),
        families={EDIT: FamilyRule(modules=_EDIT_PARALLEL[:-1] + r"|(img|txt)_mod\.1)", write_fused=True, fused=(
            Fused("attn.to_qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
            Fused("attn.add_qkv_proj", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"))))}),
)}

# Candidate LoRA targets per family (PEFT suffix, one module path it names), for --lora_targets serving.
_CANDIDATES = {
    EDIT: tuple((s, f"transformer_blocks.0.{p}") for s, p in (
        ("to_q", "attn.to_q"), ("to_k", "attn.to_k"), ("to_v", "attn.to_v"), ("add_q_proj", "attn.add_q_proj"),
        ("add_k_proj", "attn.add_k_proj"), ("add_v_proj", "attn.add_v_proj"), ("to_out.0", "attn.to_out.0"),
        ("to_add_out", "attn.to_add_out"), ("img_mlp.net.0.proj", "img_mlp.net.0.proj"),
        ("img_mlp.net.2", "img_mlp.net.2"), ("txt_mlp.net.0.proj", "txt_mlp.net.0.proj"),
        ("txt_mlp.net.2", "txt_mlp.net.2"), ("img_mod.1", "img_mod.1"), ("txt_mod.1", "txt_mod.1")))
    + (("img_in", "img_in"), ("txt_in", "txt_in"), ("proj_out", "proj_out")),
    QWEN21: tuple((s, f"transformer_blocks.0.{p}") for s, p in (
        ("to_q", "attn.to_q"), ("to_k", "attn.to_k"), ("to_v", "attn.to_v"), ("to_out.0", "attn.to_out.0"),
        ("img_mlp.proj", "img_mlp.proj"), ("img_mlp.gate_layer", "img_mlp.gate_layer"), ("img_mlp.out", "img_mlp.out"))),
}


def export_target(name: str) -> ExportTarget:
    if name not in EXPORT_TARGETS:
        raise ValueError(f"unknown export format {name!r}; choose one of {', '.join(EXPORT_TARGETS)}")
    return EXPORT_TARGETS[name]


def export_names(value: str | None) -> list[str]:
    """``"comfyui,diffusers"`` -> the checked target names (``qie train --export``)."""
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    for name in names:
        export_target(name)
    return names


def serving_targets(family: str) -> list[str]:
    """The LoRA target suffixes of ``family`` that every runtime of this table which has the family loads."""
    rules = [r for t in EXPORT_TARGETS.values() for r in [t.rule(family)] if r is not None]
    if family not in _CANDIDATES:
        raise ValueError(f"unknown model family {family!r}; valid: {', '.join(_CANDIDATES)}")
    return [s for s, path in _CANDIDATES[family] if all(r.accepts(path) for r in rules)]


def load_table() -> list[list[str]]:
    """The README's "where will my LoRA load" table: one row per target, one column per family."""
    families = list(_CANDIDATES)
    rows = [["runtime", "`--format`", *families, "alpha", "full weights"]]
    for t in EXPORT_TARGETS.values():
        cells = []
        for family in families:
            rule = t.rule(family)
            if rule is None:
                cells.append("no (no such model)")
            elif rule.modules is None:
                cells.append("every module")
            else:
                left = [s for s, p in _CANDIDATES[family] if not rule.accepts(p)]
                cells.append("all but " + ", ".join(left) if left else "every module")
        rows.append([t.runtime, f"`{t.name}`", *cells, "folded" if t.alpha_folded else "`.alpha` tensor",
                     "yes" if t.full_weights else "no"])
    return rows


def load_table_markdown() -> str:
    rows = load_table()
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])
