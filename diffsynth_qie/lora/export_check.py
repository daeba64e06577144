"""An export that loads fully in its runtime, or fails saying why: check, write atomically, read back.

:func:`plan_export` checks a LoRA against its target's rules (``export_targets``): the family (a LoRA of another
model, or a family the runtime has no model of, is an error), each module against the modules the runtime puts a
LoRA on, full weights, fused layouts, alpha. What the runtime would drop, truncate or refuse stops the export with
the modules and their share of the LoRA's delta (``‖ΔW_module‖ / ‖ΔW‖``, Frobenius norms over every module);
``drop_unsupported`` writes the rest and says what was dropped. :func:`export_checked` writes into a temporary
path, reads that file back and compares its deltas with the source (the max relative error is logged; above
``MAX_EXPORT_ERROR`` nothing is written).
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..utils.atomic import atomic_save
from .adapter_metadata import ADAPTER_METADATA_KEY, checked_alpha
from .export_targets import EXPORT_TARGETS, ExportTarget, export_target
from .state import FORMAT_NAME, LoraModule, LoraState, listing

log = logging.getLogger(__name__)

MAX_EXPORT_ERROR = 1e-2  # bf16 rounding of a folded lora_A stays far below; a wrong key layout does not
# metadata keys that state a LoRA's rank or alpha (ours, kohya's, PEFT-style): not copied into an export
SCALE_KEYS = frozenset({"alpha", "rank", "lora_alpha", "lora_rank", "network_alpha", "network_dim",
                        "ss_network_alpha", "ss_network_dim"})


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> Path:
    """``tensors`` and ``metadata`` (non-strings as JSON) as a safetensors file, atomically."""
    from safetensors.torch import save_file

    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items() if v is not None}
    atomic_save(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    return path


def delta_norm(mod: LoraModule) -> float:
    """``‖scale · B @ A‖_F`` from the rank x rank Gram matrices (no full-size product)."""
    a, b = mod.A.double(), mod.B.double()
    return math.sqrt(max(float(((b.T @ b) * (a @ a.T)).sum()), 0.0)) * mod.scale


def delta_shares(state: LoraState) -> dict[str, float]:
    """Each LoRA module's ``‖ΔW‖`` relative to the whole LoRA's."""
    norms = {n: delta_norm(m) for n, m in state.modules.items()}
    total = math.sqrt(sum(v * v for v in norms.values())) or 1.0
    return {n: v / total for n, v in norms.items()}


def families_of(state: LoraState) -> list[str]:
    """The model families whose DiT has every module the (resolved) LoRA names; a one-line error when none has."""
    from ..models.family import FAMILIES
    from .resolve import default_module_names

    names = set(state.modules) | {n.rsplit(".", 1)[0] for n in state.full}  # (full weights: "<module>.weight")
    found, unknown = [], names
    for family in FAMILIES:
        missing = names - set(default_module_names(state, family))
        if not missing:
            found.append(family)
        elif len(missing) < len(unknown):
            unknown = missing
    if not found:
        raise ValueError(f"LoRA {state.source} names {len(unknown)} module(s) that no Qwen-Image DiT has (a LoRA of "
                         f"another model?): {listing(sorted(unknown))}")
    preset = state.metadata.get("preset", "").strip('"')
    if preset and len(found) > 1:  # a module set both families have: the trainer's preset decides
        from ..models.presets import family_of, preset_names

        if preset in preset_names() and family_of(preset).name in found:
            return [family_of(preset).name]
    return found


@dataclass
class ExportPlan:
    target: ExportTarget
    families: list[str]
    state: LoraState  # what will be written
    dropped: dict[str, str] = field(default_factory=dict)  # LoRA module -> why the runtime drops it
    shares: dict[str, float] = field(default_factory=dict)  # the source's ‖ΔW‖ shares (where something is dropped)
    dropped_full: list[str] = field(default_factory=list)  # full weights (<module>.weight/.bias) it does not apply

    @property
    def dropped_share(self) -> float:
        return math.sqrt(sum(self.shares.get(n, 0.0) ** 2 for n in self.dropped))

    def dropped_listing(self) -> str:
        return listing([f"{n} ({self.shares[n]:.1%})" for n in self.dropped])

    def full_modules(self) -> list[str]:
        """The fully trained modules among the dropped weights (a module's weight and bias count once)."""
        return sorted({n.rsplit(".", 1)[0] for n in self.dropped_full})

    def dropped_clause(self) -> str:
        """``"3 of LoRA x's 40 modules, 12.0% of its delta ‖ΔW‖: a (5.0%), ... and 2 fully trained module(s) ..."``"""
        parts = []
        if self.dropped:
            parts.append(f"{len(self.dropped)} of LoRA {self.state.source}'s {len(self.shares)} modules, "
                         f"{self.dropped_share:.1%} of its delta ‖ΔW‖: {self.dropped_listing()}")
        if self.dropped_full:
            full = self.full_modules()
            parts.append(f"{len(full)} fully trained module(s) (full weights, which {self.target.runtime} does not "
                         f"apply from a LoRA file): {listing(full)}")
        return " and ".join(parts)


def plan_export(state: LoraState, fmt: str) -> ExportPlan:
    """What ``--format fmt`` would write of ``state`` (resolved), and what its runtime would drop."""
    target = export_target(fmt)
    families = families_of(state)
    rules = [r for f in families for r in [target.rule(f)] if r is not None]
    if not rules:
        have = ", ".join(target.families) or "none"
        raise ValueError(f"--format {fmt}: {target.runtime} has no {' / '.join(families)} model (it has: {have}); "
                         f"choose another --format ({', '.join(t for t in EXPORT_TARGETS if t != fmt)})")
    for name, mod in state.modules.items():
        if mod.alpha is not None:
            checked_alpha(mod.alpha, f"LoRA {state.source}: alpha of {name}")
    dropped = {n: f"{target.runtime} puts no LoRA on this module" for n in sorted(state.modules)
               if not all(r.accepts(n) for r in rules)}
    dropped_full = [] if target.full_weights else sorted(state.full)
    for rule in rules:
        if rule.write_fused:
            for f in rule.fused:
                _check_fusable(state, f.parts, f.name)
    kept = replace(state, modules={n: m for n, m in state.modules.items() if n not in dropped},
                   full={} if not target.full_weights else dict(state.full))
    if not kept.modules and not kept.full:
        raise ValueError(f"--format {fmt}: {target.runtime} loads none of LoRA {state.source}'s modules "
                         f"({listing(list(dropped))}); train with --lora_targets serving, or choose another --format")
    return ExportPlan(target, families, kept, dropped, delta_shares(state) if dropped else {}, dropped_full)


def _check_fusable(state: LoraState, parts: tuple[str, ...], fused: str) -> None:
    groups: dict[str, set] = {}
    for n, m in state.modules.items():
        for p in parts:
            if n.endswith("." + p):
                groups.setdefault(n[: -len(p)], set()).add(int(m.B.shape[0]))
    bad = sorted(stem + fused for stem, rows in groups.items() if len(rows) > 1)
    if bad:
        raise ValueError(f"LoRA {state.source}: the parts of {listing(bad)} have different output sizes and cannot "
                         f"be fused into one {fused}; the LoRA does not match the model")


@dataclass
class ExportReport:
    path: Path
    fmt: str
    modules: int  # LoRA modules written
    full_weights: int
    dropped: dict[str, str]  # LoRA modules not written
    dropped_share: float
    max_rel_error: float
    dropped_full: list[str] = field(default_factory=list)  # full weights not written


def checked_options(fmt: str, options: dict) -> dict:
    """``options`` that ``fmt``'s writer takes; a set flag another target's writer takes is an error."""
    target = export_target(fmt)
    unknown = sorted(k for k, v in options.items() if v and k not in target.options)
    if unknown:
        takes = [t.name for t in EXPORT_TARGETS.values() if unknown[0] in t.options]
        raise ValueError(f"--{unknown[0]} does not apply to --format {fmt}; it applies to --format "
                         f"{' / '.join(takes) or '(none)'}")
    return {k: v for k, v in options.items() if k in target.options}


def export_checked(state: LoraState, out_path: str | os.PathLike, fmt: str, drop_unsupported: bool = False,
                   **options) -> ExportReport:
    """Check ``state`` against ``fmt``'s rules, write it atomically, read the file back and compare."""
    from .resolve import resolved

    target = export_target(fmt)
    options = checked_options(fmt, options)
    plan = plan_export(resolved(state), fmt)
    only_full = not plan.dropped and options.get("drop_full_weights")
    if (plan.dropped or plan.dropped_full) and not (drop_unsupported or only_full):
        raise ValueError(f"--format {fmt}: {target.runtime} would not load {plan.dropped_clause()}; pass "
                         "--drop_unsupported to write the rest"
                         + (" (--drop_full_weights: only the full weights)" if "drop_full_weights" in target.options
                            else ""))
    if plan.dropped or plan.dropped_full:
        log.warning("--format %s: dropped what %s does not load: %s", fmt, target.runtime, plan.dropped_clause())
    if "drop_full_weights" in options:
        options["drop_full_weights"] = True  # the plan has dropped (or refused) them already
    tensors = target.write_fn()(plan.state, **options)
    metadata = _metadata(plan, state)
    out = Path(out_path)
    folder = target.folder and out.suffix != ".safetensors"
    errors: list[float] = []
    if folder:
        _write_peft_folder(out, tensors, metadata, plan, errors)
    else:
        def save(tmp: Path) -> None:
            write_safetensors(tmp, tensors, metadata)
            errors.append(_read_back_error(tmp, plan))

        atomic_save(out, save)
    report = ExportReport(out, fmt, len(plan.state.modules), len(plan.state.full), plan.dropped,
                          plan.dropped_share, errors[0], plan.dropped_full)
    log.info("wrote %s LoRA %s: %d module(s)%s for %s, read back: max relative delta error %.2e", fmt, out,
             report.modules, f" + {report.full_weights} full weight(s)" if report.full_weights else "",
             " / ".join(plan.families), report.max_rel_error)
    return report


def _metadata(plan: ExportPlan, source: LoraState) -> dict[str, str]:
    # alpha is written as .alpha tensors or folded into lora_A; a copied lora_adapter_metadata, or plain
    # alpha/rank keys of the source, would make a tool apply it a second time.
    metadata = {k: v for k, v in source.metadata.items()
                if k not in ("format", "format_version", ADAPTER_METADATA_KEY) and k.lower() not in SCALE_KEYS}
    metadata.update(format=plan.target.name, converted_by=FORMAT_NAME, source_format=source.format)
    ranks = sorted(plan.state.ranks)
    if plan.target.alpha_folded and len(ranks) == 1:  # folded: the file's own scale alpha / rank is 1 (an integer)
        metadata.update(rank=str(ranks[0]), alpha=str(ranks[0]), alpha_folded_into_lora_A="true")
    return metadata


def _expected(plan: ExportPlan) -> dict[str, LoraModule]:
    """The modules the written file must hold, in the target's layout (fused where it writes fused)."""
    from .writers import fused_modules

    fused = tuple(f for r in plan.target.families.values() if r.write_fused for f in r.fused)
    return fused_modules(plan.state, fused) if fused else plan.state.modules


def _read_back_error(path: Path, plan: ExportPlan) -> float:
    """Max over modules of ``‖ΔW_file − ΔW_source‖ / ‖ΔW_source‖``; refuses a file that misses modules or errs."""
    from safetensors.torch import load_file

    from .resolve import resolved
    from .formats import parse_lora_state_dict

    tensors = load_file(str(path))
    if plan.target.name == "nunchaku":  # transformer.blocks.<n>. -> transformer.transformer_blocks.<n>.
        tensors = {k.replace("transformer.blocks.", "transformer.transformer_blocks.", 1): v for k, v in tensors.items()}
    got = resolved(parse_lora_state_dict(tensors, source=str(path)))
    want = _expected(plan)
    if set(got.modules) != set(want) or set(got.full) != set(plan.state.full):
        raise ValueError(f"the written {plan.target.name} file reads back with other modules than were written "
                         f"({listing(sorted(set(got.modules) ^ set(want)))}); nothing was written")
    worst = 0.0
    for name, mod in want.items():
        ref = mod.delta()
        worst = max(worst, float((got.modules[name].delta() - ref).norm() / ref.norm().clamp_min(1e-30)))
    for name, tensor in plan.state.full.items():
        worst = max(worst, float((got.full[name].float() - tensor.float()).norm() / tensor.float().norm().clamp_min(1e-30)))
    if not worst <= MAX_EXPORT_ERROR:
        raise ValueError(f"the written {plan.target.name} file reads back with a relative delta error of {worst:.3g} "
                         f"(more than {MAX_EXPORT_ERROR:g}); nothing was written")
    return worst


def _write_peft_folder(out: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], plan: ExportPlan,
                       errors: list[float]) -> None:
    """A PEFT adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``), built in a temporary
    folder beside ``out`` and renamed into place."""
    from ..utils.atomic import TEMP_MARK

    if out.exists():
        raise ValueError(f"OUT {out} exists; remove it or give another folder (or a .safetensors file for one file)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}-", suffix=TEMP_MARK, dir=out.parent))
    try:
        peft = {"base_model.model." + folder_name(k[len(plan.target.prefix):], plan.target): v
                for k, v in tensors.items()}
        write_safetensors(tmp / "adapter_model.safetensors", peft, metadata)
        r = max(m.rank for m in plan.state.modules.values())  # the writer padded every module to it
        targets = sorted(folder_name(n, plan.target) for n in plan.state.modules)
        config = {"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": targets, "bias": "none",
                  "lora_dropout": 0.0, "rank_pattern": {}, "alpha_pattern": {}, "use_rslora": False}
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
        errors.append(_read_back_error(tmp / "adapter_model.safetensors", plan))
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def folder_name(key: str, target: ExportTarget) -> str:
    """A module path (or a key under it) in the runtime's own module names (``target.folder_names``)."""
    for ours, theirs in target.folder_names:
        key = key.replace(ours + ".", theirs + ".")
        if key.endswith(ours):
            key = key[: -len(ours)] + theirs
    return key
