"""``--compile``: regional ``torch.compile`` of the DiT's transformer blocks.

Each block's ``forward`` is compiled (``torch.compile(block.forward)``): the blocks share one graph per input
signature, so compile time is that of one block, and the elementwise chains around the matmuls (modulation,
RMSNorm, RoPE, GELU) fuse into a few kernels. The image sizes stay static (``dynamic=False`` keeps those
kernels specialised: a new resolution bucket compiles once more). What would otherwise recompile at every
batch, each time costing a compile of about a minute on a GPU until dynamo's ``recompile_limit`` (8) sends the
blocks back to eager:

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

So a run compiles a few graphs per image size (training, no-grad validation, masked batches), whatever its
prompts; :data:`RECOMPILE_LIMIT` leaves room for many resolution buckets. The speed-up is measured on a GPU
(benchmarks/); on a CPU compiling takes longer than it saves for short runs.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64  # graphs per block code object: a few per image size (see the module docstring)
_STREAMS = ("image", "text", "hidden_states")  # a block's stream inputs (Qwen-Image-Edit, Qwen-Image-2.1)


def compile_blocks(dit, backend="inductor", mode: str | None = None) -> int:
    """Compile every block of ``dit.transformer_blocks`` in place; returns how many."""
    blocks = list(getattr(dit, "transformer_blocks", []))
    if not blocks:
        raise ValueError("--compile: this DiT has no transformer_blocks to compile")
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    for block in blocks:
        block.forward = _uniform_inputs(torch.compile(block.forward, backend=backend, mode=mode, dynamic=False))
    dit.qie_compiled_blocks = True
    log.info("compiling %d DiT blocks with torch.compile (backend %s); the first step of each image size "
             "compiles", len(blocks), getattr(backend, "__name__", backend))
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
        text = kwargs.get("text")
        if isinstance(text, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(text, 1)
            rope = kwargs.get("image_rotary_emb")
            if isinstance(rope, (tuple, list)) and len(rope) == 2 and isinstance(rope[1], torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(rope[1], rope[1].ndim - 2)  # [T, D/2] or [B, 1, T, D/2]
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(mask, mask.ndim - 1)  # [B, 1, 1, T + S]
        return compiled(*args, **kwargs)

    return forward
