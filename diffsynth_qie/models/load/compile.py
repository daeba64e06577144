"""``--compile``: regional ``torch.compile`` of the DiT's transformer blocks.

Each ``QwenImageTransformerBlock`` is compiled in place (``nn.Module.compile``): the 60 blocks share one
graph per input shape, so compile time is that of one block, and the elementwise chains around the matmuls
(modulation, RMSNorm, RoPE, GELU) fuse into a few kernels. Shapes are stable within a bucket; a new bucket
or image size compiles once more (``dynamic=False`` keeps the kernels specialised). The speed-up is measured
on a GPU (benchmarks/); on a CPU compiling takes longer than it saves for short runs.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def compile_blocks(dit, backend: str = "inductor", mode: str | None = None) -> int:
    """Compile every block of ``dit.transformer_blocks`` in place; returns how many."""
    blocks = list(getattr(dit, "transformer_blocks", []))
    if not blocks:
        raise ValueError("--compile: this DiT has no transformer_blocks to compile")
    for block in blocks:
        block.compile(backend=backend, mode=mode, dynamic=False)
    log.info("compiling %d DiT blocks with torch.compile (backend %s); the first step of each shape compiles",
             len(blocks), backend)
    return len(blocks)
