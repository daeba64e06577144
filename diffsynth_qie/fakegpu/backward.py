"""``loss.backward()`` over fake CUDA tensors, on a machine without a GPU.

PyTorch's autograd engine cannot run a backward pass over fake CUDA tensors without a GPU (it asks the driver
for each device's primary context): :func:`backward` walks the graph itself, in the engine's order, releasing
each node once it has run, as the engine does; it also runs modules' backward (pre-)hooks and the callbacks
queued on the engine, which block swapping relies on.
"""
from __future__ import annotations

import contextlib
import heapq
from typing import Iterator

import torch


def _as_input(grad: torch.Tensor, meta) -> torch.Tensor:
    """What the engine's ``validate_outputs`` makes of a gradient: summed to the input's (broadcast) shape
    and cast to its dtype."""
    shape = tuple(meta.shape)
    if tuple(grad.shape) != shape:
        grad = grad.sum_to_size(shape)
    return grad if grad.dtype == meta.dtype else grad.to(meta.dtype)


_NODE_HOOKS = "_qie_fake_hooks"


@contextlib.contextmanager
def node_hooks_kept() -> Iterator[None]:
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
    :func:`node_hooks_kept`), and so do module forward hooks, also in the recompute of checkpointed blocks,
    saved-tensor hooks (non-reentrant checkpointing, seeing one graph task) and callbacks queued on the engine.
    """
    root = loss.grad_fn
    if root is None:
        raise ValueError("backward: the loss does not require grad (no trainable parameter reached it)")
    consumers: dict[int, int] = {}
    # Nodes are known by the id of their Python wrapper, so each wrapper is held until its node has run: a
    # wrapper nothing holds is freed, and the next ``next_functions`` makes the same node a new one with another
    # id (PyTorch 2.11 does). Holding it keeps nothing alive longer: the edges of its consumers hold the node
    # until the last of them has run, and that is when it becomes ready.
    alive = {id(root): root}
    stack = [root]
    while stack:
        for nxt, _ in stack.pop().next_functions:
            if nxt is None:
                continue
            consumers[id(nxt)] = consumers.get(id(nxt), 0) + 1
            if id(nxt) not in alive:
                alive[id(nxt)] = nxt
                stack.append(nxt)
    del stack
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
            del alive[id(fn)]
            fn = inputs = outputs = grad = buffer = None  # drop the node: it frees what it saved
        for callback in engine.callbacks:
            callback()
    finally:
        torch._C._current_graph_task_id = real_task_id
        torch.autograd.Variable._execution_engine = engine.real

