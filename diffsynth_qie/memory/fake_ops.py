"""The fake device's op checks: what a GPU run would refuse or stall on becomes a :class:`FakeRunError`.

:class:`HostRealDeviceFake` sits on top of PyTorch's ``FakeTensorMode``. An operator whose inputs are all
real CPU tensors (and that makes no tensor on the device) runs for real, so host-side work keeps its values;
device operators go to the fake mode. Mixing a CPU and a CUDA tensor (or dtypes a kernel refuses) and reading
a device tensor's value on the host (``.item()``, ``.tolist()``, ``nonzero`` sizes, ``if tensor:``) raise a
:class:`FakeRunError` naming the operator and the line of our code that asked for it. The patches below make
the rest of PyTorch behave as on a machine with a GPU (autocast, fused attention, module moves).
"""
from __future__ import annotations

import contextlib
import os
import traceback
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           unset_fake_temporarily)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .fake_memory import DeviceMemory

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The fake device's own modules: a FakeRunError names the frame that called into them, never theirs.
FAKE_DEVICE_FILES = ("fake_device.py", "fake_ops.py", "fake_memory.py", "fake_backward.py")


class FakeRunError(RuntimeError):
    """Something a real GPU run would fail on (device/dtype mismatch) or stall on (a host read)."""


def our_frame() -> str:
    """``file:line (function)`` of the innermost frame in this package outside the fake device's modules,
    else the innermost frame outside torch (a caller's own code)."""
    stack = list(reversed(traceback.extract_stack()))
    for frame in stack:
        if frame.filename.startswith(PACKAGE_DIR) and not frame.filename.endswith(FAKE_DEVICE_FILES):
            return f"{os.path.relpath(frame.filename, os.path.dirname(PACKAGE_DIR))}:{frame.lineno} ({frame.name})"
    torch_dir = os.path.dirname(torch.__file__)
    for frame in stack:
        if not frame.filename.startswith(torch_dir) and not frame.filename.endswith(FAKE_DEVICE_FILES):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "(unknown)"


class FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as a Hopper GPU runs it. The kernel choice happens in C++ before any
    fake tensor is seen, and without a device it picks the math fallback, which materialises every head's
    L x L scores; on a GPU the fused kernels keep O(L) memory. Flash attention takes bf16/fp16 without a mask,
    the memory-efficient kernel the rest (the ops autograd differentiates on a GPU too)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return _fused_sdpa(*args, **kwargs)


def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    aten = torch.ops.aten
    if attn_mask is None and query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] <= 256:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernel takes an additive bias
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attn_mask, float("-inf"))
    if attn_mask is not None:
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, True, dropout_p, is_causal,
                                                        scale=scale)[0]


class HostRealDeviceFake(TorchDispatchMode):
    """Sits on top of the ``FakeTensorMode``: host operators run for real, device ones go to the fake
    mode; device storages are counted; what a GPU would fail or stall on becomes a FakeRunError."""

    def __init__(self, memory: DeviceMemory):
        super().__init__()
        self.memory = memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        device_kw = kwargs.get("device")
        on_host = (not any(isinstance(a, FakeTensor) for a in flat)
                   and (device_kw is None or torch.device(device_kw).type == "cpu"))
        if on_host:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise FakeRunError(f"host read of a device tensor ({func}) at {our_frame()}: on a GPU this stalls the "
                               f"step until the device catches up; keep the value on the host or on the device "
                               f"({type(e).__name__})") from None
        except RuntimeError as e:
            kind = "device mismatch in" if "device" in str(e) else "error in"
            raise FakeRunError(f"{kind} {func} at {our_frame()}: {e}") from None
        self.memory.add_tensors(tree_flatten(out)[0])
        return out


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

