"""Step caching's policy: the levels (``--cache off|fast|balanced``), the two methods, and which steps may reuse.

A step cache reuses, at some denoising steps, what the DiT's blocks added to their input at an earlier step (a
*residual*), instead of running them: the sampler's step count stays, the DiT work shrinks. Two methods, each
with a threshold (``--cache_threshold``):

- ``first_block`` (FBCache / DBCache style): every call runs the first block; when its residual changed by less
  than ``threshold`` (mean absolute change over the mean magnitude, ``|r₀ − r₀'|₁ / |r₀'|₁``, against the last
  call that ran every block), the other blocks are skipped and their cached residual is added to the first
  block's output. The decision reads one boolean per DiT call on the host (``cached_blocks.StepCache.read``).
- ``schedule`` (TeaCache / MagCache style): which steps reuse is fixed before sampling, from a magnitude curve
  calibrated offline and stored as data (``step_cache_curves.json``: log of the blocks' mean residual magnitude
  against σ). MagCache's rule: between two computed steps the residual's magnitude ratios multiply; the step
  reuses while the accumulated error ``Σ|1 − Π ratio|`` stays within ``threshold``. A skipped step runs no block
  and reads nothing on the host.

Both keep the first ``warmup`` share of the steps exact (at least one: there is nothing to reuse before it) and
reuse at most ``max_skips`` steps in a row. ``off`` (the default) attaches nothing: the sampler runs exactly as
without a cache. The block adapter that does the reusing is ``cached_blocks.py``.
"""
from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

METHODS = ("first_block", "schedule")
LEVEL_NAMES = ("off", "fast", "balanced")
CURVES_FILE = Path(__file__).with_name("step_cache_curves.json")


@dataclass(frozen=True)
class CacheSettings:
    """One step cache: its method and when it may reuse (see the module docstring)."""

    method: str = "first_block"
    threshold: float = 0.1       # first_block: relative change of the first block's residual; schedule: accumulated
                                 # magnitude error
    warmup: float = 0.2          # the share of the steps, from the first, always computed (at least one step)
    max_skips: int = 3           # steps reused in a row at most
    record: bool = False         # keep every computed call's residual magnitude (a calibration run: ``CacheStats``)

    def warmup_steps(self, steps: int) -> int:
        return max(1, math.ceil(self.warmup * steps))


# The levels, per method; the first method listed is the level's own. Chosen from the threshold sweep of
# benchmarks/edit_speed_quality.py on both tiny bases at 40 steps, CFG 4 (docs/STEP_CACHE.md): ``balanced`` reuses
# at least 40 % of the DiT calls with the held-out edit and preservation PSNR within 0.3 dB of the exact edit,
# ``fast`` at least 60 % within 1 dB. ``first_block`` is the levels' own: at the same share of calls saved its
# outputs are closer to the exact ones (PSNR to them about 10 dB higher in the sweep).
LEVELS: dict[str, dict[str, CacheSettings]] = {
    "balanced": {"first_block": CacheSettings("first_block", 0.12, 0.2, 4),
                 "schedule": CacheSettings("schedule", 0.1, 0.2, 4)},
    "fast": {"first_block": CacheSettings("first_block", 0.2, 0.15, 4),
             "schedule": CacheSettings("schedule", 0.3, 0.2, 4)},
}


def cache_settings(level, method: Optional[str] = None, threshold: Optional[float] = None
                   ) -> Optional[CacheSettings]:
    """The settings of ``--cache level`` with ``--cache_method`` / ``--cache_threshold`` (None: the level's own);
    None for ``off``; ``level`` may be a :class:`CacheSettings` itself (a benchmark's sweep, a calibration run).
    A bad value raises ``ValueError`` naming it and the choices."""
    if isinstance(level, CacheSettings):
        settings = replace(level, **{k: v for k, v in (("method", method), ("threshold", threshold)) if v is not None})
        if settings.method not in METHODS or not settings.threshold >= 0 or settings.max_skips < 0:
            raise ValueError(f"step cache {settings} is not valid: method one of {', '.join(METHODS)}, threshold "
                             ">= 0, max_skips >= 0")
        return settings
    if level not in LEVEL_NAMES:
        raise ValueError(f"cache {level!r} is not a step-cache level; use one of {', '.join(LEVEL_NAMES)}")
    if method is not None and method not in METHODS:
        raise ValueError(f"cache method {method!r} is unknown; use one of {', '.join(METHODS)}")
    if threshold is not None and (not isinstance(threshold, (int, float)) or not math.isfinite(threshold)
                                  or threshold < 0):
        raise ValueError(f"cache threshold must be a finite number >= 0 (0 reuses nothing), got {threshold!r}")
    if level == "off":
        if method is not None or threshold is not None:
            raise ValueError("a cache method or threshold was given with the cache off; add --cache balanced "
                             "(or fast), or drop --cache_method / --cache_threshold")
        return None
    methods = LEVELS[level]
    settings = methods[method or next(iter(methods))]
    return settings if threshold is None else replace(settings, threshold=float(threshold))


# --- the schedule method's calibrated curve -------------------------------------------------------------------
@dataclass(frozen=True)
class MagnitudeCurve:
    """log(mean |residual of the blocks|) against σ, from an uncached run (``calibrated_on`` says which)."""

    sigma: tuple[float, ...]             # increasing
    log_magnitude: tuple[float, ...]
    calibrated_on: str = ""

    def __call__(self, sigma: float) -> float:
        """Linear interpolation in σ, constant beyond the ends."""
        xs, ys = self.sigma, self.log_magnitude
        if sigma <= xs[0]:
            return ys[0]
        if sigma >= xs[-1]:
            return ys[-1]
        k = bisect.bisect_right(xs, sigma)
        t = (sigma - xs[k - 1]) / (xs[k] - xs[k - 1])
        return ys[k - 1] + t * (ys[k] - ys[k - 1])

    def to_json(self) -> dict:
        return {"calibrated_on": self.calibrated_on, "sigma": list(self.sigma),
                "log_magnitude": list(self.log_magnitude)}


def curve_from_samples(samples: Sequence[tuple[float, float]], calibrated_on: str = "") -> MagnitudeCurve:
    """A curve from ``(σ, mean |residual|)`` samples (every call of a calibration run): the mean log magnitude per
    distinct σ, sorted by σ."""
    by_sigma: dict[float, list[float]] = {}
    for sigma, magnitude in samples:
        by_sigma.setdefault(round(float(sigma), 6), []).append(math.log(max(float(magnitude), 1e-12)))
    if len(by_sigma) < 2:
        raise ValueError("a magnitude curve needs samples at two σ at least; calibrate over several steps")
    xs = sorted(by_sigma)
    return MagnitudeCurve(tuple(xs), tuple(sum(by_sigma[x]) / len(by_sigma[x]) for x in xs), calibrated_on)


@functools.lru_cache(maxsize=None)
def _stored_curves() -> dict:
    return json.loads(CURVES_FILE.read_text()).get("curves", {}) if CURVES_FILE.is_file() else {}


def stored_curve(*names: str) -> Optional[MagnitudeCurve]:
    """The first curve stored under one of ``names`` (a preset's name, then its family's), or None."""
    for name in names:
        data = _stored_curves().get(name)
        if data:
            return MagnitudeCurve(tuple(data["sigma"]), tuple(data["log_magnitude"]), data.get("calibrated_on", ""))
    return None


# --- which steps may reuse ------------------------------------------------------------------------------------
def skip_plan(settings: CacheSettings, sigmas: Sequence[float], curve: Optional[MagnitudeCurve] = None) -> list[bool]:
    """Per step of a run over ``sigmas`` (the steps' σ, first to last): ``first_block``: whether the step may
    reuse (past the warm-up; the first block's change decides); ``schedule``: whether it reuses (MagCache's
    accumulated-error rule on ``curve``). Host arithmetic only."""
    steps = len(sigmas)
    warm = settings.warmup_steps(steps)
    if settings.method == "first_block":
        return [k >= warm for k in range(steps)]
    if curve is None:
        raise ValueError("the schedule step cache needs a calibrated magnitude curve for this model; use "
                         "--cache_method first_block, or calibrate one (benchmarks/edit_speed_quality.py --calibrate)")
    plan, error, ratio, run = [], 0.0, 1.0, 0
    for k in range(steps):
        if k < warm:
            plan.append(False)
            continue
        ratio *= math.exp(curve(float(sigmas[k])) - curve(float(sigmas[k - 1])))
        error += abs(1.0 - ratio)
        if error <= settings.threshold and run < settings.max_skips:
            plan.append(True)
            run += 1
        else:
            plan.append(False)
            error, ratio, run = 0.0, 1.0, 0
    return plan
