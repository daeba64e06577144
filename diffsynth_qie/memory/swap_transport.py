"""Block swapping's transports: the swapped blocks' host copies and the copies onto the device.

:class:`CudaTransport` keeps each block's frozen tensors in one pinned host buffer and copies them on a side
CUDA stream, ordered by an event the compute stream waits for; :class:`HostTransport` is the same mechanism
between two host tensor sets (CPU runs and tests). ``memory/block_swap.py`` explains the swapping itself.

**Pinned buffers are exact-size.** PyTorch's pinned-memory allocator rounds every allocation up to a power of
two unless it exceeds ``pinned_max_round_threshold_mb`` of its allocator settings (default: no limit): a
648 MiB bf16 block would take 1024 MiB, a 324 MiB FP8 one 512 MiB, 1.58x. Whenever blocks are swapped on a GPU,
:func:`exact_pinned_memory` sets that threshold to :data:`PINNED_EXACT_ABOVE_MB` (unless the user set it),
in ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF`` where that is the one set) for processes started
later, and in the running process's allocator settings, which the pinned allocator reads at each allocation
(so it holds after CUDA has initialised too). Smaller pinned allocations (batches) keep the rounding, which
lets the allocator reuse them. :func:`pinned_allocation_bytes` is the size one allocation takes.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Optional

import torch

log = logging.getLogger(__name__)

Tensor = torch.Tensor

PINNED_EXACT_ABOVE_MB = 16
"""Pinned allocations above this many MiB are exact-size while blocks are swapped (a block of the real DiT is
324-648 MiB)."""
NO_LIMIT = 2 ** 64 - 1  # the allocator's default threshold (SIZE_MAX): every pinned allocation is rounded
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the first set wins (libc10's order)
_THRESHOLD = re.compile(r"pinned_max_round_threshold_mb\s*:\s*(\d+)")
_exact_above: Optional[int] = None  # bytes, once exact_pinned_memory() ran in this process


def _configured_threshold() -> int:
    """The pinned allocator's rounding threshold in bytes, as this process configured it."""
    if _exact_above is not None:
        return _exact_above
    for var in ALLOC_CONF_VARS:
        if os.environ.get(var):
            match = _THRESHOLD.search(os.environ[var])
            return int(match.group(1)) << 20 if match else NO_LIMIT
    return NO_LIMIT


def pinned_allocation_bytes(size: int, exact_above: Optional[int] = None) -> int:
    """Host bytes one pinned allocation of ``size`` bytes takes: ``size`` above the rounding threshold
    (``exact_above`` bytes; default: this process's setting), else the next power of two."""
    threshold = _configured_threshold() if exact_above is None else exact_above
    if size <= 0 or size > threshold:
        return max(size, 0)
    return 1 << (size - 1).bit_length()


def exact_pinned_memory(mb: int = PINNED_EXACT_ABOVE_MB) -> None:
    """Make pinned allocations above ``mb`` MiB exact-size (see the module docstring); a threshold the user
    set in the allocator settings is kept."""
    global _exact_above
    var = next((v for v in ALLOC_CONF_VARS if os.environ.get(v)), ALLOC_CONF_VARS[1])
    current = os.environ.get(var, "")
    match = _THRESHOLD.search(current)
    if match:
        _exact_above = int(match.group(1)) << 20
        return
    setting = f"pinned_max_round_threshold_mb:{mb}"
    try:  # the running allocator first: an older PyTorch (2.11) has no such key, and then neither may the
        torch._C._accelerator_setAllocatorSettings(setting)  # environment, which would stop any later process
    except (ValueError, RuntimeError, AttributeError) as exc:
        _exact_above = NO_LIMIT
        log.warning("PyTorch %s cannot make pinned allocations exact-size (%s): each swapped block's host buffer "
                    "is rounded up to a power of two (up to 1.6x its size in host RAM); PyTorch 2.14 avoids that",
                    torch.__version__, exc)
        return
    os.environ[var] = f"{current},{setting}" if current else setting
    _exact_above = mb << 20
    log.debug("pinned host allocations above %d MiB are exact-size (%s)", mb, var)


ALIGN = 256  # bytes: every master starts at an aligned offset of its block's buffer


def block_layout(tensors: list[Tensor]) -> tuple[list[int], int]:
    """Byte offsets of ``tensors`` packed into one buffer (each start aligned to :data:`ALIGN`), and its size."""
    offsets, total = [], 0
    for t in tensors:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    return offsets, total


class HostTransport:
    """Copies between two host tensor sets: the mechanism without a GPU (CPU runs and tests)."""

    pin_memory = False

    def __init__(self, device, offload_device):
        self.device, self.offload_device = torch.device(device), torch.device(offload_device)

    def masters(self, tensors: list[Tensor]) -> list[Tensor]:
        """Offload copies of a block's frozen tensors, carved out of one buffer: one allocation per block
        (exact-size when pinned: :func:`exact_pinned_memory`)."""
        offsets, total = block_layout(tensors)
        buffer = torch.empty(total, dtype=torch.uint8, device=self.offload_device, pin_memory=self.pin_memory)
        out = []
        for t, offset in zip(tensors, offsets):
            view = buffer[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t.detach())
            out.append(view)
        return out

    def evicted(self, master: Tensor) -> Tensor:
        """What a parameter points at while its block is out."""
        return master

    def start(self, masters: list[Tensor]):
        """Begin copying ``masters`` to the device; returns a handle for :meth:`finish`."""
        return [m.to(self.device, copy=True) for m in masters]

    def finish(self, handle) -> list[Tensor]:
        """The device tensors, ready for the compute stream."""
        return handle


class CudaTransport(HostTransport):
    """Pinned host masters (one pinned buffer per block), copies on a side CUDA stream ordered by events."""

    pin_memory = True

    def __init__(self, device, offload_device):
        super().__init__(device, offload_device)
        exact_pinned_memory()  # before the first pinned buffer
        self.stream = torch.cuda.Stream(device=self.device)

    def start(self, masters: list[Tensor]):
        with torch.cuda.stream(self.stream):
            tensors = [m.to(self.device, non_blocking=True) for m in masters]
            event = torch.cuda.Event()
            event.record(self.stream)
        return tensors, event

    def finish(self, handle) -> list[Tensor]:
        tensors, event = handle
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in tensors:  # allocated on the side stream, used (and freed) on the compute stream
            t.record_stream(current)
        return tensors


def default_transport(device, offload_device) -> HostTransport:
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTransport(device, offload_device)
    if device.type == "cpu":
        log.warning("block swapping on the CPU saves no memory (it only exercises the mechanism)")
    return HostTransport(device, offload_device)
