"""One Qwen-Image-2.1 training step at full size on the fake CUDA device.

The same step as :func:`.verify.verify_train_step` (the preset's real DiT built on the fake device,
:class:`~.module.QIETrainingModule` with the run's LoRA, the configured loss under bf16 autocast, ``backward``,
the optimizer's step), with what 2.1 differs in: the batch is shaped like a 2.1 cache batch (per sample a
target latent ``[64, H/16, W/16]``, reference latents, a prompt embedding ``[L, 4096]`` and the references'
slot mask ``[L]`` on the host, as the cache gives it; :func:`~..memory.standin21.slot_mask21` lays it out),
and DiffSynth's 2.1 DiT runs with the host bookkeeping of ``memory/standin21.py``.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from ..memory.fake_device import FakeCuda, backward
from ..memory.standin21 import host_bookkeeping21, slot_mask21
from .verify import DEVICE, SampleShape, StepReport


def fake_batch21(shapes: Sequence[SampleShape], family, text_dim: int, dtype: torch.dtype) -> dict:
    """A collated 2.1 batch: latents and prompt embeddings on the fake device, the slot masks on the host."""
    def lat(h: int, w: int) -> torch.Tensor:
        return torch.empty(family.latent_channels, *family.latent_size(h, w), device=DEVICE, dtype=dtype)

    pads = [slot_mask21([family.latent_size(h, w) for h, w in s.refs], s.prompt_tokens) for s in shapes]
    return {
        "target_latents": [lat(s.height, s.width) for s in shapes],
        "edit_latents": [[lat(h, w) for h, w in s.refs] for s in shapes],
        "prompt_emb": [torch.empty(len(p), text_dim, device=DEVICE, dtype=dtype) for p in pads],
        "prompt_extras": [{"pad": p} for p in pads],  # the family's prompt tensors (Family.prompt_tensors)
        "back_mask": [None for _ in shapes],
        "index": list(range(len(shapes))),
    }


def verify_train_step21(cfg, preset, shapes: Sequence[SampleShape], num_layers: Optional[int] = None,
                        dtype: torch.dtype = torch.bfloat16) -> StepReport:
    """One optimizer step of ``cfg`` (a resolved ``RunConfig`` of a 2.1 preset) on the fake device; raises
    :class:`~..memory.fake_device.FakeRunError` where a GPU run would fail or stall. ``num_layers``: a
    shallower DiT."""
    from ..memory.census import build_dit
    from ..models.presets import family_of
    from .module import QIETrainingModule
    from .optim import build_optimizer

    t0 = time.perf_counter()
    report = StepReport()
    family = family_of(preset)
    with FakeCuda() as fc, host_bookkeeping21():
        torch.manual_seed(cfg.train.seed)
        with fc.build(dtype, DEVICE):
            dit = build_dit(preset, num_layers)
            module = QIETrainingModule(dit, cfg, preset.name)
        if cfg.train.fp8_base:
            module.quantize_frozen_base(DEVICE)
        module.upcast_trainable(torch.float32)
        module.disable_lora_input_casting()
        fc.register(module)
        optimizer = build_optimizer(module.trainable_modules(), cfg.optim)
        report.weights = fc.current_bytes
        batch = fake_batch21(shapes, family, module.dit.txt_in.in_layer.in_features, dtype)
        generator = torch.Generator().manual_seed(cfg.train.seed)
        with fc.phase("forward + backward"):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = module(batch, generator)
            report.loss_dtype = str(loss.dtype).replace("torch.", "")
            backward(loss)
        del loss, batch
        report.after_backward = fc.current_bytes
        report.forward_backward_peak = fc.phases[-1].peak_bytes
        with fc.phase("optimizer step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        report.after_step = fc.current_bytes
        report.optimizer_peak = fc.phases[-1].peak_bytes
        del module, optimizer, dit
    report.seconds = time.perf_counter() - t0
    return report
