"""The fake device's allocator accounting: live bytes of device storages, the peak per phase, and who holds them.

Every device storage is registered when an operator makes it (``fake_ops.HostRealDeviceFake``) and released
when Python frees it (storages keep their Python object while alive), so the peak of live bytes per phase is
exact for what the program holds. It cannot see allocator fragmentation, the caching allocator's rounding,
cuBLAS/cuDNN workspaces or the CUDA context (``docs/MEMORY.md``). Pinned host memory is counted apart
(``pinned``), at the size PyTorch's pinned allocator takes (``swap_transport.pinned_allocation_bytes``).

Each storage is also attributed to the frame that allocated it: the innermost frame of our own code (this
package, its tests and benchmarks: not torch, DiffSynth, transformers, the standard library or the fake
device's modules), as ``file:line (function)``. At the highest moment of a session, the live bytes per frame
are kept (:attr:`DeviceMemory.top_holders`), so a memory verdict can name the largest holders.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import sysconfig
import weakref
from typing import Iterator, Optional

import torch

from ..memory.swap_transport import pinned_allocation_bytes

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT_DIR = os.path.dirname(PACKAGE_DIR)
# the fake device's own modules: never "our frame" in a message or an attribution
FAKE_DEVICE_FILES = tuple(os.sep + os.path.join("fakegpu", name) for name in (
    "device.py", "ops.py", "accounting.py", "backward.py", "checks.py", "streams.py", "costs.py"))
_recorders: list[list] = []


def is_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


@dataclasses.dataclass
class PhasePeak:
    name: str
    start_bytes: int  # live device bytes when the phase began
    peak_bytes: int  # the highest live device bytes during the phase
    end_bytes: int  # live device bytes when it ended


class DeviceMemory:
    """Live bytes of device storages, with the peak since the last :meth:`reset_peak`, and the live bytes per
    allocating frame at the session's highest moment (:attr:`top`, :attr:`top_holders`)."""

    def __init__(self):
        self.live: dict[int, tuple[int, str]] = {}
        self.current = 0
        self.peak = 0
        self.pinned_live: dict[int, int] = {}
        self.pinned = 0  # live pinned host bytes
        self.by_where: dict[str, int] = {}
        self.top = 0  # the highest live bytes of the session (never reset)
        self._top_where: dict[str, int] = {}
        for recorder in _recorders:
            recorder.append(self)

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

    def add(self, storage: torch.UntypedStorage, where: Optional[str] = None) -> None:
        """Count ``storage`` as live until Python frees it; ``where``: its allocating frame (default: found)."""
        key = id(storage)
        if key in self.live:
            return
        size = storage.nbytes()
        where = where or allocating_frame()
        self.live[key] = (size, where)
        self.current += size
        self.by_where[where] = self.by_where.get(where, 0) + size
        self.peak = max(self.peak, self.current)
        if self.current > self.top:
            self.top = self.current
            self._top_where = dict(self.by_where)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        size, where = self.live.pop(key, (0, ""))
        self.current -= size
        if size:
            left = self.by_where[where] - size
            if left:
                self.by_where[where] = left
            else:
                del self.by_where[where]

    def add_tensors(self, tensors, where: Optional[str] = None) -> None:
        for t in tensors:
            if is_device(t):
                self.add(t.untyped_storage(), where)

    def reset_peak(self) -> None:
        self.peak = self.current

    def snapshot(self) -> "Held":
        """What is live now: the bytes per allocating frame and the storages (two compared: :func:`grown`)."""
        return Held(dict(self.by_where), frozenset(self.live))

    def top_holders(self, n: int = 5) -> list[tuple[str, int]]:
        """The ``n`` frames holding the most live bytes at the session's highest moment, largest first."""
        return sorted(self._top_where.items(), key=lambda kv: -kv[1])[:n]

    def bytes_from(self, path_part: str) -> int:
        """Live bytes at the highest moment allocated in files whose path contains ``path_part``."""
        return sum(b for where, b in self._top_where.items() if path_part in where.split(":")[0])


@dataclasses.dataclass(frozen=True)
class Held:
    """A :meth:`DeviceMemory.snapshot`: live bytes per allocating frame, and the ids of the live storages."""

    by_where: dict
    storages: frozenset

    @property
    def total(self) -> int:
        return sum(self.by_where.values())


def grown(before: Held, after: Held) -> list[tuple[str, int]]:
    """The frames holding more live bytes in the snapshot ``after`` than in ``before``, most first."""
    was = before.by_where
    more = [(where, b - was.get(where, 0)) for where, b in after.by_where.items() if b > was.get(where, 0)]
    return sorted(more, key=lambda kv: -kv[1])


@contextlib.contextmanager
def recorded_sessions() -> Iterator[list]:
    """Inside, every :class:`DeviceMemory` made (one per fake-device session) is appended to the list yielded,
    so a caller can read the holders of a run it did not open the session for."""
    out: list = []
    _recorders.append(out)
    try:
        yield out
    finally:
        _recorders.remove(out)


_OTHERS = tuple(os.path.join(p, "") for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                              sysconfig.get_paths()["platlib"], os.path.dirname(torch.__file__)})
_ours_cache: dict[str, Optional[str]] = {}


def _ours(filename: str) -> Optional[str]:
    """``filename`` relative to the project when it is our code (not the fake device's own modules), else None."""
    if filename not in _ours_cache:
        ours = (filename.startswith(PROJECT_DIR) and not filename.startswith(_OTHERS)
                and not any(os.sep + d + os.sep in filename for d in ("diffsynth", ".venv", "site-packages"))
                and not filename.endswith(FAKE_DEVICE_FILES))
        _ours_cache[filename] = os.path.relpath(filename, PROJECT_DIR) if ours else None
    return _ours_cache[filename]


def allocating_frame() -> str:
    """``file:line (function)`` of the innermost frame of our code (relative to the project), found by walking
    the interpreter's frames (cheap enough for every allocation, unlike ``traceback.extract_stack``)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = _ours(frame.f_code.co_filename)
        if name is not None:
            return f"{name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "(outside our code)"
