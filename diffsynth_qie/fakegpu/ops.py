"""The fake device's op checks: what a GPU run would refuse or stall on becomes a :class:`FakeRunError`.

:class:`HostRealDeviceFake` sits on top of PyTorch's ``FakeTensorMode``. An operator whose inputs are all
real CPU tensors (and that makes no tensor on the device) runs for real, so host-side work keeps its values;
device operators go to the fake mode. A :class:`FakeRunError` names the operator, the line of our code that
asked for it and the fix, for: mixing a CPU and a CUDA tensor; operand dtypes a CUDA kernel refuses and FP8
reaching a matmul (``checks.py``); a generator on another device than its output; a device-to-host
copy inside a verified phase; reading a device tensor's value on the host (``.item()``, ``.tolist()``,
``.numpy()``, ``nonzero`` sizes, ``if tensor:``); a tensor copied on a side stream used before its copy
was waited for (``streams.py``). Pinned host memory is modelled: a pinned allocation is a fake host
tensor (no memory), counted at the size the pinned allocator would take. The patches below make the rest of
PyTorch behave as on a machine with a GPU (autocast, fused attention, module moves).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Optional

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           unset_fake_temporarily)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .checks import generator_device, holds_device_tensor, host_copy, op_leaves, operand_dtypes, stacked
from .accounting import FAKE_DEVICE_FILES, PACKAGE_DIR, DeviceMemory, is_device  # noqa: F401 (re-exported)
from .streams import StreamOrder

aten = torch.ops.aten
HOST_SYNC_HINT = ("on a GPU the host waits there for everything queued on the device, stalling the step; keep "
                  "the value on the device (or on the host from the start), or move the copy out of the step")


class FakeRunError(RuntimeError):
    """Something a real GPU run would fail on (device/dtype mismatch) or stall on (a host read)."""


class CheckingMode(TorchDispatchMode):
    """A dispatch mode of the fake device that ``torch.compile`` compiles under (``--compile``).

    Dynamo skips every frame while a dispatch mode without ``ignore_compile_internals`` is on the stack; with
    it, the mode is off while dynamo traces a frame (dynamo's own fake tensors check its shapes, devices and
    dtypes then, :func:`compiled_frame_error`) and on again while the compiled graph runs, so its operators
    are checked and counted here as eager ones are."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


# the wrappers around a compiled block's forward (the checkpoint inside the compiled region): not the line at fault
COMPILE_WRAPPERS = tuple(os.path.join("models", "load", name) for name in ("block_checkpoint.py", "compile.py"))


def compiled_frame_error(exc: BaseException) -> Optional[FakeRunError]:
    """What dynamo's trace of a compiled frame refused (a device or dtype mismatch: its fake tensors run the
    same checks a GPU kernel does), as a :class:`FakeRunError` naming our line in the traced code; None for
    any other error."""
    import re

    from torch._dynamo.exc import TorchDynamoException

    if not isinstance(exc, TorchDynamoException):
        return None
    text = str(exc)
    found = re.search(r"Explanation: (.+)", text)
    what = (found.group(1) if found else text.splitlines()[0]).strip()
    torch_dir = os.path.dirname(torch.__file__)
    frames = [(f, int(n), fn) for f, n, fn in re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)
              if not f.endswith(FAKE_DEVICE_FILES + COMPILE_WRAPPERS) and not f.startswith(torch_dir)]
    ours = [fr for fr in frames if fr[0].startswith(PACKAGE_DIR)] or frames
    where = "(unknown)"
    if ours:
        f, n, fn = ours[-1]
        f = os.path.relpath(f, os.path.dirname(PACKAGE_DIR)) if f.startswith(PACKAGE_DIR) else f
        where = f"{f}:{n} ({fn})"
    heading = text.splitlines()[0].strip().lower()
    if "mismatch" not in heading:  # (a checkpoint inside the compiled block wraps fake tensors' own error)
        if re.search(r"device mismatch|different devices|is not on the expected device", text, re.I):
            heading = "device mismatch"
        elif re.search(r"dtype mismatch", text, re.I):
            heading = "dtype mismatch"
    return FakeRunError(f"{heading} at {where} (found by torch.compile tracing the "
                        f"compiled block): {what}")


def our_frame() -> str:
    """``file:line (function)`` of the innermost frame in this package outside the fake device's modules,
    else the innermost frame outside torch (a caller's own code). The interpreter's frames are walked (no source
    lines read: it runs on every device copy)."""
    torch_dir = os.path.dirname(torch.__file__)
    for ours in (True, False):  # (no list of frames kept: it would hold their tensors in a reference cycle)
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_code.co_filename
            if not name.endswith(FAKE_DEVICE_FILES) and (name.startswith(PACKAGE_DIR) if ours
                                                        else not name.startswith(torch_dir)):
                where = os.path.relpath(name, os.path.dirname(PACKAGE_DIR)) if ours else name
                return f"{where}:{frame.f_lineno} ({frame.f_code.co_name})"
            frame = frame.f_back
    return "(unknown)"


class FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as a Hopper GPU runs it. The kernel choice happens in C++ before any
    fake tensor is seen, and without a device it picks the math fallback, which materialises every head's
    L x L scores; on a GPU the fused kernels keep O(L) memory. Flash attention takes bf16/fp16 without a mask,
    the memory-efficient kernel the rest (the ops autograd differentiates on a GPU too). Under
    ``torch.autocast("cuda")`` q, k, v (and a float mask) are cast first, as autocast does for attention.

    It also sees calls before PyTorch's C++ parses them: a ``generator=`` on the wrong device,
    ``torch.tensor([...])`` of device tensors (each read on the host) and ``.numpy()`` of a fake tensor."""

    def __init__(self, device_mode: Optional["HostRealDeviceFake"] = None):
        super().__init__()
        self.device_mode = device_mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("generator") is not None:
            wrong = generator_device(args, kwargs)
            if wrong:
                raise FakeRunError(f"{wrong.split(':')[0]} in {_name(func)} at {our_frame()}:"
                                   f"{wrong.split(':', 1)[1]}")
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _fused_sdpa(*args, **kwargs)
        if func is torch.tensor and args and holds_device_tensor(args[0]):
            phase = self.device_mode.phase if self.device_mode is not None else None
            if phase is not None:
                raise FakeRunError(f"host sync in torch.tensor([...device tensors]) at {our_frame()} (in the "
                                   f"'{phase}' phase): each element is read on the host; build it on the device "
                                   f"with torch.stack; {HOST_SYNC_HINT}")
            return stacked(args[0], kwargs.get("dtype"), kwargs.get("device"))
        if func is torch.Tensor.numpy and isinstance(args[0], FakeTensor):
            raise FakeRunError(f"host read of a device tensor (.numpy()) at {our_frame()}: the fake device has no "
                               f"values, and on a GPU reading them waits for the device; {HOST_SYNC_HINT}")
        return func(*args, **kwargs)


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))


def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if torch.is_autocast_enabled("cuda"):  # attention is on autocast's lower-precision list
        dtype = torch.get_autocast_dtype("cuda")
        query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dtype)
    if attn_mask is None and query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] <= 256:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernel takes an additive bias
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attn_mask, float("-inf"))
    if attn_mask is not None:
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, True, dropout_p, is_causal,
                                                        scale=scale)[0]


class HostRealDeviceFake(CheckingMode):
    """Sits on top of the ``FakeTensorMode``: host operators run for real, device ones go to the fake
    mode; device storages are counted; what a GPU would fail or stall on becomes a FakeRunError.
    ``phase`` names the verified phase running (``FakeCuda.phase``): there a device-to-host copy followed by
    more device work is a host sync (``sync`` holds its message until that work comes)."""

    def __init__(self, memory: DeviceMemory, streams: Optional[StreamOrder] = None):
        super().__init__()
        self.memory, self.streams = memory, streams or StreamOrder()
        self.phase: Optional[str] = None
        self.sync: Optional[str] = None
        self.counter = None  # a costs.CostCounter while a run's kernels are counted (FakeCuda(costs=...))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in PINNED_OPS or kwargs.get("pin_memory"):
            return self._pinned(func, args, kwargs)
        flat = op_leaves(args, kwargs)
        device_kw = kwargs.get("device")
        on_host = (not any(isinstance(a, FakeTensor) for a in flat)
                   and (device_kw is None or torch.device(device_kw).type == "cpu"))
        if on_host:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        self._check(func, args, kwargs, flat)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise FakeRunError(f"host read of a device tensor ({func}) at {our_frame()}: on a GPU this stalls the "
                               f"step until the device catches up; keep the value on the host or on the device "
                               f"({type(e).__name__})") from None
        except RuntimeError as e:
            kind = "device mismatch in" if "device" in str(e) else "error in"
            raise FakeRunError(f"{kind} {func} at {our_frame()}: {e}") from None
        outs = op_leaves(out)
        self.memory.add_tensors(outs)
        if self.counter is not None:
            self.counter.record(func, args, kwargs, out)
        if packet in (aten._to_copy, aten.copy_):
            self.streams.issued_copy(outs, our_frame())
        return out

    def _check(self, func, args, kwargs, flat) -> None:
        wrong = operand_dtypes(func, args)
        if wrong:
            raise FakeRunError(f"{wrong[0]} at {our_frame()}: {wrong[1]}")
        if self.sync is not None and any(is_device(a) for a in flat):
            raise FakeRunError(self.sync)
        if self.phase is not None and self.sync is None:
            what = host_copy(func, args, kwargs, self.memory.is_pinned)
            if what:  # a sync once more device work follows in the phase (its last copy is its result)
                self.sync = (f"host sync in {func} at {our_frame()} ({what}, in the '{self.phase}' phase, with "
                             f"device work after it): a device tensor is copied to the host; {HOST_SYNC_HINT}")
        if self.streams.pending:
            tag = self.streams.unwaited(flat)
            if tag is not None:
                raise FakeRunError(
                    f"stream order: {func} at {our_frame()} reads a tensor copied to the device on a side stream "
                    f"at {tag[2]} before the stream using it waited for that copy: on a GPU it can read a "
                    f"half-copied tensor; make the consuming stream wait (current_stream().wait_event(event) "
                    f"with the event recorded after the copy, or wait_stream(side_stream))")

    def _pinned(self, func, args, kwargs):
        """Pinned host memory without a driver: fake host tensors (a real copy for ``pin_memory()`` of a real
        one, whose values the host may still read), counted at the pinned allocator's size."""
        if func.overloadpacket is aten.is_pinned:
            return self.memory.is_pinned(args[0])
        if func.overloadpacket is aten._pin_memory:
            if isinstance(args[0], FakeTensor):
                out = aten.clone.default(args[0])
            else:
                with unset_fake_temporarily():
                    out = args[0].clone()
        else:  # a factory or copy with pin_memory=True
            out = func(*args, **dict(kwargs, pin_memory=False, device=kwargs.get("device") or "cpu"))
        self.memory.add_pinned(out)
        return out


PINNED_OPS = {aten.is_pinned, aten._pin_memory}


@contextlib.contextmanager
def cuda_looks_available() -> Iterator[None]:
    """What differs on a machine with a GPU: autocast("cuda") checks that CUDA (and bf16 on it) is available
    before enabling itself, and activation checkpointing of a call with keyword arguments only restores the
    autocast state of the default device type, "cuda" where CUDA is available."""
    from torch.utils.checkpoint import DefaultDeviceType

    amp_common = torch.cuda.amp.common
    saved = amp_common.amp_definitely_not_available, torch.cuda.is_bf16_supported, DefaultDeviceType.get_device_type()
    amp_common.amp_definitely_not_available = lambda: False
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    DefaultDeviceType.set_device_type("cuda")
    try:
        yield
    finally:
        amp_common.amp_definitely_not_available, torch.cuda.is_bf16_supported, default = saved
        DefaultDeviceType.set_device_type(default)


@contextlib.contextmanager
def module_moves_set_data() -> Iterator[None]:
    """``module.to(...)`` moves a fake parameter with ``torch.utils.swap_tensors``, which the fake mode's own
    weak references to its tensors forbid ("Couldn't swap Linear.weight"). Between two fake tensors the move
    becomes ``param.data = moved``, the path real CUDA parameters take."""
    saved = torch.utils.swap_tensors

    def swap(t1, t2):
        if isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor):
            if t1.device != t2.device:  # `.data` across fake devices leaves a bare meta tensor behind
                raise FakeRunError(f"moving a module from {t1.device} to {t2.device} is not supported on the fake "
                                   f"device (at {our_frame()}); build it where it runs")
            t1.data = t2.detach()
            return
        saved(t1, t2)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = saved

