"""Which noise levels σ training sees: ``--timestep_sampling`` and its knobs (``timesteps.py`` draws them).

Its own module, torch-free, so that ``timesteps.py`` (which the losses call) and ``config.py`` (which lists
the losses) both read it without an import cycle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..utils.config_cli import cli_help as _help


@dataclass
class TimestepConfig:
    """Which noise levels σ training sees (per sample, on the model family's DiffSynth training schedule)."""

    timestep_sampling: Literal["uniform", "logit_normal", "stratified"] = field(default="uniform", metadata=_help(
        "uniform over the scheduler's 1000 training timesteps (DiffSynth), logit-normal (SD3) over "
        "the same shifted schedule, or stratified: uniform, with the σ's of one optimizer step (all "
        "micro-batches and ranks) one in each of as many equal strata (lower-variance loss curves)"))
    logit_mean: float = field(default=0.0, metadata=_help("logit_normal: mean", unbounded=True))
    logit_std: float = field(default=1.0, metadata=_help("logit_normal: standard deviation", unbounded=True))
    min_timestep_boundary: float = field(default=0.0, metadata=_help(
        "sample only from this fraction of the schedule onwards (0 = σ≈1, 1 = σ≈0), as DiffSynth",
        unbounded=True))
    max_timestep_boundary: float = field(default=1.0, metadata=_help("... up to this fraction", unbounded=True))
