"""A fake CUDA device: the real model code at full size, with no GPU, no memory and no arithmetic.

PyTorch's ``FakeTensorMode`` runs every operator for shapes, dtypes and devices only. Under
:func:`fake_cuda`, tensors can live on ``cuda:0`` on a machine without a GPU, so the real 20 B DiT
builds in seconds and a whole training step or edit runs through our code exactly as on a GPU.
Three things are added on top of the mode:

- **The host stays real.** An operator whose inputs are all real CPU tensors (and that makes no
  tensor on the device) runs for real: σ draws, CPU noise, index lists and other host-side work
  keep their values, so the code takes the same branches it takes on a GPU.
- **What a GPU run would refuse, or stall on, is an error.** Mixing a CPU and a CUDA tensor raises
  ``FakeTensorDeviceMismatchError`` as on a GPU; reading a device tensor's value on the host
  (``.item()``, ``.tolist()``, ``nonzero`` sizes, ``if tensor:``) would be a host sync. Both become a
  :class:`FakeRunError` naming the operator and the line of our code that asked for it.
- **Live device bytes are counted.** Every device storage is registered when an operator makes it and
  released when Python frees it (storages keep their Python object while alive), so the peak of live
  bytes per phase is exact for what the program holds. It cannot see allocator fragmentation, the
  caching allocator's rounding, cuBLAS/cuDNN workspaces or the CUDA context (``docs/MEMORY.md``).

CUDA streams and events cannot be faked (creating one initialises CUDA), so block swapping runs with
:class:`StandInTransport`: the swapped blocks' host copies are fake CPU tensors (no memory, no values),
and a swap-in is a plain copy onto the fake device, counted like any other. PyTorch's autograd engine
cannot run a backward pass over fake CUDA tensors on a machine without a GPU either (it asks the driver for
each device's primary context): :func:`backward` walks the graph itself, in the engine's order, releasing
each node once it has run, as the engine does; it also runs modules' backward (pre-)hooks and the
callbacks queued on the engine, which block swapping relies on.
"""
from __future__ import annotations

import contextlib
import dataclasses
import heapq
import os
import traceback
import weakref
from typing import Iterator, Optional

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, unset_fake_temporarily)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .block_swap import HostTransport

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeRunError(RuntimeError):
    """Something a real GPU run would fail on (device/dtype mismatch) or stall on (a host read)."""


def our_frame() -> str:
    """``file:line (function)`` of the innermost frame in this package outside this module, else the innermost
    frame outside torch (a caller's own code)."""
    stack = list(reversed(traceback.extract_stack()))
    for frame in stack:
        if frame.filename.startswith(PACKAGE_DIR) and not frame.filename.endswith("fake_device.py"):
            return f"{os.path.relpath(frame.filename, os.path.dirname(PACKAGE_DIR))}:{frame.lineno} ({frame.name})"
    torch_dir = os.path.dirname(torch.__file__)
    for frame in stack:
        if not frame.filename.startswith(torch_dir) and not frame.filename.endswith("fake_device.py"):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "(unknown)"


def _is_device(t) -> bool:
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
            if _is_device(t):
                self.add(t.untyped_storage())

    def reset_peak(self) -> None:
        self.peak = self.current


class _FusedAttention(TorchFunctionMode):
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


class _HostRealDeviceFake(TorchDispatchMode):
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
def _cuda_looks_available() -> Iterator[None]:
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
def _module_moves_set_data() -> Iterator[None]:
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
        self._stack.enter_context(_HostRealDeviceFake(self.memory))
        self._stack.enter_context(_cuda_looks_available())
        self._stack.enter_context(_FusedAttention())
        self._stack.enter_context(_module_moves_set_data())
        self._stack.enter_context(_node_hooks_kept())
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


def _as_input(grad: torch.Tensor, meta) -> torch.Tensor:
    """What the engine's ``validate_outputs`` makes of a gradient: summed to the input's (broadcast) shape
    and cast to its dtype."""
    shape = tuple(meta.shape)
    if tuple(grad.shape) != shape:
        grad = grad.sum_to_size(shape)
    return grad if grad.dtype == meta.dtype else grad.to(meta.dtype)


_NODE_HOOKS = "_qie_fake_hooks"


@contextlib.contextmanager
def _node_hooks_kept() -> Iterator[None]:
    """Hooks registered on custom-function nodes (what ``register_full_backward_pre_hook`` and
    ``register_full_backward_hook`` put on a module's ``BackwardHookFunction`` nodes) are kept on the node,
    where :func:`backward` finds and runs them; the engine's own hook lists are not readable from Python."""
    from torch.autograd.function import BackwardCFunction

    saved = BackwardCFunction.__dict__.get("register_hook")

    def register_hook(node, hook):
        node.__dict__.setdefault(_NODE_HOOKS, []).append(hook)

    BackwardCFunction.register_hook = register_hook
    try:
        yield
    finally:
        if saved is None:
            del BackwardCFunction.register_hook
        else:
            BackwardCFunction.register_hook = saved


class _Engine:
    """Stands in for the autograd engine while :func:`backward` runs: ``queue_callback`` collects the
    callbacks, which run when the walk ends (the engine runs them at the end of the backward pass)."""

    def __init__(self, real):
        self.real, self.callbacks = real, []

    def queue_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _call(fn, inputs: list) -> tuple:
    """Run one node as the engine does. A custom ``autograd.Function`` node returns one gradient per forward
    argument (None for non-tensors); the engine keeps those of the tensors that require grad, in the order
    of the node's next functions, and hands it zeros for outputs that got no gradient."""
    if not hasattr(fn, "_forward_cls"):
        outputs = fn(*inputs)
        return outputs if isinstance(outputs, tuple) else (outputs,)
    inputs = [torch.zeros(tuple(m.shape), dtype=m.dtype, device=m.device) if g is None else g
              for g, m in zip(inputs, fn._input_metadata)]  # materialised (the default; ours never turn it off)
    outputs = fn.apply(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for hook in fn.__dict__.get(_NODE_HOOKS, ()):  # a module's backward (pre-)hooks, as the engine calls them
        replaced = hook(outputs, tuple(inputs))
        if replaced is not None:
            outputs = tuple(replaced)
    wanted = iter(g for g, need in zip(outputs, fn.needs_input_grad) if need)
    return tuple(next(wanted, None) if nxt is not None else None for nxt, _ in fn.next_functions)


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` for fake CUDA tensors (see the module docstring).

    Nodes run once all their consumers have run, the most recently created first (the engine's order on
    one device); a node is freed, with the tensors it saved, as soon as it has run. Gradients reach leaf
    tensors through their ``AccumulateGrad`` nodes. Modules' backward hooks run (their nodes keep them,
    :func:`_node_hooks_kept`), and so do module forward hooks, also in the recompute of checkpointed blocks,
    saved-tensor hooks (non-reentrant checkpointing, seeing one graph task) and callbacks queued on the engine.
    """
    root = loss.grad_fn
    if root is None:
        raise ValueError("backward: the loss does not require grad (no trainable parameter reached it)")
    consumers: dict[int, int] = {}
    stack, seen = [root], {id(root)}
    while stack:
        for nxt, _ in stack.pop().next_functions:
            if nxt is None:
                continue
            consumers[id(nxt)] = consumers.get(id(nxt), 0) + 1
            if id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append(nxt)
    del stack, seen
    grads: dict[int, list] = {id(root): [torch.ones_like(loss)]}
    ready = [(-root._sequence_nr(), 0, root)]
    del root
    counter = 1
    real_task_id = torch._C._current_graph_task_id
    torch._C._current_graph_task_id = lambda: 1  # one graph task: each checkpointed block recomputes once
    engine = torch.autograd.Variable._execution_engine = _Engine(torch.autograd.Variable._execution_engine)
    try:
        while ready:
            _, _, fn = heapq.heappop(ready)
            inputs = grads.pop(id(fn))
            width = len(fn._input_metadata) if hasattr(fn, "_input_metadata") else len(inputs)
            inputs += [None] * (width - len(inputs))
            with torch.no_grad():  # as in the engine (no create_graph): gradients build no graph of their own
                outputs = _call(fn, inputs)
            grad = buffer = None
            for (nxt, slot), grad in zip(fn.next_functions, outputs):
                if nxt is None:
                    continue
                buffer = grads.setdefault(id(nxt), [])
                buffer += [None] * (slot + 1 - len(buffer))
                if grad is not None:
                    grad = _as_input(grad, nxt._input_metadata[slot])
                    buffer[slot] = grad if buffer[slot] is None else buffer[slot] + grad
                consumers[id(nxt)] -= 1
                if consumers[id(nxt)] == 0:
                    heapq.heappush(ready, (-nxt._sequence_nr(), counter, nxt))
                    counter += 1
            fn = inputs = outputs = grad = buffer = None  # drop the node: it frees what it saved
        for callback in engine.callbacks:
            callback()
    finally:
        torch._C._current_graph_task_id = real_task_id
        torch.autograd.Variable._execution_engine = engine.real


class StandInTransport(HostTransport):
    """Block swapping's transport on the fake device (``memory/block_swap.py``): a swapped block's host copies
    are fake CPU tensors (no memory; the real ones are pinned host buffers), a swap-in copies them onto the
    fake device (counted as live device bytes, freed when the block is swapped out)."""

    def masters(self, tensors: list) -> list:
        return [torch.empty_like(t, device=self.offload_device) for t in tensors]
