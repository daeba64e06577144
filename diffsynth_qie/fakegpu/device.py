"""A fake CUDA device: the real model code at full size, with no GPU, no memory and no arithmetic.

PyTorch's ``FakeTensorMode`` runs every operator for shapes, dtypes and devices only. Under
:func:`fake_cuda`, tensors can live on ``cuda:0`` on a machine without a GPU, so the real 20 B DiT
builds in seconds and a whole training step or edit runs through our code exactly as on a GPU.
Four things are added on top of the mode:

- **The host stays real.** An operator whose inputs are all real CPU tensors (and that makes no
  tensor on the device) runs for real: σ draws, CPU noise, index lists and other host-side work
  keep their values, so the code takes the same branches it takes on a GPU.
- **What a GPU run would refuse, or stall on, is an error** (``ops.py``, ``checks.py``): mixing a
  CPU and a CUDA tensor; operand dtypes the CUDA matmul and attention kernels refuse, FP8 reaching a matmul;
  a ``generator=`` on another device than its output; reading a device tensor's value on the host
  (``.item()``, ``.tolist()``, ``.numpy()``, ``nonzero`` sizes, ``if tensor:``); inside a verified phase
  (:meth:`FakeCuda.phase`), copying a device tensor to the host (``.cpu()``, ``.to("cpu")``, ``copy_`` into
  a host tensor) with more device work after it, and ``torch.tensor([device scalars])``; a tensor copied on a side stream used before its
  copy was waited for. Each becomes a :class:`FakeRunError` naming the operator, the line of our code that
  asked for it and the fix; so does a CUDA driver error raised inside the session.
- **Legal CUDA calls are modelled** (``streams.py``): streams, events, ``synchronize``,
  ``torch.Generator("cuda")`` and pinned host memory work without a driver.
- **The step cache decides without values** (:func:`step_cache_answers`): its one designed host read, and its
  schedule, are answered "reuse" wherever a reuse is allowed, so a cached edit runs its reusing path.
- **Live device bytes are counted** (``accounting.py``). Every device storage is registered when an
  operator makes it and released when Python frees it (storages keep their Python object while alive), so
  the peak of live bytes per phase is exact for what the program holds. It cannot see allocator
  fragmentation, the caching allocator's rounding, cuBLAS/cuDNN workspaces or the CUDA context
  (``docs/MEMORY.md``).

Block swapping runs its real CUDA transport (``memory/swap_transport.py``): the swapped blocks' pinned host
copies are fake CPU tensors (no memory, counted as pinned host bytes), a swap-in is a copy on the modelled
side stream, counted like any other device tensor and checked for its wait. PyTorch's autograd engine
cannot run a backward pass over fake CUDA tensors on a machine without a GPU either: :func:`backward`
(``backward.py``) walks the graph itself, in the engine's order.
"""
from __future__ import annotations

import contextlib
import os
import traceback
from typing import Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .backward import backward, node_hooks_kept
from .accounting import DeviceMemory, PhasePeak
from .ops import (FAKE_DEVICE_FILES, PACKAGE_DIR, FakeRunError, FusedAttention, HostRealDeviceFake,
                       compiled_frame_error, cuda_looks_available, module_moves_set_data)
from .streams import modelled_cuda_calls

__all__ = ["FakeCuda", "FakeRunError", "PhasePeak", "backward"]


class _FakeMode(FakeTensorMode):
    """PyTorch's fake mode with ``avoid_device_init`` read once per session: PyTorch asks it on every operator,
    and each answer is a ``torch.cuda.is_available()``, which with DeepSpeed imported (it sets
    ``PYTORCH_NVML_BASED_CUDA_CHECK``) loads and initialises NVML every time."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._avoid_device_init = FakeTensorMode.avoid_device_init.fget(self)

    @property
    def avoid_device_init(self) -> bool:
        return self._avoid_device_init


class FakeCuda:
    """The fake device session: ``with FakeCuda() as fc:`` ... ``with fc.phase("forward"):`` ...

    Inside, ``torch.device("cuda")`` tensors are fake; :meth:`build` constructs modules directly on
    the device in a given dtype; :attr:`phases` records each phase's peak of live device bytes.
    """

    def __init__(self, costs=False):
        """``costs``: count what each kernel would cost a GPU (True, or a :class:`~.costs.CostCounter`), in
        :attr:`costs`, split by phase (``costs.section``)."""
        from .costs import CostCounter

        self.costs: Optional[CostCounter] = CostCounter() if costs is True else (costs or None)
        self.memory = DeviceMemory()
        self.phases: list[PhasePeak] = []
        self._stack: Optional[contextlib.ExitStack] = None
        self._ops: Optional[HostRealDeviceFake] = None

    def __enter__(self) -> "FakeCuda":
        self._stack = contextlib.ExitStack()
        streams = self._stack.enter_context(modelled_cuda_calls())
        self._stack.enter_context(_FakeMode(allow_non_fake_inputs=True))
        self._ops = self._stack.enter_context(HostRealDeviceFake(self.memory, streams))
        self._ops.counter = self.costs
        self._stack.enter_context(cuda_looks_available())
        self._stack.enter_context(FusedAttention(self._ops))
        self._stack.enter_context(module_moves_set_data())
        self._stack.enter_context(node_hooks_kept())
        self._stack.enter_context(step_cache_answers())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        stack, self._stack = self._stack, None
        stack.__exit__(exc_type, exc, tb)
        if isinstance(exc, RuntimeError) and not isinstance(exc, FakeRunError):
            traced = compiled_frame_error(exc)
            if traced is not None:
                raise traced from None
            raise FakeRunError(f"a CUDA driver call at {_frame_of(tb)}: {str(exc).splitlines()[0]} (the fake "
                               f"device has no driver: it models streams, events, synchronize, "
                               f"torch.Generator('cuda') and pinned memory; other calls need a GPU, keep them "
                               f"out of the step)") from None

    @contextlib.contextmanager
    def build(self, dtype: torch.dtype, device: str = "cuda:0") -> Iterator[None]:
        """Modules constructed inside land on the fake ``device`` in ``dtype`` (``module.to(dtype)`` does
        not work under the fake mode, so the default dtype is set for the construction instead)."""
        saved = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                yield
        finally:
            torch.set_default_dtype(saved)

    def register(self, module: torch.nn.Module) -> None:
        """Count a module's device parameters and buffers (made by factory calls the mode saw only
        partly, e.g. through ``torch.device`` contexts and in-place initialisers)."""
        self.memory.add_tensors(list(module.parameters()) + list(module.buffers()))

    @contextlib.contextmanager
    def phase(self, name: str, host_syncs: bool = False) -> Iterator[None]:
        """A verified phase (a training step's forward + backward, the optimizer step, an edit): its peak of
        live device bytes is recorded, and a device-to-host copy inside it (``.cpu()``, ``.to("cpu")``,
        ``copy_`` into a host tensor not pinned) followed by more device work in the phase is a
        :class:`FakeRunError` naming the copy's line (a host sync: the device idles while the host waits).
        The phase's last copy, after its device work, is its result (an edit's latents) and is legal; so
        is every copy outside the phases (building, loading, installing block swapping, saving) or with
        ``host_syncs=True``. ``torch.tensor([device scalars])`` reads values: an error anywhere in a phase."""
        self.memory.reset_peak()
        start = self.memory.current
        if self.costs is not None:
            self.costs.section = name
        saved = self._ops.phase, self._ops.sync
        self._ops.phase, self._ops.sync = (None if host_syncs else name), None
        try:
            yield
        finally:
            self._ops.phase, self._ops.sync = saved
            self.phases.append(PhasePeak(name, start, self.memory.peak, self.memory.current))

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Kernels run inside are not counted in :attr:`costs` (work repeated to check memory, not to time it)."""
        saved, self._ops.counter = self._ops.counter, None
        try:
            yield
        finally:
            self._ops.counter = saved

    @property
    def current_bytes(self) -> int:
        return self.memory.current




@contextlib.contextmanager
def step_cache_answers(answer: bool = True) -> Iterator[None]:
    """The step cache's decisions without values (``models/samplers/cached_blocks.py``): its one designed host read
    (``StepCache.read``, the first-block method's boolean per DiT call) is answered ``answer`` instead of read, and so
    is the schedule method's plan, at every step past the warm-up: the run computes its first step(s) and then
    reuses at every step it may, the path that holds the cached residuals. Any other host read stays an error."""
    from ..models.samplers.cached_blocks import StepCache

    saved, StepCache.answer_without_reading = StepCache.answer_without_reading, answer
    try:
        yield
    finally:
        StepCache.answer_without_reading = saved


def _frame_of(tb) -> str:
    """``file:line (function)`` of the innermost frame of ``tb`` in this package outside the fake device."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in reversed(traceback.extract_tb(tb))
              if not f.filename.endswith(FAKE_DEVICE_FILES) and not f.filename.startswith(torch_dir)]
    ours = [f for f in frames if f.filename.startswith(PACKAGE_DIR)] or frames
    if not ours:
        return "(unknown)"
    f = ours[0]
    name = os.path.relpath(f.filename, os.path.dirname(PACKAGE_DIR)) if f.filename.startswith(PACKAGE_DIR) \
        else f.filename
    return f"{name}:{f.lineno} ({f.name})"
