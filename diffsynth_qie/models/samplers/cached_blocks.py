"""The step cache's block adapter: the DiT's blocks skipped at the steps that reuse, for every model family.

For one sampling run (:meth:`StepCache.run`) the DiT's ``transformer_blocks`` is replaced by a list of thin
stand-ins, one per block, that call the real block or return their input; everything around the blocks is the
code that runs without a cache (our ``dit_forward`` for Qwen-Image-Edit, DiffSynth's ``QwenImage21DiT.forward``
for 2.1, the fake device's stand-in of it). The list keeps its length, so 2.1's prefix KV cache (one dict per
block) lines up; a skipped block's hooks do not fire, so the block swapper moves nothing for it; a block's
LoRA branches, FP8 weights and ``--compile`` are the block's own and run whenever it runs. What a block call
looks like (which input is the cached stream, what it returns) is the family's ``Family.block_io``.

Branches: every step makes the same DiT calls in the same order (true CFG as one batch of 2B, or a positive
and a negative pass; 2.1 one call per prompt), so the n-th call of a step is one branch, with its own cached
residual, its own first-block reference and its own count of reuses in a row. A call of several samples (the
CFG batch, LBM's two streams) measures each on its own and reuses only when all may. A call whose stream is the
tail of the stored one (2.1's steps after the prefix-writing first step, which send only the target tokens)
uses the stored tensors' last tokens.

Why not cache-dit: cache-dit (1.5.x) patches ``transformer.forward`` and swaps a block list for ONE module that
runs every block with the first block's arguments, keyed to a diffusers pipeline's ``__call__``. Our Edit
sampler never calls ``QwenImageDiT.forward`` (``dit_forward`` drives the blocks with per-sample RoPE and masks);
2.1's DiT passes each block its own prefix KV cache dict and checks the list's length against it; our true CFG
runs both branches in one batch; and its decision reads a float on the host at every step (``.item()``), which
the fake device refuses. Adapting it would take a copy of both DiTs' forwards; this list of stand-ins is the
smallest piece that drives DiffSynth's code unchanged.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ClassVar, Iterator, Optional, Sequence

import torch

from .step_cache import CacheSettings, MagnitudeCurve, skip_plan, stored_curve

Tensor = torch.Tensor


@dataclass
class CacheStats:
    """What a run reused: ``calls`` DiT calls, ``skipped`` of them reused a cached residual (``first_block``:
    every block but the first), ``blocks_run`` block calls made."""

    calls: int = 0
    skipped: int = 0
    blocks_run: int = 0
    # with ``CacheSettings.record``: (σ, mean |what all the blocks added to the stream|) of every computed call
    magnitudes: list = field(default_factory=list)

    @property
    def saved(self) -> float:
        return self.skipped / self.calls if self.calls else 0.0


@dataclass
class _Branch:
    residual: Optional[Tensor] = None    # what the reused blocks added to the stream at the last computed call
    first: Optional[Tensor] = None       # first_block: the first block's residual at that call
    run: int = 0                         # calls reused in a row


@dataclass
class _Call:
    branch: _Branch
    may_skip: bool
    start: Tensor                        # the stream where the reused blocks begin
    input: Tensor                        # the stream before the first block
    skip: bool = False


@dataclass
class StepCache:
    """One sampling run's step cache on ``dit``: the sampler calls :meth:`run` around its loop and :meth:`step`
    before each step's DiT calls."""

    settings: CacheSettings
    dit: torch.nn.Module
    block_io: tuple[tuple[str, ...], tuple[str, ...]]
    curve: Optional[MagnitudeCurve] = None
    stats: CacheStats = field(default_factory=CacheStats)

    #: The fake device (``fakegpu/device.py``) has no values to read: while it runs, every decision the cache may
    #: make (a step past the warm-up, with a residual to reuse) is this answer, and nothing is read on the host.
    answer_without_reading: ClassVar[Optional[bool]] = None

    def __post_init__(self):
        self._plan: list[bool] = []
        self._sigmas: list[float] = []
        self._branches: dict[int, _Branch] = {}
        self._index, self._ordinal, self._call = 0, 0, None

    @contextlib.contextmanager
    def run(self, sigmas: Sequence[float]) -> Iterator["StepCache"]:
        """The DiT's blocks replaced by their stand-ins for a run over ``sigmas`` (the steps' σ)."""
        self._sigmas = [float(s) for s in sigmas]
        self._plan = skip_plan(self.settings, self._sigmas, self.curve)
        if StepCache.answer_without_reading is not None:
            warm = self.settings.warmup_steps(len(self._sigmas))
            self._plan = [k >= warm and StepCache.answer_without_reading for k in range(len(self._sigmas))]
        blocks = self.dit.transformer_blocks
        self.dit.transformer_blocks = torch.nn.ModuleList(
            [_CachedBlock(self, i, block) for i, block in enumerate(blocks)])
        try:
            yield self
        finally:
            self.dit.transformer_blocks = blocks
            self._branches.clear()
            self._call = None
        # (a calibration run's magnitudes, read on the host once the sampling is over)
        self.stats.magnitudes = [(sigma, float(m)) for sigma, m in self.stats.magnitudes]

    def step(self, index: int) -> None:
        """Step ``index`` (from 0) begins: its DiT calls count from the first branch again."""
        self._index, self._ordinal = index, 0

    # --- one block call ------------------------------------------------------------------------------------
    def block_call(self, index: int, block, args: tuple, kwargs: dict):
        last = len(self.dit.transformer_blocks) - 1
        hidden = self._input(self.block_io[0][0], args, kwargs)
        if index == 0:
            self._begin(hidden)
        call = self._call
        if call.skip:
            return self._output(args, kwargs, hidden + call.branch.residual if index == last else hidden)
        out = block(*args, **kwargs)
        self.stats.blocks_run += 1
        stream = self._stream(out)
        if index == 0 and self.settings.method == "first_block" and last > 0:
            first = stream - hidden
            if self._reuse_after_first(call, first):
                return out
            call.branch.first, call.start = first, stream
        if index == last:
            call.branch.residual = stream - call.start
            if self.settings.record:  # (a device scalar: read after the run)
                self.stats.magnitudes.append((self._sigmas[self._index], (stream - call.input).abs().float().mean()))
        return out

    def _begin(self, hidden: Tensor) -> None:
        branch = self._branches.setdefault(self._ordinal, _Branch())
        self._ordinal += 1
        self.stats.calls += 1
        branch.residual = _tail(branch.residual, hidden)
        branch.first = _tail(branch.first, hidden)
        may_skip = (self._plan[self._index] if self._index < len(self._plan) else False) \
            and branch.residual is not None and branch.run < self.settings.max_skips
        self._call = _Call(branch, may_skip, hidden, hidden)
        if self.settings.method == "schedule":
            self._count(self._call, may_skip)

    def _reuse_after_first(self, call: _Call, first: Tensor) -> bool:
        """first_block: whether the first block's residual moved less than the threshold since the last computed
        call (each sample of the call measured on its own; all must agree)."""
        reference = call.branch.first
        if not call.may_skip or reference is None or reference.shape != first.shape:
            return self._count(call, False)
        dims = tuple(range(1, first.ndim))
        change = (first - reference).abs().float().mean(dims) / reference.abs().float().mean(dims).clamp_min(1e-12)
        return self._count(call, self.read((change < self.settings.threshold).all()))

    def _count(self, call: _Call, skip: bool) -> bool:
        call.skip = skip
        call.branch.run = call.branch.run + 1 if skip else 0
        self.stats.skipped += int(skip)
        return skip

    @staticmethod
    def read(flag: Tensor) -> bool:
        """The one host read of the ``first_block`` method, one boolean per DiT call: the host must know whether
        to queue the other blocks. The host waits until the call's first block has run (with what was queued
        before it); the device then idles only while the host queues the next kernel, microseconds against a
        call of about 0.16-0.9 s at 1024² (the other blocks are not queued yet, so nothing else is held up). On
        the fake device: :attr:`answer_without_reading`."""
        if StepCache.answer_without_reading is not None:
            return StepCache.answer_without_reading
        return bool(flag)

    # --- the block's inputs and outputs (Family.block_io) ----------------------------------------------------
    def _input(self, name: str, args: tuple, kwargs: dict) -> Tensor:
        if name in kwargs:
            return kwargs[name]
        return args[self.block_io[0].index(name)]

    def _stream(self, out) -> Tensor:
        names = self.block_io[1]
        return out if len(names) == 1 else out[names.index(self.block_io[0][0])]

    def _output(self, args: tuple, kwargs: dict, stream: Tensor):
        names, name = self.block_io[1], self.block_io[0][0]
        values = [stream if n == name else self._input(n, args, kwargs) for n in names]
        return values[0] if len(values) == 1 else tuple(values)


def _tail(stored: Optional[Tensor], hidden: Tensor) -> Optional[Tensor]:
    """``stored`` as it fits ``hidden``: itself, its last tokens when ``hidden`` holds fewer (2.1's decode steps),
    else None (nothing to reuse)."""
    if stored is None or stored.shape == hidden.shape:
        return stored
    if stored.ndim == hidden.ndim >= 2 and stored.shape[0] == hidden.shape[0] \
            and stored.shape[2:] == hidden.shape[2:] and stored.shape[1] > hidden.shape[1]:
        return stored[:, stored.shape[1] - hidden.shape[1]:]
    return None


class _CachedBlock(torch.nn.Module):
    """A block's stand-in in the run's block list; the block itself is not a submodule of it (the DiT's module
    tree, its names and its parameters stay as they are)."""

    def __init__(self, cache: StepCache, index: int, block: torch.nn.Module):
        super().__init__()
        self.__dict__["cache"], self.__dict__["block"], self.index = cache, block, index

    def forward(self, *args, **kwargs):
        return self.__dict__["cache"].block_call(self.index, self.__dict__["block"], args, kwargs)


def step_cache_for(settings: Optional[CacheSettings], dit, family, preset_name: Optional[str] = None
                   ) -> Optional[StepCache]:
    """A step cache of ``settings`` (None: none) on ``dit`` of ``family`` (a ``models.family.Family``); the
    ``schedule`` method takes the curve stored for ``preset_name``, else for the family (a ``ValueError`` names
    the way out when there is none)."""
    if settings is None:
        return None
    curve = None
    if settings.method == "schedule":
        curve = stored_curve(*(n for n in (preset_name, family.name) if n))
        if curve is None:
            raise ValueError(f"no calibrated magnitude curve for {preset_name or family.label} (the schedule step "
                             "cache needs one); use --cache_method first_block, or calibrate one with "
                             "benchmarks/edit_speed_quality.py --calibrate")
    return StepCache(settings, dit, family.block_io, curve)
