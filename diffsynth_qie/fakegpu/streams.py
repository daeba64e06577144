"""The CUDA calls a GPU run may legally make, modelled on the fake device, and the stream order they imply.

Creating a real stream, event, CUDA generator or pinned buffer asks the driver, which a machine without a GPU
does not have. Under :class:`~.fake_device.FakeCuda` they are modelled instead:

- ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``default_stream`` / ``stream(...)`` / ``set_stream``
  / ``synchronize`` and ``Tensor.record_stream``: streams and events that record the order of work, no driver;
- ``torch.Generator("cuda")``: a generator that says it lives on the device (its draws are made by a CPU
  generator, which the fake device never reads);
- pinned host memory (``pin_memory=True``, ``Tensor.pin_memory()``, ``is_pinned()``): ``ops.py``.

**Stream order.** A copy issued while a side stream is current (block swapping's prefetch,
``memory/block_swap.py``) tags the tensor it makes with that stream, the copy's position on it and the line
that issued it. An operator on another stream that reads a tagged tensor before that stream waited for the
copy (``wait_event`` of an event recorded after it, ``wait_stream``, ``synchronize``) is a
:class:`~.fake_ops.FakeRunError`: on a GPU it would read a half-copied tensor.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Iterator, Optional

import torch

_ACTIVE: list["StreamOrder"] = []


def _order() -> "StreamOrder":
    if not _ACTIVE:
        raise RuntimeError("a modelled CUDA stream or event was used outside the fake device session")
    return _ACTIVE[-1]


class FakeStream:
    """A CUDA stream on the fake device: a counter of the work issued on it and what it waited for."""

    _ids = itertools.count()

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device("cuda", 0) if device is None else torch.device(device)
        if self.device.index is None:
            self.device = torch.device(self.device.type, 0)
        self.priority, self.id, self.seq = priority, next(self._ids), 0
        self.waited: dict[int, int] = {}  # stream id -> how much of its work this stream waited for
        self.cuda_stream, self.device_index, self.device_type = self.id, self.device.index, 1
        if _ACTIVE:
            _ACTIVE[-1].streams.append(weakref.ref(self))

    def wait_event(self, event: "FakeEvent") -> None:
        if event.stream is not None:
            self.waited[event.stream.id] = max(self.waited.get(event.stream.id, 0), event.seq)

    def wait_stream(self, stream: "FakeStream") -> None:
        self.waited[stream.id] = max(self.waited.get(stream.id, 0), stream.seq)

    def record_event(self, event: Optional["FakeEvent"] = None) -> "FakeEvent":
        event = event or FakeEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """The host waits for this stream (no stream waits for it)."""

    def __eq__(self, other) -> bool:
        return isinstance(other, FakeStream) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("fake stream", self.id))

    def __repr__(self) -> str:
        return f"<fake torch.cuda.Stream {self.id} on {self.device}>"


class FakeEvent:
    """A CUDA event: the position on a stream where it was recorded."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.stream: Optional[FakeStream] = None
        self.seq = 0

    def record(self, stream: Optional[FakeStream] = None) -> None:
        self.stream = stream or _order().current
        self.seq = self.stream.seq

    def wait(self, stream: Optional[FakeStream] = None) -> None:
        (stream or _order().current).wait_event(self)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """The host waits for the event."""

    def elapsed_time(self, end_event: "FakeEvent") -> float:
        return 0.0


def fake_generator_class():
    """``torch.Generator`` that accepts a CUDA device: a CPU generator whose ``device`` is the one asked for."""

    class _Meta(type(torch._C.Generator)):
        def __instancecheck__(cls, obj):  # generators made before the session (and C++'s) are generators too
            return isinstance(obj, torch._C.Generator)

    class Generator(torch._C.Generator, metaclass=_Meta):
        def __new__(cls, device="cpu"):
            device = torch.device(device)
            gen = super().__new__(cls, "cpu")
            gen._qie_device = torch.device(device.type, 0) if device.type == "cuda" and device.index is None \
                else device
            return gen

        def __init__(self, device="cpu"):
            pass

        @property
        def device(self):
            return self._qie_device

    return Generator


class StreamOrder:
    """The session's streams: which is current, and the device tensors whose side-stream copy is not yet
    known to be waited for (by storage)."""

    def __init__(self):
        self.streams: list[weakref.ref] = []
        self.default = FakeStream()
        self.streams.append(weakref.ref(self.default))
        self.current = self.default
        self.pending: dict[int, tuple[FakeStream, int, str]] = {}

    def synchronize(self, device=None) -> None:
        """The host waits for every stream: whatever is issued next sees all work so far."""
        live = [s for s in (ref() for ref in self.streams) if s is not None]
        for s in live:
            for other in live:
                s.wait_stream(other)

    @contextlib.contextmanager
    def stream(self, stream: Optional[FakeStream]) -> Iterator[None]:
        saved = self.current
        if stream is not None:
            self.current = stream
        try:
            yield
        finally:
            self.current = saved

    def issued_copy(self, tensors, frame: str) -> None:
        """A copy onto the device on the current stream made ``tensors``; tag them if that is a side stream."""
        if self.current is self.default:
            return
        self.current.seq += 1
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                storage = t.untyped_storage()
                key = id(storage)
                self.pending[key] = (self.current, self.current.seq, frame)
                weakref.finalize(storage, self.pending.pop, key, None)

    def unwaited(self, tensors) -> Optional[tuple[FakeStream, int, str]]:
        """The tag of the first of ``tensors`` whose copy the current stream has not waited for."""
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
                continue
            key = id(t.untyped_storage())
            tag = self.pending.get(key)
            if tag is None:
                continue
            stream, seq, _ = tag
            if stream is self.current:
                continue
            if self.current.waited.get(stream.id, 0) >= seq:
                del self.pending[key]  # ordered from now on (streams only move forward)
                continue
            return tag
        return None


@contextlib.contextmanager
def modelled_cuda_calls() -> Iterator[StreamOrder]:
    """Patch the CUDA API a GPU run may call with the models above for the session; yields its stream order."""
    order = StreamOrder()
    cuda = torch.cuda
    names = ("Stream", "Event", "current_stream", "default_stream", "stream", "set_stream", "synchronize")
    saved = {name: getattr(cuda, name) for name in names}
    saved_generator, saved_record = torch.Generator, torch.Tensor.record_stream

    def set_stream(stream):
        order.current = stream

    cuda.Stream, cuda.Event = FakeStream, FakeEvent
    cuda.current_stream = lambda device=None: order.current
    cuda.default_stream = lambda device=None: order.default
    cuda.stream, cuda.set_stream, cuda.synchronize = order.stream, set_stream, order.synchronize
    torch.Generator = fake_generator_class()
    torch.Tensor.record_stream = lambda self, stream: None  # the caching allocator's bookkeeping only
    _ACTIVE.append(order)
    try:
        yield order
    finally:
        _ACTIVE.remove(order)
        for name, value in saved.items():
            setattr(cuda, name, value)
        torch.Generator, torch.Tensor.record_stream = saved_generator, saved_record
