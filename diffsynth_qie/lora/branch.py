"""Unmerged LoRAs: an adapter branch on each targeted linear, the base weight never written.

A targeted module computes ``y = W x + b + sum_i s_i * B_i (A_i x)``, where ``s_i`` is the
LoRA's scale times its own ``alpha / rank``. The branch is a forward hook on the module,
so the module class, its parameters and its ``state_dict`` are unchanged; ``A`` and ``B``
are non-persistent buffers of the module, so they follow it when the model is moved
(``Editor``'s ``cpu_offload``, ``.to(device)``) and never appear in a saved state dict.

Cost compared with merging (``apply.merge_matched``):

- memory: the LoRA's own tensors (``rank * (in + out)`` values per module) instead of
  a backup of every touched weight (``in * out`` values per module);
- switching a LoRA or its scale writes no weight, and removing it leaves the base
  weights bit-identical (same tensors, same storage);
- time: two thin matmuls per targeted linear per forward (rank ``r`` against the
  weight's ``in * out``), a few percent of the DiT's work at usual ranks. Merge
  (``qie edit --lora_merge``) when the same LoRA serves many edits.

Full-weight entries of a LoRA file (modules trained fully, e.g. ``img_in.bias``) have
no low-rank form: they can only be merged, and whoever merges them keeps a backup of
exactly those parameters (``LoraManager`` does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from .state import LoraModule

_PREFIX = "qie_lora"
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MODES = ("merged", "unmerged")


@dataclass
class Adapter:
    """One LoRA's branch on one module; ``scale`` may change at any time."""

    key: str          # buffer-name stem on the module
    scale: float      # user scale * alpha / rank


def _adapters(module: torch.nn.Module) -> list[Adapter]:
    return module.__dict__.setdefault("_qie_lora_adapters", [])


def _branch_hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    x = inputs[0]
    for adapter in _adapters(module):
        if adapter.scale == 0.0:
            continue
        # no-ops unless the weights are onloaded per layer (DiffSynth's VRAM management)
        a = getattr(module, f"{adapter.key}_A").to(x.device)
        b = getattr(module, f"{adapter.key}_B").to(x.device)
        h = torch.nn.functional.linear(torch.nn.functional.linear(x.to(a.dtype), a), b)
        output = output + (h * adapter.scale).to(output.dtype)
    return output


def adapter_dtype(weight: torch.Tensor, module: torch.nn.Module | None = None) -> torch.dtype:
    """The dtype adapters are held and computed in: the weight's; for a quantised (FP8) weight, the dtype the
    layer's bias is kept in (the model's compute dtype: fp32 on CPU, bf16 on GPU), else bf16."""
    if weight.dtype in _COMPUTE_DTYPES:
        return weight.dtype
    bias = getattr(module, "bias", None)
    return bias.dtype if isinstance(bias, torch.Tensor) and bias.dtype in _COMPUTE_DTYPES else torch.bfloat16


def attach(module: torch.nn.Module, lora: LoraModule, scale: float) -> Adapter:
    """Add ``lora``'s branch to ``module`` (a matched linear) and return its handle.

    ``A``/``B`` are stored on the weight's device in :func:`adapter_dtype` (no copy when
    they already are). Several branches on one module add up, in attach order.
    """
    weight = module.weight
    dtype = adapter_dtype(weight, module)
    adapters = _adapters(module)
    index = 0
    while hasattr(module, f"{_PREFIX}{index}_A"):
        index += 1
    adapter = Adapter(key=f"{_PREFIX}{index}", scale=float(scale) * lora.scale)
    module.register_buffer(f"{adapter.key}_A", lora.A.to(device=weight.device, dtype=dtype), persistent=False)
    module.register_buffer(f"{adapter.key}_B", lora.B.to(device=weight.device, dtype=dtype), persistent=False)
    if not adapters:
        module.__dict__["_qie_lora_hook"] = module.register_forward_hook(_branch_hook)
    adapters.append(adapter)
    return adapter


def detach_all(module: torch.nn.Module) -> None:
    """Remove every branch from ``module``; the module is exactly as before :func:`attach`."""
    for adapter in _adapters(module):
        del module._buffers[f"{adapter.key}_A"], module._buffers[f"{adapter.key}_B"]
    module.__dict__.pop("_qie_lora_adapters", None)
    hook = module.__dict__.pop("_qie_lora_hook", None)
    if hook is not None:
        hook.remove()


def branch_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The adapter tensors ``module`` holds (for memory accounting)."""
    return [getattr(module, f"{a.key}_{s}") for a in _adapters(module) for s in ("A", "B")]


def misplaced_branch(model: torch.nn.Module, what: str) -> str | None:
    """One line about the first branch of ``model`` that is not on the device of its layer's weight (``what``:
    who attached the branches, for the line), or None when every branch sits with its weight. A branch left on
    the host while the weight is on the GPU is copied to the GPU by :func:`_branch_hook` at every forward."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        for tensor in branch_tensors(module):
            if isinstance(weight, torch.Tensor) and tensor.device != weight.device:
                return (f"LoRA branch off its layer's device: {what} left the branch of {name} "
                        f"({tuple(tensor.shape)}, {str(tensor.dtype).replace('torch.', '')}) on {tensor.device} while "
                        f"the layer's weight is on {weight.device}: on a GPU every forward copies it to the device "
                        "again, or fails on a device mismatch where nothing moves it; register the branch where the "
                        "weight is (lora.branch.attach)")
    return None


# --- memory ---------------------------------------------------------------------------
def matches_target(name: str, targets: Iterable[str]) -> bool:
    """PEFT's ``target_modules`` rule: the module path equals a target or ends with ``.target``."""
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_host_bytes(model: torch.nn.Module, rank: int, targets: Iterable[str], mode: str,
                    dtype: torch.dtype | None = None) -> int:
    """Bytes one rank-``rank`` LoRA on ``targets`` adds to a loaded ``model`` in ``mode``.

    - ``"unmerged"``: the adapters, ``rank * (in + out)`` values per targeted linear
      (on the DiT's device; ``LoraManager`` also caches the file as read, the same size
      again in the file's dtype, on the host);
    - ``"merged"``: the backup of every touched weight, ``in * out`` values per targeted
      linear, on the host, plus the cached LoRA itself (``rank * (in + out)``).

    Values are counted in ``dtype`` (default: the weight's dtype for the backup, its
    :func:`adapter_dtype` for the LoRA).
    Works on a model built on the ``meta`` device (only shapes are read). Full-weight
    entries and biases are not counted (a LoRA file rarely has them).
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if rank < 1:
        raise ValueError(f"rank {rank} must be >= 1")
    targets = list(targets)
    lora = backup = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not matches_target(name, targets):
            continue
        out_dim, in_dim = weight.shape
        lora += rank * (in_dim + out_dim) * (dtype or adapter_dtype(weight)).itemsize
        backup += in_dim * out_dim * (dtype or weight.dtype).itemsize
    return lora if mode == "unmerged" else lora + backup
