"""Our LoRA training step, as ``train_step`` times it: the training module built as ``qie train`` builds it, with
what ``training/loop.py`` does around it (backward, gradient clipping, AdamW, ``zero_grad``) without accelerate, on
synthetic cache entries; and the parity check of our loss against DiffSynth's stock one (``stock_step.py``)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from benchmarks.flops import SampleShape
from benchmarks.stock_step import stock_inputs


def make_samples(samples: Sequence[SampleShape], text_dim: int, seed: int, device, dtype) -> list[dict]:
    """Synthetic cache entries: target latents, reference latents, prompt embedding (CPU RNG, then moved)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        out.append({
            "target": torch.randn(16, *s.target, generator=gen).to(device, dtype),
            "refs": [torch.randn(16, *hw, generator=gen).to(device, dtype) for hw in s.refs],
            "prompt": torch.randn(s.text_len, text_dim, generator=gen).to(device, dtype),
        })
    return out


def ours_batch(entries: Sequence[dict]) -> dict:
    """The collated batch our loss takes (``training/data.py``'s layout)."""
    return {"target_latents": [e["target"] for e in entries], "edit_latents": [e["refs"] for e in entries],
            "prompt_emb": [e["prompt"] for e in entries], "back_mask": [None] * len(entries)}


def our_module(dit, rank: int, gradient_checkpointing: bool, batch_size: int, device="cpu",
               dtype: torch.dtype = torch.float32, compute_precision: str = "auto", fp8_base: bool = False,
               model: str = "2511"):
    """Our training module for ``model`` (injects the LoRA into ``dit``, on ``device`` in ``dtype``, in place),
    built by ``qie train``'s own builder (``training.placement.training_module``): fp32 LoRA weights, PEFT's
    input casts off and ``--compute_precision`` (the module's forward owns its autocast), the FP8 base."""
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.config import LoRAConfig, RunConfig, TrainConfig
    from diffsynth_qie.training.placement import training_module

    cfg = RunConfig(train=TrainConfig(cache_dir="(benchmark)", output_dir="(benchmark)", model=model,
                                      gradient_checkpointing=gradient_checkpointing, batch_size=batch_size,
                                      compute_precision=compute_precision, fp8_base=fp8_base),
                    lora=LoRAConfig(lora_rank=rank)).resolved(get_preset(model))
    return training_module(dit, cfg, model, torch.device(device), dtype)


def set_checkpointing(module, on: bool) -> None:
    module.config = dataclasses.replace(module.config, train=dataclasses.replace(module.config.train,
                                                                                 gradient_checkpointing=on))


def set_lora_dtype(params: Sequence[torch.nn.Parameter], dtype: torch.dtype) -> None:
    for p in params:
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


def make_ours_step(module, entries, seed: int) -> tuple[Callable[[], torch.Tensor], torch.optim.Optimizer]:
    """Our training step (``training/loop.py`` without accelerate): loss (under the module's own precision),
    backward, clip, AdamW (fused on a GPU, as ``qie train`` builds it)."""
    from diffsynth_qie.training.optim import build_optimizer

    params = list(module.trainable_modules())
    optimizer = build_optimizer(params, module.config.optim)
    max_norm = module.config.optim.resolved().max_grad_norm
    batch = ours_batch(entries)
    gen = torch.Generator().manual_seed(seed)

    def step() -> torch.Tensor:
        loss, _ = module(batch, gen)
        loss.backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, optimizer


def parity_losses(module, pipe, entry, seed: int) -> tuple[float, float]:
    """(ours, stock) loss of one sample at ``seed``, no update: both draw σ then noise from that seed.

    Ours draws from a CPU generator seeded ``seed``; DiffSynth's loss from the global
    RNG, re-seeded to ``seed`` — the same CPU stream, so on CPU both see the same σ
    and noise (on CUDA, ``randn_like`` uses the GPU generator: no parity there).
    """
    from diffsynth.diffusion.loss import FlowMatchSFTLoss

    set_checkpointing(module, False)
    with torch.no_grad():
        ours, _ = module(ours_batch([entry]), torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        stock = FlowMatchSFTLoss(pipe, **stock_inputs(entry, False))
    return float(ours), float(stock)
