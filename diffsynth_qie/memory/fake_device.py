"""A fake CUDA device: the real model code at full size, with no GPU, no memory and no arithmetic.

PyTorch's ``FakeTensorMode`` runs every operator for shapes, dtypes and devices only. Under
:func:`fake_cuda`, tensors can live on ``cuda:0`` on a machine without a GPU, so the real 20 B DiT
builds in seconds and a whole training step or edit runs through our code exactly as on a GPU.
Three things are added on top of the mode:

- **The host stays real.** An operator whose inputs are all real CPU tensors (and that makes no
  tensor on the device) runs for real: σ draws, CPU noise, index lists and other host-side work
  keep their values, so the code takes the same branches it takes on a GPU.
- **What a GPU run would refuse, or stall on, is an error** (``fake_ops.py``). Mixing a CPU and a CUDA
  tensor raises ``FakeTensorDeviceMismatchError`` as on a GPU; reading a device tensor's value on the host
  (``.item()``, ``.tolist()``, ``nonzero`` sizes, ``if tensor:``) would be a host sync. Both become a
  :class:`FakeRunError` naming the operator and the line of our code that asked for it.
- **Live device bytes are counted** (``fake_memory.py``). Every device storage is registered when an
  operator makes it and released when Python frees it (storages keep their Python object while alive), so
  the peak of live bytes per phase is exact for what the program holds. It cannot see allocator
  fragmentation, the caching allocator's rounding, cuBLAS/cuDNN workspaces or the CUDA context
  (``docs/MEMORY.md``).

CUDA streams and events cannot be faked (creating one initialises CUDA), so block swapping runs with
:class:`StandInTransport`: the swapped blocks' host copies are fake CPU tensors (no memory, no values),
and a swap-in is a plain copy onto the fake device, counted like any other. PyTorch's autograd engine
cannot run a backward pass over fake CUDA tensors on a machine without a GPU either: :func:`backward`
(``fake_backward.py``) walks the graph itself, in the engine's order.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .block_swap import HostTransport
from .fake_backward import backward, node_hooks_kept
from .fake_memory import DeviceMemory, PhasePeak
from .fake_ops import (FakeRunError, FusedAttention, HostRealDeviceFake, cuda_looks_available,
                       module_moves_set_data)

__all__ = ["FakeCuda", "FakeRunError", "PhasePeak", "StandInTransport", "backward"]


class FakeCuda:
    """The fake device session: ``with FakeCuda() as fc:`` ... ``with fc.phase("forward"):`` ...

    Inside, ``torch.device("cuda")`` tensors are fake; :meth:`build` constructs modules directly on
    the device in a given dtype; :attr:`phases` records each phase's peak of live device bytes.
    """

    def __init__(self):
        self.memory = DeviceMemory()
        self.phases: list[PhasePeak] = []
        self._stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> "FakeCuda":
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        self._stack.enter_context(HostRealDeviceFake(self.memory))
        self._stack.enter_context(cuda_looks_available())
        self._stack.enter_context(FusedAttention())
        self._stack.enter_context(module_moves_set_data())
        self._stack.enter_context(node_hooks_kept())
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        stack.__exit__(*exc)

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
    def phase(self, name: str) -> Iterator[None]:
        self.memory.reset_peak()
        start = self.memory.current
        try:
            yield
        finally:
            self.phases.append(PhasePeak(name, start, self.memory.peak, self.memory.current))

    @property
    def current_bytes(self) -> int:
        return self.memory.current



class StandInTransport(HostTransport):
    """Block swapping's transport on the fake device (``memory/block_swap.py``): a swapped block's host copies
    are fake CPU tensors (no memory; the real ones are pinned host buffers), a swap-in copies them onto the
    fake device (counted as live device bytes, freed when the block is swapped out)."""

    def masters(self, tensors: list) -> list:
        return [torch.empty_like(t, device=self.offload_device) for t in tensors]
