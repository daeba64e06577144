"""One Generate's variations on the loaded editor: progress that says which variation runs and how long is left
(from the step times measured in this run), and a Stop that keeps the variations already finished."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .uploads import UIError

# progress(done, total, description)
ProgressFn = Callable[[int, int, str], None]
# preview(before, image): a live preview (``image``) and the input at its size (the slider's left side)
PreviewFn = Callable[[Any, Any], None]

log = logging.getLogger(__name__)


class Stopped(UIError):
    """The user pressed Stop (or the tab went away)."""


@dataclass
class Where:
    """Where a run is: variation ``variation`` of ``total``, step ``step`` of ``steps``."""

    total: int
    variation: int = 0
    step: int = 0
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)
    steps_done: int = 0   # over all variations, for the time left

    def seconds_left(self) -> float | None:
        """The time left, from the step times measured so far in this run (None before the first step)."""
        if not (self.steps_done and self.steps):
            return None
        per_step = (time.perf_counter() - self.started) / self.steps_done
        return per_step * ((self.total - self.variation) * self.steps + (self.steps - self.step))

    def describe(self) -> str:
        parts = [f"variation {self.variation}/{self.total}"] if self.total > 1 else []
        parts.append("denoising")
        left = self.seconds_left()
        if left is not None:
            parts.append(f"about {left:.0f} s left")
        return " · ".join(parts)

    def stopped(self) -> str:
        return f"Stopped at step {self.step} of variation {self.variation}/{self.total}"


def run_variations(seeds: list[int], edit: Callable[[int, Callable[[int, int], None]], Any], steps: int,
                   stop: threading.Event, report: ProgressFn, where: Where | None = None
                   ) -> tuple[list[tuple[int, Any]], str | None]:
    """``edit(seed, step_callback)`` for each seed: ([(seed, result)], None), or, when ``stop`` is set during a
    variation, the finished ones and a "Stopped at step n of variation k/N" note. Raises :class:`Stopped` when
    nothing had finished. ``where`` (made here when not given) follows the run, for a queue's ETA."""
    where = where or Where(total=len(seeds), steps=steps)

    def step(done: int, total: int) -> None:
        if done > where.step:
            where.steps_done += done - where.step
        where.step, where.steps = done, total or where.steps
        if stop.is_set():
            raise Stopped(where.stopped())
        report(done, where.steps, where.describe())

    results: list[tuple[int, Any]] = []
    for k, seed in enumerate(seeds, 1):
        where.variation, where.step = k, 0
        report(0, where.steps, where.describe())
        try:
            results.append((seed, edit(seed, step)))
        except Stopped:
            log.info("generation stopped by the user (or its tab went away): %s", where.stopped())
            if not results:
                raise Stopped(f"{where.stopped()}; the settings are kept: press Generate to run again") from None
            return results, f"{where.stopped()}; kept the {len(results)} finished"
    return results, None


def queue_eta(ahead: int, running: Where | None, last_run: float | None) -> float | None:
    """Seconds until a job with ``ahead`` jobs before it (the running one included) starts: the running one's time
    left plus a whole run (``last_run``, as measured) for each queued one; None when nothing was measured yet."""
    if ahead <= 0:
        return 0.0
    left = running.seconds_left() if running is not None else 0.0
    if left is None or (ahead > 1 and last_run is None):
        return None
    return left + (ahead - 1) * (last_run or 0.0)


def queued_note(ahead: int, eta: float | None) -> str | None:
    """The status line of a job that waits: "Queued behind n generations of other tabs, about X s"."""
    if ahead <= 0:
        return None
    jobs = f"{ahead} generation{'s' if ahead > 1 else ''} of {'other tabs' if ahead > 1 else 'another tab'}"
    when = f", about {eta:.0f} s (from measured step times)" if eta is not None else \
        "; it starts when they end (no step time measured yet)" if ahead > 1 else "; it starts when that one ends"
    return f"Queued behind {jobs}{when}."


def previews(image: Any, preview: PreviewFn) -> Callable[[int, int, Any], None]:
    """``EditRequest.preview`` for the UI's ``preview(before, image)``: the input resized once per preview size."""
    before: dict[tuple[int, int], Any] = {}

    def show(step: int, total: int, decoded: Any) -> None:
        if decoded.size not in before:
            before[decoded.size] = image.resize(decoded.size)
        preview(before[decoded.size], decoded)
    return show
