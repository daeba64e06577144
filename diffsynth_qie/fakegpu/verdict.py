"""The memory verdict of a fake-device run: does the peak fit the GPU, and does the plan agree with it?

``qie plan --verify`` and the preflights of ``qie train`` / ``qie edit`` measure a peak on the fake device
(``fakegpu/device.py``). A number the user has to compare by eye is easy to miss, so the comparison is a
verdict: :func:`check_memory` raises :class:`MemoryVerdictError` (a ``ValueError``: one line, exit code 2 from
``qie``) naming the phase, the largest holders by our frame, and the fix, when

- the peak exceeds the GPU (``--gpu_memory_gb``, default: the visible GPU's total memory), or
- the plan (``memory/plan.py``) differs from the peak by more than :data:`PLAN_TOLERANCE`.

A run of a few blocks scaled up to the whole DiT says so (``scaled``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

GiB = 1024 ** 3
PLAN_TOLERANCE = 0.10  # the plan and the fake device may differ by this share of the peak


class MemoryVerdictError(ValueError):
    """A fake-device peak that does not fit the GPU, or a plan that does not match it (one line)."""


@dataclass(frozen=True)
class MemoryVerdict:
    phase: str  # the phase whose peak is judged, e.g. "steady-state step", "edit"
    peak_bytes: int  # the fake-device peak of that phase
    gpu_bytes: Optional[int] = None  # the GPU's memory (None: not judged)
    planned_bytes: Optional[int] = None  # qie plan's prediction of the same peak (None: not compared)
    holders: Sequence[tuple[str, int]] = field(default_factory=tuple)  # (our frame or a name, bytes), largest first
    scaled: str = ""  # e.g. "2 of 60 blocks run, scaled to 60"

    @property
    def plan_error(self) -> Optional[float]:
        """(plan − peak) / peak, or None."""
        if self.planned_bytes is None or self.peak_bytes <= 0:
            return None
        return (self.planned_bytes - self.peak_bytes) / self.peak_bytes

    def problems(self, tolerance: float = PLAN_TOLERANCE) -> list[str]:
        found = []
        if self.gpu_bytes is not None and self.peak_bytes > self.gpu_bytes:
            found.append(f"the peak {gib(self.peak_bytes)} exceeds the GPU's {gib(self.gpu_bytes)}")
        error = self.plan_error
        if error is not None and abs(error) > tolerance:
            found.append(f"qie plan predicts {gib(self.planned_bytes)} ({error:+.1%}; more than ±{tolerance:.0%} off)")
        return found

    def line(self, tolerance: float = PLAN_TOLERANCE) -> str:
        """The verdict in one line (also when it passes)."""
        problems = self.problems(tolerance)
        head = f"{self.phase}: fake-device peak {gib(self.peak_bytes)}"
        if self.scaled:
            head += f" ({self.scaled})"
        if not problems:
            fits = "" if self.gpu_bytes is None else f", fits the GPU's {gib(self.gpu_bytes)}"
            error = self.plan_error
            agrees = "" if error is None else f", plan {gib(self.planned_bytes)} ({error:+.1%})"
            return head + fits + agrees
        holders = ", ".join(f"{name} {gib(n)}" for name, n in list(self.holders)[:3])
        return (f"{head}: {'; '.join(problems)}" + (f"; largest holders: {holders}" if holders else "")
                + f"; fix: {self.fix()}")

    def fix(self) -> str:
        if self.gpu_bytes is not None and self.peak_bytes > self.gpu_bytes:
            return (f"`qie plan --gpu_memory_gb {self.gpu_bytes / GiB:.0f}` lists the cheapest options that fit "
                    "(--fp8_base, --blocks_to_swap N, --gradient_checkpointing, a smaller batch or resolution)")
        return ("the planner lacks a term for this configuration: trust the fake-device peak, and report the "
                "configuration (pass --no_preflight to run anyway)")


def gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB"


def visible_gpu_bytes() -> Optional[int]:
    """Total memory of the visible GPU (device 0), or None without one. Call it outside the fake device."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def gpu_bytes_of(gpu_memory_gb: Optional[float]) -> Optional[int]:
    """``--gpu_memory_gb`` in bytes, or the visible GPU's memory when it is not given (None without a GPU)."""
    return visible_gpu_bytes() if gpu_memory_gb is None else int(gpu_memory_gb * GiB)


def check_memory(verdict: MemoryVerdict, tolerance: float = PLAN_TOLERANCE) -> str:
    """The verdict's line when it passes; :class:`MemoryVerdictError` with that line when it does not."""
    if verdict.problems(tolerance):
        raise MemoryVerdictError(verdict.line(tolerance))
    return verdict.line(tolerance)
