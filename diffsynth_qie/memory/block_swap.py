"""Block swapping: keep N of the DiT's ``transformer_blocks`` in (pinned) host memory and
stream each onto the GPU just before it runs, in the forward and in the backward pass.

The last N blocks are swapped. Their frozen tensors (base weights, biases, norms; every
parameter or buffer with ``requires_grad=False``) live as a *master copy* on the offload
device; trainable tensors (LoRA, ``--full_finetune_modules``) stay on the device for good,
so their gradients and optimizer states never move and are exactly those of a run without
swapping. Swapping a block in copies its masters into fresh device tensors and points each
``param.data`` at them; swapping it out points ``param.data`` back at the master and drops
the device copy (frozen weights never change, so nothing is copied back).

Why ``param.data`` and module hooks:

- Autograd saves a *leaf* tensor (a parameter) by reference, not by value. A frozen weight
  saved for the backward pass (e.g. ``W`` of ``y = x Wᵀ``, needed for ``dL/dx``) is read
  through the parameter at backward time, so it sees whatever ``.data`` holds then: the
  device copy if the block is swapped in, the host master otherwise. The backward pass must
  therefore swap the block in before its backward runs — which a
  ``register_full_backward_pre_hook`` does (it fires when the gradient of the block's
  outputs is ready, before any of the block's own backward nodes).
- DiffSynth's ``gradient_checkpoint_forward`` calls the block module itself
  (``module(*args, **kwargs)``), in the forward and again in the recompute, so the forward
  pre-hook swaps the block in for both. PyTorch's non-reentrant checkpoint stops a
  recompute as soon as the saved tensors are rebuilt (the post-hook may never run there)
  and keeps detached aliases of them, i.e. of the device copies. A recompute runs inside
  the backward pass (``torch._C._current_graph_task_id() != -1``); should the post-hook run
  there (reentrant checkpointing), the block stays in, because its backward follows.
  Saved-tensor hooks would see every activation and fire once per tensor; the module
  hooks fire once per block, with or without checkpointing.
- A block's backward is complete when the backward pre-hook of the next block in backward
  order fires (autograd runs ready nodes latest-created first, and the gradient of that
  block's outputs needs the whole of this block's input gradients); that hook swaps out
  every other block. A callback queued on the autograd engine swaps out whatever is still
  in when the backward pass ends.

The transports (``memory/swap_transport.py``): pinned host masters, one exact-size pinned buffer per
block, copied on a side CUDA stream; plain host copies on a CPU.

Prefetch: when block ``i`` is swapped in, the next swapped block in execution order (the
forward order, or the backward order inside a backward pass) starts copying on a side
CUDA stream; the compute stream waits on its event only when that block is about to run.
The last resident block before the first swapped one prefetches that one. At most three
swapped blocks are on the device at once: the one running, the one prefetched, and in
training the last one kept for the backward pass.

Only weights change place, never values: losses, gradients and edits are bit-identical
with and without swapping (tests/memory/test_block_swap.py, on CPU with two host tensor sets).
Modify the DiT's weights (merging a LoRA) only between forward passes, when every swapped
block is out: the masters are what the next swap-in copies.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from .swap_transport import (ALIGN, CudaTransport, HostTransport, block_layout,  # noqa: F401 (the API)
                             default_transport, exact_pinned_memory, pinned_allocation_bytes)

log = logging.getLogger(__name__)

Tensor = torch.Tensor


def swapped_blocks(dit: nn.Module, blocks_to_swap: int) -> list[str]:
    """Module paths of the blocks :class:`BlockSwapper` keeps in host memory: the last ``blocks_to_swap``."""
    total = len(getattr(dit, "transformer_blocks", ()))
    return [f"transformer_blocks.{i}" for i in range(max(0, total - blocks_to_swap), total)] if blocks_to_swap else []


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _requires_grad(output) -> bool:
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    return any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


class BlockSwapper:
    """Swap the last ``blocks_to_swap`` of ``dit.transformer_blocks`` between ``offload_device``
    and ``device`` around each block's forward and backward.

    ``install()`` puts every other weight of the DiT (and every trainable tensor) on
    ``device`` and the swapped blocks' frozen tensors on ``offload_device``; ``remove()``
    undoes the hooks and puts everything on ``device`` (that needs the whole model's memory).
    ``transport`` (default: side-stream CUDA copies, or host copies on a CPU) is injectable;
    with ``record_events=True`` ``events`` lists ``(what, block)`` with what in
    fetch/in/keep/out.
    """

    def __init__(self, dit: nn.Module, blocks_to_swap: int, device, offload_device="cpu",
                 transport: Optional[HostTransport] = None, record_events: bool = False):
        blocks = getattr(dit, "transformer_blocks", None)
        if blocks is None:
            raise ValueError(f"{type(dit).__name__} has no transformer_blocks; block swapping needs a Qwen-Image DiT")
        total = len(blocks)
        if isinstance(blocks_to_swap, bool) or not isinstance(blocks_to_swap, int) or \
                not 0 < blocks_to_swap <= total:
            raise ValueError(f"--blocks_to_swap {blocks_to_swap!r} is out of range: this DiT has {total} blocks, "
                             f"pass an integer from 1 to {total} (0 turns swapping off)")
        self.dit, self.blocks = dit, list(blocks)
        self.device, self.offload_device = torch.device(device), torch.device(offload_device)
        self.transport = transport or default_transport(self.device, self.offload_device)
        self.swapped = list(range(total - blocks_to_swap, total))
        self.events: Optional[list[tuple[str, int]]] = [] if record_events else None
        self._masters: dict[int, dict[str, tuple[Tensor, Tensor]]] = {}
        self._resident: set[int] = set()
        self._pending: dict[int, object] = {}
        self._kept: Optional[int] = None
        self._callback_queued = False
        self._handles: list = []

    # --- install / remove --------------------------------------------------------
    def install(self) -> "BlockSwapper":
        if getattr(self.dit, "_qie_block_swapper", None) is not None:
            raise RuntimeError("block swapping is already installed on this DiT; remove() it first")
        swapped = set(self.swapped)
        for i, block in enumerate(self.blocks):
            if i not in swapped:
                block.to(self.device)
        for name, child in self.dit.named_children():
            if name != "transformer_blocks":
                child.to(self.device)
        for i in self.swapped:
            self._refresh_masters(i)
            block = self.blocks[i]
            self._handles += [block.register_forward_pre_hook(self._make_pre(i)),
                              block.register_forward_hook(self._make_post(i)),
                              block.register_full_backward_pre_hook(self._make_backward_pre(i))]
        first = self.swapped[0]
        if first > 0:
            self._handles.append(self.blocks[first - 1].register_forward_pre_hook(
                lambda module, args: self._prefetch(first)))
        self.dit._qie_block_swapper = self
        if not self.offloaded_bytes():
            log.warning("block swapping moves nothing: every tensor of the swapped blocks requires grad "
                        "(freeze the DiT with requires_grad_(False) first)")
        log.info("block swapping: %d of %d DiT blocks (%s) stream from %s, %.2f GB of frozen weights off %s",
                 len(self.swapped), len(self.blocks), f"{self.swapped[0]}-{self.swapped[-1]}", self.offload_device,
                 self.offloaded_bytes() / 1e9, self.device)
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for i in self.swapped:
            for tensor, master in self._masters.get(i, {}).values():
                tensor.data = master.to(self.device, copy=True)
        self._masters, self._resident, self._pending, self._kept = {}, set(), {}, None
        self.dit._qie_block_swapper = None

    def offloaded_names(self) -> list[str]:
        """DiT-relative names of the tensors that live on the offload device between uses."""
        return [f"transformer_blocks.{i}.{name}" for i in self.swapped for name in self._masters.get(i, {})]

    def offloaded_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for i in self.swapped for _, m in self._masters.get(i, {}).values())

    # --- tensors -------------------------------------------------------------------
    def _refresh_masters(self, i: int) -> dict[str, tuple[Tensor, Tensor]]:
        """Masters of block ``i``'s frozen tensors; tensors added since (an adapter) get one
        now, trainable ones go to the device and stay there."""
        known = self._masters.get(i, {})
        current: dict[str, tuple[Tensor, Tensor]] = {}
        new: list[tuple[str, Tensor]] = []
        block = self.blocks[i]
        for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
            if tensor.requires_grad:
                if tensor.device != self.device:
                    tensor.data = tensor.data.to(self.device)
                continue
            entry = known.get(name)
            if entry is None or entry[0] is not tensor:
                new.append((name, tensor))
            else:
                current[name] = entry
        if new:  # one buffer for all of them (the whole block the first time)
            for (name, tensor), master in zip(new, self.transport.masters([t.data for _, t in new])):
                current[name] = (tensor, master)
                tensor.data = self.transport.evicted(master)
        self._masters[i] = current
        return current

    def _log(self, what: str, i: int) -> None:
        if self.events is not None:
            self.events.append((what, i))

    def _prefetch(self, i: int) -> None:
        if i in self._resident or i in self._pending:
            return
        masters = self._refresh_masters(i)
        self._pending[i] = (list(masters.values()), self.transport.start([m for _, m in masters.values()]))
        self._log("fetch", i)

    def _swap_in(self, i: int) -> None:
        if i in self._resident:
            return
        self._prefetch(i)
        entries, handle = self._pending.pop(i)
        for (tensor, _), copy in zip(entries, self.transport.finish(handle)):
            tensor.data = copy
        self._resident.add(i)
        self._log("in", i)

    def _swap_out(self, i: int) -> None:
        if i not in self._resident:
            return
        for tensor, master in self._masters[i].values():
            tensor.data = self.transport.evicted(master)
        self._resident.discard(i)
        if self._kept == i:
            self._kept = None
        self._log("out", i)

    def _swap_out_all_but(self, *keep: Optional[int]) -> None:
        for j in sorted(self._resident):
            if j not in keep:
                self._swap_out(j)
        for j in [j for j in self._pending if j not in keep]:
            del self._pending[j]  # a prefetch that will not be used

    def _neighbour(self, i: int, step: int) -> Optional[int]:
        k = self.swapped.index(i) + step
        return self.swapped[k] if 0 <= k < len(self.swapped) else None

    # --- hooks ---------------------------------------------------------------------
    def _make_pre(self, i: int):
        def pre(module, args):
            if _in_backward():  # a recompute: the backward pre-hook already arranged the order
                self._swap_in(i)
                return
            nxt = self._neighbour(i, +1)
            self._swap_out_all_but(i, nxt, self._kept)
            self._swap_in(i)
            if nxt is not None:
                self._prefetch(nxt)
        return pre

    def _make_post(self, i: int):
        def post(module, args, output):
            if _in_backward():
                return  # its backward runs next; the next block's backward pre-hook swaps it out
            if i == self.swapped[-1] and _requires_grad(output):
                self._kept = i  # the backward pass starts with this block
                self._log("keep", i)
                return
            self._swap_out(i)
        return post

    def _make_backward_pre(self, i: int):
        def backward_pre(module, grad_output):
            if not self._callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
                self._callback_queued = True
            nxt = self._neighbour(i, -1)
            self._swap_out_all_but(i, nxt)
            self._swap_in(i)
            if nxt is not None:
                self._prefetch(nxt)
            return None
        return backward_pre

    def _end_backward(self) -> None:
        self._callback_queued = False
        self._swap_out_all_but()
