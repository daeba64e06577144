"""Predicted GPU time of a training step or an edit: the fake-device run's counted kernels on a GPU's table.

The step (or the edit) runs at full width on the fake device with its kernels counted (``fakegpu/costs.py``),
at two depths as the preflight runs it; every block runs the same kernels, so the difference is one block's
share, scaled to the whole DiT. ``fakegpu/timemodel.py`` turns the counts into seconds on a GPU's table
(``--gpu``; default: the visible GPU, else the H100). ``docs/SPEED.md`` has the model and its accuracy.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

log = logging.getLogger(__name__)
DEPTHS = (1, 2)
EDIT_STEPS_RUN = 2  # denoising steps the edit's counted run makes (every step runs the same kernels)


@dataclass
class TimePrediction:
    """A step's (or an image's) predicted time on one GPU, with what it is made of."""

    estimate: object            # fakegpu.timemodel.Estimate
    table: object               # fakegpu.timemodel.GpuTable
    samples: int = 1            # samples per step (train) or images (edit)
    what: str = "training step"

    @property
    def seconds(self) -> float:
        return self.estimate.seconds

    def line(self, max_steps: int = 0, accumulation: int = 1) -> str:
        e, t = self.estimate, self.table
        if self.what != "training step":
            return f"predicted {self.what}: {e.describe()} [{t.source}; {t.accuracy}]"
        per_hour = 3600 / (e.seconds * accumulation)
        run = f"; {max_steps} steps: {format_duration(max_steps * accumulation * e.seconds)}" if max_steps else ""
        return (f"predicted training step: {e.describe()}; {self.samples / e.seconds:.2f} samples/s, MFU "
                f"{100 * e.mfu:.0f} %, {per_hour:,.0f} optimizer steps/hour{run} [{t.source}; {t.accuracy}]")


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def full_depth(preset) -> int:
    """Blocks of the preset's whole DiT (its DiffSynth class's default ``num_layers``)."""
    from ..memory.census import build_dit
    from ..models.presets import family_of

    if preset.is_tiny:
        import torch

        with torch.device("meta"):
            return len(build_dit(preset).transformer_blocks)
    return inspect.signature(family_of(preset).component_type("dit")).parameters["num_layers"].default


def step_profile(reports: Sequence, blocks: int, depths: tuple = DEPTHS):
    """The whole DiT's counted kernels from the runs at ``depths`` (their ``.costs``)."""
    shallow, deep = reports
    return shallow.costs.scaled_to(deep.costs, depths, blocks)


def interpolated_profile(plain, checkpointed, blocks: int, n: int):
    """The whole DiT's counted kernels with ``n`` of ``blocks`` blocks checkpointed (``--checkpoint_blocks``), from
    the profiles of every block plain and every block checkpointed: a plain block runs no recompute, so the step
    is the plain one plus ``n / blocks`` of the difference."""
    return plain.combine(checkpointed.combine(plain, -1.0), n / blocks)


def predict_train(cfg, preset, shapes, gpu: Optional[str] = None, reports: Optional[Sequence] = None,
                  depths: tuple = DEPTHS, backend: Optional[str] = None, profile=None) -> TimePrediction:
    """The predicted time of one optimizer step of ``cfg`` on ``gpu``; ``reports``: counted runs at ``depths``
    already made (the preflight's), else they are run here; ``profile``: the whole DiT's counted kernels."""
    from ..fakegpu.timemodel import gpu_table, predict
    from .train_step import STEP_SECTIONS

    table = gpu_table(gpu)
    if profile is None:
        if reports is None:
            reports = timing_runs(cfg, preset, shapes, depths)
        profile = step_profile(reports, full_depth(preset), depths)
    estimate = predict(profile, table, backend=backend, sections=STEP_SECTIONS, model_sections=("forward",))
    return TimePrediction(estimate, table, samples=len(shapes) * cfg.train.gradient_accumulation_steps)


def timing_runs(cfg, preset, shapes, depths: tuple = DEPTHS) -> list:
    """The counted training steps at ``depths`` a prediction is made of (``--compile``'s blocks not traced:
    ``preflight/train_extras.compiled``)."""
    from .train_step import verify_train_step

    return [verify_train_step(cfg, preset, shapes, num_layers=n, encode=False, costs=True, trace=False)
            for n in depths]


def predict_edit(preset, steps: int, cfg_scale: float, gpu: Optional[str] = None, deep=None,
                 **edit_args) -> TimePrediction:
    """Seconds per image of an edit at ``steps`` denoising steps and CFG ``cfg_scale`` on ``gpu``: the text and
    reference encoding, the first step (which fills a prefix KV cache) and the decode once, the steps after it
    ``steps - 1`` times. ``deep``: the counted kernels of the deeper run already made (``qie plan --verify
    --verify_blocks 2``'s edit, the same run)."""
    from ..fakegpu.timemodel import gpu_table
    from .edit_step import verify_edit

    table = gpu_table(gpu)
    # the encode section is the same at every depth: the deeper run counts it, the shallower one skips the
    # language model's pass (most of its host time)
    def counted(n: int):
        return verify_edit(preset, steps=min(steps, EDIT_STEPS_RUN), cfg=cfg_scale, num_layers=n, costs=True,
                           prompt_pass=n == DEPTHS[-1], **edit_args).costs

    shallow = counted(DEPTHS[0])
    deep = deep if deep is not None else counted(DEPTHS[-1])
    profile = shallow.with_sections(deep, ("encode",)).scaled_to(deep, DEPTHS, full_depth(preset))
    estimate = edit_estimate(profile, table, steps, min(steps, EDIT_STEPS_RUN))
    return TimePrediction(estimate, table, what=f"edit ({steps} steps, CFG {cfg_scale:g}), per image")


def edit_estimate(profile, table, steps: int, steps_run: int, backend: Optional[str] = None):
    """An edit's :class:`~..fakegpu.timemodel.Estimate` at ``steps`` from a counted run of ``steps_run``."""
    import dataclasses

    from ..fakegpu.timemodel import predict

    once = predict(profile, table, backend=backend, sections=("encode", "denoise", "decode"))
    if steps_run < 2:
        return once
    later = predict(profile, table, backend=backend, sections=("denoise_next",))
    k = (steps - 1) / (steps_run - 1)
    split = {key: once.split[key] + k * later.split[key] for key in once.split}
    return dataclasses.replace(once, seconds=once.seconds + k * later.seconds, split=split,
                               kernels=once.kernels + k * later.kernels)
