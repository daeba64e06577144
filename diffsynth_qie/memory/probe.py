"""Measured memory of one tiny training step on the CPU: what ``qie plan`` is calibrated against.

A tiny ``QwenImageDiT`` (DiffSynth's own blocks, ``tiny/build.py``) with a PEFT LoRA runs one
forward + backward of ``dit_forward`` under ``torch.profiler`` with ``profile_memory=True``; the
peak of the running sum of every allocation and free during the step is what the step needs on
top of the weights (activations kept for backward, transients, the LoRA gradients). The same
code path runs on a GPU, where ``torch.cuda.max_memory_allocated`` measures the same quantity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.forward import dit_forward
from ..models.presets import DEFAULT_LORA_TARGETS
from ..tiny.build import DIT_SIZES, TinyQwenImageDiT


@dataclass(frozen=True)
class ProbeCase:
    """One measured step: tiny DiT depth, square resolution in pixels, references, prompt tokens."""

    num_layers: int = 2
    resolution: int = 128
    ref_images: int = 1
    prompt_tokens: int = 40
    batch_size: int = 1
    lora_rank: int = 4
    gradient_checkpointing: bool = False

    @property
    def tokens_per_sample(self) -> int:
        per_image = (self.resolution // 16) ** 2
        return per_image * (1 + self.ref_images) + self.prompt_tokens


def tiny_lora_dit(num_layers: int, lora_rank: int, targets=DEFAULT_LORA_TARGETS, seed: int = 0):
    """A random tiny DiT (fp32) with a PEFT LoRA on ``targets``; base frozen."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(seed)
    dit = TinyQwenImageDiT(**{**DIT_SIZES, "num_layers": num_layers})
    dit.requires_grad_(False)
    return inject_adapter_in_model(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=list(targets)), dit)


def _step(dit, case: ProbeCase, generator: torch.Generator) -> None:
    h = case.resolution // 8  # latent side (8x VAE)
    text_dim = DIT_SIZES["text_dim"]
    b = case.batch_size
    latents = [torch.randn(16, h, h, generator=generator) for _ in range(b)]
    edits = [[torch.randn(16, h, h, generator=generator) for _ in range(case.ref_images)] for _ in range(b)]
    prompts = [torch.randn(case.prompt_tokens, text_dim, generator=generator) for _ in range(b)]
    timesteps = torch.rand(b, generator=generator) * 1000
    out = dit_forward(dit, latents, timesteps, prompts, edits,
                      use_gradient_checkpointing=case.gradient_checkpointing)
    torch.stack([o.pow(2).mean() for o in out]).sum().backward()


def measure_step_peak(case: ProbeCase, dit=None) -> int:
    """Peak bytes allocated during one forward + backward of ``case`` (weights excluded)."""
    from torch.profiler import ProfilerActivity, profile

    dit = dit if dit is not None else tiny_lora_dit(case.num_layers, case.lora_rank)
    generator = torch.Generator().manual_seed(0)
    _step(dit, case, generator)  # warm-up: lazy buffers (RoPE tables) are not step memory
    dit.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(dit, case, generator)
    dit.zero_grad(set_to_none=True)
    # Allocations are attributed to the op that made them (net of its own frees); frees of
    # tensors made earlier are separate "[memory]" events. Their running sum in time order is
    # the live-bytes timeline of the step.
    running = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        running += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, running)
    return int(peak)


def tiny_census(num_layers: int, targets=DEFAULT_LORA_TARGETS):
    from .census import census_from_module

    with torch.device("meta"):
        dit = TinyQwenImageDiT(**{**DIT_SIZES, "num_layers": num_layers})
    return census_from_module(dit, targets)


def predicted_step_bytes(case: ProbeCase) -> int:
    """The planner's prediction of what :func:`measure_step_peak` measures (the activation term)."""
    from .plan import PlanOptions, activation_bytes

    census = tiny_census(case.num_layers)
    opts = PlanOptions(resolution=case.resolution, ref_images=case.ref_images, prompt_tokens=case.prompt_tokens,
                       batch_size=case.batch_size, lora_rank=case.lora_rank,
                       gradient_checkpointing=case.gradient_checkpointing, dtype_bytes=4)
    return activation_bytes(census, opts)


CALIBRATION_CASES: tuple[ProbeCase, ...] = (
    ProbeCase(), ProbeCase(gradient_checkpointing=True),
    ProbeCase(batch_size=2), ProbeCase(batch_size=2, gradient_checkpointing=True),
    ProbeCase(resolution=256), ProbeCase(ref_images=2, prompt_tokens=100),
    ProbeCase(lora_rank=32), ProbeCase(num_layers=6), ProbeCase(num_layers=6, gradient_checkpointing=True),
)


def calibration_table(cases: tuple[ProbeCase, ...] = CALIBRATION_CASES) -> str:
    """Predicted vs measured step memory on the tiny model, one row per case (markdown)."""
    lines = ["| blocks | res | refs | prompt | batch | rank | ckpt | predicted KiB | measured KiB | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for case in cases:
        pred, meas = predicted_step_bytes(case), measure_step_peak(case)
        lines.append(f"| {case.num_layers} | {case.resolution} | {case.ref_images} | {case.prompt_tokens} | "
                     f"{case.batch_size} | {case.lora_rank} | {'yes' if case.gradient_checkpointing else 'no'} | "
                     f"{pred / 1024:.0f} | {meas / 1024:.0f} | {(pred - meas) / meas:+.1%} |")
    return "\n".join(lines)
