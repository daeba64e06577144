"""DiffSynth's stock LoRA training step at batch 1, rebuilt from the wheel's pieces (the baseline of ``train_step``).

The wheel ships no ``examples/``, so the step is chained as DiffSynth-Studio's
``examples/qwen_image/model_training/train.py`` and ``diffusion/runner.py:
launch_training_task`` chain it: the scheduler in training mode,
``FlowMatchSFTLoss(pipe, **cached_inputs)`` driving ``model_fn_qwen_image``,
``backward``, AdamW ``step``, ``ConstantLR.step``, ``zero_grad``.
"""
from __future__ import annotations

from typing import Callable

import torch


def stock_inputs(entry: dict, gradient_checkpointing: bool) -> dict:
    """The cached input dict DiffSynth's ``sft:train`` feeds ``FlowMatchSFTLoss`` (batch 1, 2511)."""
    h, w = entry["target"].shape[-2:]
    return {
        "input_latents": entry["target"][None], "edit_latents": [r[None] for r in entry["refs"]],
        "prompt_emb": entry["prompt"][None],
        "prompt_emb_mask": torch.ones(1, entry["prompt"].shape[0], dtype=torch.long, device=entry["prompt"].device),
        "height": int(h) * 8, "width": int(w) * 8, "zero_cond_t": True, "edit_rope_interpolation": False,
        "use_gradient_checkpointing": gradient_checkpointing, "use_gradient_checkpointing_offload": False,
        "cfg_scale": 1,
    }


def stock_pipeline(dit, device, dtype):
    """A ``QwenImagePipeline`` holding only the DiT, its scheduler in training mode (as DiffSynth's trainer)."""
    from diffsynth.pipelines.qwen_image import QwenImagePipeline, QwenImageBlockwiseMultiControlNet

    pipe = QwenImagePipeline(device=str(device), torch_dtype=dtype)
    pipe.dit = dit
    pipe.blockwise_controlnet = QwenImageBlockwiseMultiControlNet([])
    pipe.scheduler.set_timesteps(1000, training=True)
    return pipe


def make_stock_step(pipe, params, entry, gradient_checkpointing: bool, inputs: dict | None = None
                    ) -> tuple[Callable[[], torch.Tensor], torch.optim.Optimizer]:
    """DiffSynth's step: ``FlowMatchSFTLoss`` + backward + AdamW + ``ConstantLR`` (runner.py's defaults), on
    ``inputs`` (default: the 2511 inputs of ``entry``; ``train21.py`` passes the 2.1 pipeline's)."""
    from diffsynth.diffusion.loss import FlowMatchSFTLoss

    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer)
    inputs = inputs if inputs is not None else stock_inputs(entry, gradient_checkpointing)

    def step() -> torch.Tensor:
        loss = FlowMatchSFTLoss(pipe, **inputs)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return loss.detach()

    return step, optimizer
