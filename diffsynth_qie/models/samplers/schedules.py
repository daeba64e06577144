"""What a sampling schedule is asked for (:class:`ScheduleSpec`), and Qwen-Image-Edit's schedules.

One route: a caller (the editor, training's validation) describes the schedule it wants in one
:class:`ScheduleSpec`; the model family's ``schedule(spec)`` (``models/family_ops.py``) returns the ready
DiffSynth ``FlowMatchScheduler``; :func:`~.sampling.sample_flow_match` asks the family for it and integrates.
No sampler builds a schedule of its own.

- **default**: DiffSynth's ``FlowMatchScheduler("Qwen-Image")`` set up as ``QwenImagePipeline.__call__`` does
  (``set_timesteps(steps, dynamic_shift_len=(H/16)·(W/16))``), so results match the pipeline (tests pin it).
- **lightning**: the schedule the Lightning few-step LoRAs were distilled with (``models/samplers/lightning.py``).
- **a fixed grid** (``spec.sigmas``, a distilled preset's ``Preset.sigmas``, e.g. 2.1-turbo, or a LoRA's declared
  schedule, ``declared.py``): those sigmas, no shift.
- ``strength`` < 1 (SDEdit): DiffSynth's ``denoising_strength``, the schedule of an edit that starts part-way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .lightning import check_scheduler


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything a family needs to build a sampling schedule.

    ``steps``: sampling steps; ``latent_hw``: the latents' height and width (the resolution-dependent shift);
    ``kind``: ``"default"`` or ``"lightning"``; ``strength``: in [0, 1], below 1 the schedule starts part-way
    (from the source noised to its first σ); ``sigmas``: a preset's fixed grid (without the final 0), or None."""

    steps: int
    latent_hw: tuple[int, int]
    kind: str = "default"
    strength: float = 1.0
    sigmas: Optional[tuple[float, ...]] = None

    def __post_init__(self):
        check_scheduler(self.kind)
        object.__setattr__(self, "latent_hw", tuple(int(s) for s in self.latent_hw))
        if self.sigmas is not None:
            object.__setattr__(self, "sigmas", tuple(float(s) for s in self.sigmas))

    @property
    def lightning(self) -> bool:
        return self.kind == "lightning"

    @classmethod
    def for_preset(cls, preset, steps: int, latent_hw: Sequence[int], kind: str = "default",
                   strength: float = 1.0, sigmas: Optional[Sequence[float]] = None) -> "ScheduleSpec":
        """The spec of ``preset`` (a :class:`~.presets.Preset` or None): ``sigmas`` (a LoRA's declared grid,
        ``declared.py``: used as given, never shifted again), else the preset's fixed grid, if it has one."""
        grid = getattr(preset, "sigmas", None) if sigmas is None else tuple(sigmas)
        return cls(int(steps), tuple(latent_hw), kind, float(strength), grid)


def flow_match_scheduler(steps: int, image_tokens: int, strength: float = 1.0,
                         sigmas: Optional[Sequence[float]] = None):
    """DiffSynth's Qwen-Image scheduler as the pipelines set it up: shifted by the image's token count
    (``dynamic_shift_len``: each family counts its own tokens), ``strength`` < 1 its ``denoising_strength``; or a
    fixed grid of ``sigmas`` (DiffSynth applies no shift to a grid).

    One step: DiffSynth stretches the shifted grid so that its last σ is 0.02 (``shift_terminal``), dividing by
    1 − σ_last, which is 0 for a one-step grid (σ = NaN, an empty edit). A one-step edit starts where the two-step
    schedule starts (σ = 1 at full strength) and jumps to 0."""
    from diffsynth.diffusion import FlowMatchScheduler

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if sigmas is not None and len(sigmas) != steps:
        raise ValueError(f"this model samples on a fixed grid of {len(sigmas)} steps; pass --steps {len(sigmas)}")
    if sigmas is not None and strength < 1.0:
        raise ValueError("--strength below 1 starts part-way through a schedule; a fixed grid (e.g. 2.1-turbo's) has "
                         "no other starting points: use a preset without one")
    scheduler = FlowMatchScheduler("Qwen-Image")
    if sigmas is not None:
        scheduler.set_timesteps(steps, sigmas=list(sigmas))
        return scheduler
    scheduler.set_timesteps(max(steps, 2), denoising_strength=strength, dynamic_shift_len=image_tokens)
    if steps == 1:
        scheduler.set_timesteps(1, sigmas=[float(scheduler.sigmas[0])])
    return scheduler


def edit_schedule(spec: ScheduleSpec):
    """Qwen-Image-Edit's scheduler for ``spec``: the default, Lightning's, or the preset's fixed grid."""
    if spec.lightning:
        from .lightning import lightning_scheduler

        if spec.sigmas is not None:
            raise ValueError("this preset samples on its own fixed grid; the Lightning schedule is for the base "
                             "model's Lightning LoRAs: use --scheduler default")
        return lightning_scheduler(spec.steps, *spec.latent_hw, spec.strength)
    height, width = spec.latent_hw[0] * 8, spec.latent_hw[1] * 8  # Qwen-Image-Edit: one token per 16×16 pixels
    return flow_match_scheduler(spec.steps, (height // 16) * (width // 16), spec.strength, spec.sigmas)
