"""The fake device's allocator accounting: live bytes of device storages and the peak per phase.

Every device storage is registered when an operator makes it (``fake_ops.HostRealDeviceFake``) and released
when Python frees it (storages keep their Python object while alive), so the peak of live bytes per phase is
exact for what the program holds. It cannot see allocator fragmentation, the caching allocator's rounding,
cuBLAS/cuDNN workspaces or the CUDA context (``docs/MEMORY.md``). Pinned host memory is counted apart
(``pinned``), at the size PyTorch's pinned allocator takes (``swap_transport.pinned_allocation_bytes``).
"""
from __future__ import annotations

import dataclasses
import weakref

import torch

from .swap_transport import pinned_allocation_bytes


def is_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


@dataclasses.dataclass
class PhasePeak:
    name: str
    start_bytes: int  # live device bytes when the phase began
    peak_bytes: int  # the highest live device bytes during the phase
    end_bytes: int  # live device bytes when it ended


class DeviceMemory:
    """Live bytes of device storages, with the peak since the last :meth:`reset_peak`."""

    def __init__(self):
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.pinned_live: dict[int, int] = {}
        self.pinned = 0  # live pinned host bytes

    def add_pinned(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self.pinned_live:
            self.pinned_live[key] = pinned_allocation_bytes(storage.nbytes())
            self.pinned += self.pinned_live[key]
            weakref.finalize(storage, self._unpin, key)

    def _unpin(self, key: int) -> None:
        self.pinned -= self.pinned_live.pop(key, 0)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) in self.pinned_live

    def add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def add_tensors(self, tensors) -> None:
        for t in tensors:
            if is_device(t):
                self.add(t.untyped_storage())

    def reset_peak(self) -> None:
        self.peak = self.current

