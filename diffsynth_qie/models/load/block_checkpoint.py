"""Checkpointing owned by the DiT's blocks (``--checkpoint_policy``, ``--compile``, ``--gradient_checkpointing auto``).

DiffSynth checkpoints around each block call (``gradient_checkpoint_forward``: ``torch.utils.checkpoint`` of the
whole block, recomputed in full in the backward). Here each block's ``forward`` checkpoints itself instead, and
the loop around the blocks is told not to (:func:`outer_checkpointing`):

- **Inside the compiled region.** With ``--compile`` the checkpoint is part of what ``torch.compile`` compiles
  (the compiled function calls ``torch.utils.checkpoint`` of the block's own ``forward``), so dynamo traces the
  recompute with the forward, and the backward graph fuses the recompute's elementwise work with the backward's.
  Compiled outside the checkpoint (DiffSynth's call around a compiled ``forward``), the recompute reruns the
  compiled forward as a separate graph and nothing of it fuses with the backward.
- **The policy.** ``full`` recomputes the whole block (DiffSynth's checkpoint). ``selective`` keeps the
  outputs of the large GEMMs (inner and output sides > :data:`THIN`) and of attention for the backward, and
  recomputes the rest: the norms, modulation, RoPE, activations and casts, and the thin LoRA GEMMs (cheap to
  redo, as large as a hidden state to keep) — ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with a
  ``CheckpointPolicy`` per operator. Same math either way: a kept output is the very tensor the recompute
  would have produced, so the gradients are equal (bit for bit in eager mode).
- **Which blocks** (``checkpointed``): a block that is not checkpointed keeps everything for its backward, as
  without checkpointing (``--gradient_checkpointing auto`` checkpoints only as many as memory requires).

Blocks swapped to the host (``--blocks_to_swap``) keep DiffSynth's checkpoint around the module call, whose
recompute passes the swapper's forward hook (:func:`owns_checkpointing` is then False).
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Literal, Optional, Sequence

import torch

log = logging.getLogger(__name__)

CheckpointPolicy = Literal["full", "selective"]
THIN = 128  # a GEMM with a side at most this (a LoRA's A or B at its rank) is recomputed, not kept
_aten = torch.ops.aten
_GEMMS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._scaled_mm}
_ATTENTION = {_aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
              _aten._scaled_dot_product_cudnn_attention, _aten._scaled_dot_product_flash_attention_for_cpu,
              _aten._flash_attention_forward, _aten._efficient_attention_forward}


def kept(func, args) -> bool:
    """Whether ``selective`` keeps the output of the operator ``func`` called with ``args``: attention, and a GEMM
    whose inner and output sides are larger than :data:`THIN` (not a LoRA's A or B)."""
    packet = func.overloadpacket
    if packet in _ATTENTION:
        return True
    if packet not in _GEMMS:
        return False
    a, b = (args[1], args[2]) if packet in (_aten.addmm, _aten.baddbmm) else (args[0], args[1])
    # the weight's sides only: the token side is dynamic under --compile, and a test of it would be a guard
    return min(a.shape[-1], b.shape[-1]) > THIN


def _policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy as P

    return P.MUST_SAVE if kept(func, args) else P.PREFER_RECOMPUTE


def context_fn(policy: CheckpointPolicy) -> Optional[Callable]:
    """``torch.utils.checkpoint``'s ``context_fn`` for ``policy`` (None: the default, full recompute)."""
    if policy == "full":
        return None
    if policy != "selective":
        raise ValueError(f"unknown --checkpoint_policy {policy!r}; use full or selective")
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, _policy)


def checkpointing_forward(forward: Callable, policy: CheckpointPolicy) -> Callable:
    """``forward`` under a non-reentrant ``torch.utils.checkpoint`` with ``policy``."""
    from torch.utils.checkpoint import checkpoint

    extra = {} if context_fn(policy) is None else {"context_fn": context_fn(policy)}

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


def own_checkpointing(dit, checkpointed: Sequence[bool], policy: CheckpointPolicy,
                      wrap: Callable[[Callable], Callable] = lambda f: f) -> int:
    """Make each block of ``dit.transformer_blocks`` checkpoint itself (``checkpointed[i]``: block ``i`` does,
    with ``policy``, while gradients are on), each of its two forwards passed through ``wrap`` (``--compile``:
    ``torch.compile``; the checkpoint is then inside the compiled region). Returns how many blocks checkpoint."""
    blocks = list(getattr(dit, "transformer_blocks", []))
    if len(checkpointed) != len(blocks):
        raise ValueError(f"{len(checkpointed)} checkpointing choices for {len(blocks)} DiT blocks")
    context_fn(policy)  # (refuses an unknown policy before any block changes)
    for block, ckpt in zip(blocks, checkpointed):
        block.forward = _switch(wrap(block.forward), wrap(checkpointing_forward(block.forward, policy)) if ckpt
                                else None)
    dit.qie_owns_checkpointing = True
    dit.qie_checkpoint_policy = policy
    count = sum(map(bool, checkpointed))
    log.info("checkpointing inside the DiT's blocks: %d of %d blocks recompute (%s policy)", count, len(blocks),
             policy)
    return count


def _switch(plain: Callable, checkpointed: Optional[Callable]) -> Callable:
    @functools.wraps(plain)
    def forward(*args, **kwargs):
        if checkpointed is not None and torch.is_grad_enabled():
            return checkpointed(*args, **kwargs)
        return plain(*args, **kwargs)

    return forward


def owns_checkpointing(dit) -> bool:
    """Whether ``dit``'s blocks checkpoint themselves (:func:`own_checkpointing`)."""
    return bool(getattr(dit, "qie_owns_checkpointing", False))


def outer_checkpointing(dit, wanted: bool) -> bool:
    """``use_gradient_checkpointing`` for the loop around ``dit``'s blocks: off when the blocks own it."""
    return bool(wanted) and not owns_checkpointing(dit)


def spread(count: int, blocks: int) -> list[bool]:
    """Which of ``blocks`` blocks to checkpoint so that ``count`` of them do: the first ``count`` (a block's
    saved activations are freed as soon as its backward has run, and the backward runs last block first, so the
    peak is the same whichever ones; the first ones keep the recompute off the end of the backward)."""
    count = max(0, min(count, blocks))
    return [i < count for i in range(blocks)]
