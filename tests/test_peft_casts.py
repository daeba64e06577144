"""Under bf16 autocast the training module skips PEFT's fp32 copy of every adapted layer's input: the same
loss, no casts."""
from __future__ import annotations

import dataclasses

import torch
from peft.tuners.tuners_utils import BaseTunerLayer


def test_no_peft_input_casts_under_autocast_and_the_same_loss(monkeypatch):
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.tiny.build import DIT_SIZES, TinyQwenImageDiT
    from diffsynth_qie.training.config import RunConfig
    from diffsynth_qie.training.module import QIETrainingModule

    casts = []
    real = BaseTunerLayer._cast_input_dtype

    def spy(self, x, dtype):
        out = real(self, x, dtype)
        if out.dtype != x.dtype:
            casts.append((x.dtype, out.dtype))
        return out

    monkeypatch.setattr(BaseTunerLayer, "_cast_input_dtype", spy)
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, model="tiny", cache_dir="-", output_dir="-",
                                                             cfg_dropout=0.0, gradient_checkpointing=True),
                              lora=dataclasses.replace(cfg.lora, lora_rank=4)).resolved(get_preset("tiny"))
    torch.manual_seed(0)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            dit = TinyQwenImageDiT(**DIT_SIZES)
        finally:
            torch.set_default_dtype(torch.float32)
    module = QIETrainingModule(dit, cfg, "tiny")
    module.upcast_trainable(torch.float32)
    g = torch.Generator().manual_seed(0)
    batch = {"target_latents": [torch.randn(16, 8, 8, generator=g).bfloat16()],
             "edit_latents": [[torch.randn(16, 8, 8, generator=g).bfloat16()]],
             "prompt_emb": [torch.randn(7, DIT_SIZES["text_dim"], generator=g).bfloat16()], "back_mask": [None]}

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value, _ = module(batch, torch.Generator().manual_seed(1))
        value.backward()
        return value.detach()

    with_casts = loss()
    assert casts, "PEFT cast the bf16 inputs to fp32 before the fix"
    casts.clear()
    assert module.disable_lora_input_casting() > 0
    without = loss()
    assert casts == []
    assert torch.equal(with_casts, without)
