"""``--compile``: regional ``torch.compile`` of the DiT's transformer blocks.

Each block's ``forward`` is compiled (``torch.compile(block.forward)``): the blocks share one graph per input
signature, so compile time is that of one block, and the elementwise chains around the matmuls (modulation,
RMSNorm, RoPE, GELU) fuse into a few kernels. What would otherwise recompile at every batch, each time costing
a compile of about a minute on a GPU until dynamo's ``recompile_limit`` (8) sends the blocks back to eager:

- **Resolution and references** (Qwen-Image-Edit's blocks). The image-token dimension is marked dynamic (the
  image stream, its RoPE table, ``modulate_index``), so every resolution bucket and reference count runs one
  graph. (Qwen-Image-2.1's blocks take a joint stream with per-segment bookkeeping: a new layout compiles once.)

- **Prompt length.** The text-token dimension is marked dynamic (``torch._dynamo.maybe_mark_dynamic`` on the
  text stream, its RoPE table and the padding mask), so every prompt length runs one graph.
- **requires_grad.** In training the first block's inputs come from the frozen ``img_in``/``txt_in`` and
  do not require grad while the later blocks' do: two graphs per shape. With grad enabled, a stream input
  that does not require grad enters as a detached leaf that does (its gradient is dropped with it), so
  every block sees the same signature; the values are unchanged.
- **Mixed prompt lengths in one batch** (CFG's positive and negative, batches > 1) take the masked attention
  (``models/qwen_image_edit/forward.py``): the per-sample attention slices by each sample's length, which a
  graph would bake in.
- **Hooks** (block swapping, LoRA branches on a block's own call) run outside the compiled region: only
  ``forward`` is compiled, not the module call.

So a run compiles a few graphs (training, no-grad validation, masked batches), whatever its prompts and sizes;
:data:`RECOMPILE_LIMIT` leaves room for more. The speed-up is measured on a GPU (benchmarks/); on a CPU
compiling takes longer than it saves for short runs.

In training (``checkpointed`` given) the blocks checkpoint themselves and the checkpoint is compiled with the
block (``block_checkpoint.py``): the recompute is traced and fused with the backward, and ``--checkpoint_policy
selective`` keeps the GEMM and attention outputs. :func:`compile_counts` reports the graphs compiled and the
recompiles (guard failures) per compiled function; the trainer and the edit log them.
"""
from __future__ import annotations

import functools
import logging
from typing import Sequence

import torch

from .block_checkpoint import CheckpointPolicy, checkpointing_forward, own_checkpointing

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64  # graphs per block code object: a few per image size (see the module docstring)
_STREAMS = ("image", "text", "hidden_states")  # a block's stream inputs (Qwen-Image-Edit, Qwen-Image-2.1)


def compile_blocks(dit, backend="inductor", mode: str | None = None, checkpointed: Sequence[bool] | None = None,
                   policy: CheckpointPolicy = "full") -> int:
    """Compile every block of ``dit.transformer_blocks`` in place; returns how many. ``checkpointed`` (training):
    which blocks checkpoint themselves, inside the compiled region, with ``policy`` (``block_checkpoint.py``)."""
    blocks = list(getattr(dit, "transformer_blocks", []))
    if not blocks:
        raise ValueError("--compile: this DiT has no transformer_blocks to compile")
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    def wrap(forward):
        return _uniform_inputs(torch.compile(forward, backend=backend, mode=mode, dynamic=False))

    if checkpointed is None:
        for block in blocks:
            block.forward = wrap(block.forward)
    else:
        own_checkpointing(dit, checkpointed, policy, wrap)
    dit.qie_compiled_blocks = True
    dit.qie_compiled_code = _compiled_code(blocks[0])
    log.info("compiling %d DiT blocks with torch.compile (backend %s); the first step compiles", len(blocks),
             getattr(backend, "__name__", backend))
    return len(blocks)


def is_compiled(dit) -> bool:
    """Whether :func:`compile_blocks` compiled ``dit``'s blocks."""
    return bool(getattr(dit, "qie_compiled_blocks", False))


def _uniform_inputs(compiled):
    """``compiled`` called with the prompt-length dimension dynamic and uniform ``requires_grad`` (docstring)."""

    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        if torch.is_grad_enabled():
            for name in _STREAMS:
                x = kwargs.get(name)
                if isinstance(x, torch.Tensor) and x.is_floating_point() and not x.requires_grad:
                    kwargs[name] = x.detach().requires_grad_()
        text, image = kwargs.get("text"), kwargs.get("image")
        if isinstance(text, torch.Tensor) and isinstance(image, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(text, 1)
            torch._dynamo.maybe_mark_dynamic(image, 1)  # image tokens: the resolution and the references
            rope = kwargs.get("image_rotary_emb")
            if isinstance(rope, (tuple, list)) and len(rope) == 2:
                for freqs in rope:  # [S or T, D/2] or [B, 1, S or T, D/2]
                    torch._dynamo.maybe_mark_dynamic(freqs, freqs.ndim - 2)
            index = kwargs.get("modulate_index")
            if isinstance(index, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(index, index.ndim - 1)  # [B, S]
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(mask, mask.ndim - 1)  # [B, 1, 1, T + S]
        return compiled(*args, **kwargs)

    return forward


def _compiled_code(block) -> tuple:
    """The code objects dynamo compiles for a block: its class's ``forward`` and the checkpointing wrapper."""
    return (type(block).forward.__code__, checkpointing_forward(block.forward, "full").__code__)


def compile_counts(dit) -> dict:
    """Graphs compiled for ``dit``'s blocks: ``graphs`` (every cached graph, over every compiled function) and
    ``recompiles`` (graphs beyond the first of each function: a guard failed, e.g. a new image size or grad
    mode); ``{}`` when the blocks are not compiled."""
    if not is_compiled(dit):
        return {}
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = [len(_debug_get_cache_entry_list(code)) for code in getattr(dit, "qie_compiled_code", ())]
    return {"graphs": sum(entries), "recompiles": sum(max(0, n - 1) for n in entries)}


def log_compile_counts(dit, when: str) -> dict:
    """Log :func:`compile_counts` of ``dit`` (``when``: e.g. "after step 1"); returns them."""
    counts = compile_counts(dit)
    if counts:
        log.info("torch.compile %s: %d graph(s) for the DiT's blocks, %d recompile(s)", when, counts["graphs"],
                 counts["recompiles"])
    return counts
