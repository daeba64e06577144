"""How the DiT computes while it trains (``--compute_precision``): pure bf16 over fp32 masters, or autocast.

- ``pure`` (the default with bf16): the frozen DiT runs in bf16 without autocast, as it does at inference (its
  LayerNorms, modulation and attention in bf16). The trainable weights stay fp32: they are the optimizer's
  masters and their gradients accumulate in fp32. Each trainable ``nn.Linear`` (PEFT's ``lora_A``/``lora_B``,
  a linear of ``--full_finetune_modules``) casts its weight to its input's dtype per call (:class:`CastLinear`);
  any other module holding a trainable weight (an RMSNorm of ``--full_finetune_modules``) computes with it as
  it is and returns its input's dtype. The backward of the cast brings each weight gradient back to fp32.
- ``autocast``: ``torch.autocast`` around the module's forward: the matmuls in bf16, the norms and the
  modulation (and every op autocast lists as fp32) in fp32, and each of their consumers casts again. Slower
  (more bytes moved), the numerics of earlier releases.
- ``auto``: ``pure`` with bf16, ``autocast`` with fp16 (``pure`` computes in bf16 only).

Without mixed precision (fp32, the CPU runs) neither applies and nothing is changed. Under DeepSpeed the engine
holds the module in bf16 and keeps the fp32 masters itself: no autocast, nothing to cast.

Autocast belongs to the module (:attr:`QIETrainingModule.autocast_dtype`, entered in its ``forward``), not to
accelerate (whose own is switched off in ``run_setup.make_accelerator``), so every caller of the module —
``qie train``, the fake-device check, the benchmarks — computes the same way.
"""
from __future__ import annotations

import logging
from typing import Literal, Optional

import torch

log = logging.getLogger(__name__)

ComputePrecision = Literal["auto", "pure", "autocast"]
HALF = (torch.bfloat16, torch.float16)


class CastLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose (fp32 master) weight and bias are cast to the input's dtype per call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
            b = None if b is None else b.to(x.dtype)
        return torch.nn.functional.linear(x, w, b)


def _output_to_input_dtype(module, args, output):
    x = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    if x is not None and isinstance(output, torch.Tensor) and output.is_floating_point() and output.dtype != x.dtype:
        return output.to(x.dtype)
    return None


def cast_to_input(model: torch.nn.Module) -> int:
    """Make every module of ``model`` that holds a trainable weight compute in its input's dtype (see the
    module docstring); returns how many were changed. A subclass of ``nn.Linear`` holding one is refused."""
    changed = 0
    for name, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad and p.is_floating_point()]
        if not own or isinstance(m, CastLinear):
            continue
        if type(m) is torch.nn.Linear:
            m.__class__ = CastLinear
        elif isinstance(m, torch.nn.Linear):
            raise ValueError(f"{name} ({type(m).__name__}) holds a trainable weight that --compute_precision pure "
                             "cannot cast per call; pass --compute_precision autocast, or leave it out of "
                             "--full_finetune_modules")
        else:
            m.register_forward_hook(_output_to_input_dtype)
        changed += 1
    return changed


def autocast_dtype(choice: str, dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype the module's forward autocasts to for ``--compute_precision choice`` with the DiT in ``dtype``;
    None: no autocast (``pure``, or fp32)."""
    if dtype not in HALF:
        return None
    if choice == "pure" and dtype != torch.bfloat16:
        raise ValueError(f"--compute_precision pure computes in bf16, but --mixed_precision is "
                         f"{str(dtype).replace('torch.', '')}; pass --mixed_precision bf16, or --compute_precision "
                         "autocast (or auto)")
    if choice == "autocast" or (choice == "auto" and dtype != torch.bfloat16):
        return dtype
    if choice not in ("auto", "pure"):
        raise ValueError(f"unknown --compute_precision {choice!r}; use auto, pure or autocast")
    return None


def apply_precision(module, dtype: torch.dtype, choice: str) -> Optional[torch.dtype]:
    """Set a (single-process or DDP) training module's precision, its DiT loaded in ``dtype``: the trainable
    weights in fp32, and either the casts of ``pure`` or the autocast dtype of its forward. Returns that dtype."""
    module.upcast_trainable(torch.float32)  # fp32 trainable weights: the optimizer's masters
    module.autocast_dtype = autocast_dtype(choice, dtype)
    if dtype in HALF:
        module.disable_lora_input_casting()  # PEFT's fp32 copy of each adapted input would be cast back at once
        if module.autocast_dtype is None:
            cast_to_input(module.dit)
    return module.autocast_dtype
