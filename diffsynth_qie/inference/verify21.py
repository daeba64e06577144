"""The DiT part of one Qwen-Image-2.1 edit at full size on the fake CUDA device.

It runs what :meth:`Editor._sample` runs for 2.1, through the family seam (``models/family_ops.py``): the
conditioning on the device, ``velocity21`` with the prefix KV cache (one per prompt, two with CFG), the
family's schedule and our flow-matching sampler, on the preset's real DiT built on the fake device with
unmerged LoRA branches, and DiffSynth's 2.1 DiT under the host bookkeeping of ``memory/standin21.py``.
What it leaves out: the Qwen3-VL prompt encoder and the VAE (their weights and working sets are not
counted here); the prompt embeddings are blank tensors of the encoder's length, the references' latents
blank tensors of their size, and the slot mask is laid out on the host as the encoder gives it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..memory.fake_device import FakeCuda
from ..memory.standin21 import host_bookkeeping21, kv_bytes_per_prefix_token, kv_cache_bytes, slot_mask21

DEVICE = "cuda:0"


@dataclass
class Edit21VerifyReport:
    weights: int = 0           # DiT + LoRA branches on the device
    denoise_peak: int = 0      # the denoising steps (both CFG passes), KV caches included
    kv_cache: int = 0          # the prefix KV caches at the end (one per prompt)
    kv_per_prefix_token: int = 0  # bytes of one prefix token's keys and values in every block, per prompt
    prefix_tokens: int = 0     # text + reference tokens of the positive prompt
    seconds: float = 0.0


def verify_edit21(preset, resolution: int = 1024, ref_images: int = 1, prompt_tokens: int = 300, steps: int = 2,
                  cfg: float = 1.0, lora_rank: int = 0, num_layers: Optional[int] = None,
                  kv_cache: bool = True) -> Edit21VerifyReport:
    """Sample ``steps`` steps of a ``resolution``² 2.1 edit with ``ref_images`` references of the same size on
    the fake device; raises :class:`~..memory.fake_device.FakeRunError` where a GPU run would fail or stall."""
    from ..memory.census import build_dit
    from ..models.family_ops import ops_for
    from ..models.presets import family_of
    from ..models.samplers.sampling import sample_flow_match, seeded_noise, uses_cfg
    from ..models.samplers.schedules import ScheduleSpec

    t0 = time.perf_counter()
    report = Edit21VerifyReport()
    family, dtype = family_of(preset), torch.bfloat16
    ops = ops_for(family)
    with FakeCuda() as fc, host_bookkeeping21():
        with fc.build(dtype, DEVICE):
            dit = build_dit(preset, num_layers).requires_grad_(False)
        fc.register(dit)
        if lora_rank:
            _attach_lora(dit, preset.lora_target_modules, lora_rank)
        report.weights = fc.current_bytes
        latent_hw = family.latent_size(resolution, resolution)
        refs = [torch.empty(family.latent_channels, *latent_hw, device=DEVICE, dtype=dtype)
                for _ in range(ref_images)]
        text_dim = dit.txt_in.in_layer.in_features

        def prompt(tokens: int):  # as the cache / the encoder gives it: embeddings, the slot mask on the host
            pad = slot_mask21([latent_hw] * ref_images, tokens)
            return ops.join_prompt(torch.empty(len(pad), text_dim, device=DEVICE, dtype=dtype), {"pad": pad})

        positive = prompt(prompt_tokens)
        report.prefix_tokens = int((~positive.pad_mask).sum()) + 4 * int(positive.pad_mask.sum())  # 4 latents a slot
        negatives = [prompt(0)] if uses_cfg(cfg) else None
        to_dit = lambda t: t.to(device=DEVICE, dtype=dtype)  # noqa: E731
        cond = ops.conditioning([positive], negatives, [refs], False, to_dit)
        cond.kv_cache = kv_cache
        with fc.phase("denoise"):
            noise = seeded_noise((1, family.latent_channels, *latent_hw), 0, dtype, DEVICE)
            sample_flow_match(ops.velocity(dit, cond, cfg), noise, ScheduleSpec.for_preset(preset, steps, latent_hw),
                              ops.schedule)
        report.denoise_peak = fc.phases[-1].peak_bytes
        report.kv_cache = kv_cache_bytes(cond._caches.values())
        report.kv_per_prefix_token = kv_bytes_per_prefix_token(dit)
        del cond, dit, refs, positive, negatives
    report.seconds = time.perf_counter() - t0
    return report


def _attach_lora(dit, targets, rank: int) -> None:
    """Unmerged LoRA branches of ``rank`` on ``targets``, as ``qie edit --lora`` attaches them."""
    from ..lora.branch import attach
    from ..lora.state import LoraModule

    for name, module in dit.named_modules():
        if hasattr(module, "in_features") and any(name == t or name.endswith("." + t) for t in targets):
            a = torch.empty(rank, module.in_features, device=DEVICE, dtype=torch.bfloat16)
            b = torch.empty(module.out_features, rank, device=DEVICE, dtype=torch.bfloat16)
            attach(module, LoraModule(a, b), 1.0)
