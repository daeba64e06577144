"""Applying a :class:`LoraState` to a model: check it fits, then merge ``W += s * alpha/r * B @ A``.

Also converts a LoRA to PEFT's parameter names, to resume training from it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from .state import LoraModule, LoraState, problems

log = logging.getLogger(__name__)

# A real LoRA changes a weight by a fraction of its norm; see :func:`_check_delta`.
MAX_DELTA_RATIO = 100.0


@dataclass
class LoadReport:
    """What :func:`apply_lora` changed: LoRA deltas merged and full weights loaded."""

    source: str
    format: str
    scale: float
    lora_modules: list[str]
    full_weights: list[str]

    def summary(self) -> str:
        text = (f"LoRA {self.source} ({self.format}, scale {self.scale:g}): "
                f"{len(self.lora_modules)} module(s) with a LoRA delta")
        if self.full_weights:
            text += f", {len(self.full_weights)} full weight(s) loaded: {', '.join(self.full_weights)}"
        return text



def match_lora(model: torch.nn.Module, state: LoraState) -> LoraState:
    """Resolve ``state``'s names against ``model`` and check every tensor fits.

    Raises ``ValueError`` naming LoRA modules / full weights the model lacks, modules
    without a 2-D weight, and shape mismatches. Nothing is modified.
    """
    modules = dict(model.named_modules())
    state = state.resolve(modules.keys())
    params = dict(model.named_parameters())
    missing, not_linear, mismatched = [], [], []
    for name, mod in state.modules.items():
        target = modules.get(name)
        weight = getattr(target, "weight", None) if target is not None else None
        if target is None:
            missing.append(name)
        elif not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            not_linear.append(name)
        elif tuple(weight.shape) != (mod.B.shape[0], mod.A.shape[1]):
            mismatched.append(f"{name} (LoRA {mod.B.shape[0]}x{mod.A.shape[1]} vs weight "
                              f"{weight.shape[0]}x{weight.shape[1]})")
        else:  # a quantised (FP8) layer is checked against the weight it stands for
            _check_delta(name, mod, target.dequantized() if hasattr(target, "dequantized") else weight, state.source)
    for name, tensor in state.full.items():
        if name not in params:
            missing.append(name)
        elif params[name].shape != tensor.shape:
            mismatched.append(f"{name} ({tuple(tensor.shape)} vs {tuple(params[name].shape)})")
    if missing or not_linear or mismatched:
        raise ValueError(f"LoRA {state.source} does not match the model ({type(model).__name__}): "
                         + problems(("key(s) not found in the model", missing),
                                    ("module(s) without a 2-D weight", not_linear),
                                    ("shape mismatch(es)", mismatched))
                         + ". Check that the LoRA was trained for this model/preset.")
    return state


@torch.no_grad()
def _check_delta(name: str, mod: LoraModule, weight: torch.Tensor, source: str) -> None:
    """Refuse a delta whose norm exceeds ``MAX_DELTA_RATIO`` times the weight's (at least 1).

    A real LoRA changes a weight by a fraction of its norm; a hundred times the weight
    wipes out the model (all-black images). The cheap bound ``|scale| |B| |A|`` avoids
    computing the delta for every module.
    """
    from torch._subclasses.fake_tensor import is_fake

    if weight.device.type == "meta" or is_fake(weight):  # no values to bound (the preflight's fake device)
        return
    limit = MAX_DELTA_RATIO * max(float(torch.linalg.vector_norm(weight, dtype=torch.float32)), 1.0)
    bound = abs(mod.scale) * float(torch.linalg.vector_norm(mod.A, dtype=torch.float32)) \
        * float(torch.linalg.vector_norm(mod.B, dtype=torch.float32))
    if math.isfinite(bound) and bound <= limit:
        return
    norm = float(torch.linalg.vector_norm(mod.delta(weight.device)))
    if not math.isfinite(norm) or norm > limit:
        raise ValueError(f"LoRA {source}: the delta for {name} has norm {norm:.3g}, more than "
                         f"{MAX_DELTA_RATIO:g} times the weight's ({limit / MAX_DELTA_RATIO:.3g}); "
                         f"check its alpha ({mod.alpha}) and rank ({mod.rank}), or the file is damaged.")


@torch.no_grad()
def merge_matched(model: torch.nn.Module, state: LoraState, scale: float) -> None:
    """Add the deltas / load the full weights of an already matched ``state``."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for name, mod in state.modules.items():
        weight = modules[name].weight
        delta = mod.delta(weight.device)
        if scale != 1.0:
            delta = delta * scale
        weight.add_(delta.to(weight.dtype))
    for name, tensor in state.full.items():
        param = params[name]
        value = tensor.to(device=param.device, dtype=param.dtype)
        if scale == 1.0:
            param.copy_(value)
        else:  # treat the trained weight as a delta from the current one
            param.lerp_(value, scale)


def apply_lora(model: torch.nn.Module, state: LoraState, scale: float = 1.0) -> LoadReport:
    """Merge ``state`` into ``model``'s weights (``W += scale * alpha/rank * B @ A``).

    Full module weights are copied (at ``scale != 1`` interpolated from the current
    weight). The whole LoRA is checked before any weight changes.
    """
    state = match_lora(model, state)
    merge_matched(model, state, scale)
    report = LoadReport(source=state.source, format=state.format, scale=scale,
                        lora_modules=sorted(state.modules), full_weights=sorted(state.full))
    log.info("%s", report.summary())
    return report


def peft_state_dict(state: LoraState, peft_scale: float = 1.0, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """Keys for ``model.load_state_dict(strict=False)`` on a PEFT-injected model.

    PEFT computes ``lora_alpha / r * B @ A``; ``peft_scale`` is that factor of the
    model being trained, and each module's own ``alpha / rank`` is folded into
    ``lora_A`` so training resumes from exactly the LoRA's delta. Full weights keep
    their plain names (a module both PEFT-wrapped and fully trained would need PEFT's
    ``base_layer`` inserted; that is the caller's concern).
    """
    assert not state.underscore_names, "resolve() kohya names before converting"
    out: dict[str, torch.Tensor] = {}
    for name, mod in state.modules.items():
        out[f"{name}.lora_A.{adapter_name}.weight"] = mod.A * (mod.scale / peft_scale)
        out[f"{name}.lora_B.{adapter_name}.weight"] = mod.B
    out.update(state.full)
    return out

