"""What a compiled step's elementwise kernels cost once inductor has fused them (``--compile``).

A prediction, not a fit: no compiled step has been measured on a GPU yet (``docs/SPEED.md``). The model:

- Inductor keeps each GEMM, attention kernel, convolution and host copy as its own (library) kernel and fuses
  the elementwise and reduction operators between two of them into one kernel. So in a fused section (the
  forward and backward of a compiled step) a **chain** is every elementwise operator between two such
  boundaries, in the order they run, and costs **one kernel** (one launch floor).
- A chain's kernel **reads** each tensor it uses that was made outside it (a weight, a GEMM's output, a tensor
  of an earlier chain), once, and **writes** each tensor it makes that is read outside it: by a GEMM, by a later
  chain, by the backward (a saved activation). A tensor made and used only inside the chain stays in registers.
  The writes are known only later, so they are added to the chain's bytes when a later operator first reads
  the tensor (a tensor of a chain that nothing reads again is never written).
- Everything the counted run does in a fused section is fused this way, the operators outside the blocks (the
  embeddings, the final layer, the loss: under 2 % of a step's elementwise bytes) as well: a small optimism.

The fused chains are recorded as ``elementwise`` kernels (the same rate: bytes at the elementwise bandwidth).
With ``--checkpoint_policy selective`` the run on the fake device really recomputes only the elementwise work and
the thin GEMMs (``models/load/block_checkpoint.py``), so the recompute's kernels are counted as they run.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

BOUNDARY = {"gemm", "gemm_thin", "conv", "attention", "attention_bwd", "h2d"}
PRUNE_EVERY = 4096  # records between drops of freed tensors from the pending writes


def _key(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


class ChainFuser:
    """Folds a section's elementwise kernels into chains (module docstring); :meth:`record` returns the bytes
    and kernel count to book for one operator, and books late writes on the groups of earlier chains."""

    def __init__(self, touched_bytes):
        self.touched_bytes = touched_bytes       # bytes a kernel moves of a tensor (costs.touched_bytes)
        self.chain: Optional[dict] = None      # the open chain: made (keys), read (keys), its group
        self.pending: dict = {}                # key -> (weak ref, bytes, group) of chain-made tensors, unread
        self.records = 0

    def close(self) -> None:
        self.chain = None

    def record(self, kind: str, group, flat_in, flat_out, touched) -> tuple[float, float]:
        """Book one operator of ``kind`` (``group``: its group); returns its (bytes, kernels) to add there."""
        touched_bytes = self.touched_bytes
        if kind in BOUNDARY:  # (closed first: what it reads of the open chain, the chain writes)
            self.close()
        self._late_writes(flat_in)
        if kind != "elementwise":
            return touched, 1.0
        opened = self.chain is None or self.chain["group"] is not group
        if opened:
            self.chain = {"made": set(), "read": set(), "group": group}
        chain, moved = self.chain, 0
        for t in flat_in:
            key = _key(t)
            if key is None or (key not in chain["made"] and key not in chain["read"]):
                moved += touched_bytes(t)
                if key is not None:
                    chain["read"].add(key)
        for t in flat_out:
            key = _key(t)
            if key is not None:
                chain["made"].add(key)
                self.pending[key] = (StorageWeakRef(t.untyped_storage()), touched_bytes(t), group)
        self.records += 1
        if self.records % PRUNE_EVERY == 0:
            self.pending = {k: v for k, v in self.pending.items() if not v[0].expired()}
        return moved, 1.0 if opened else 0.0

    def _late_writes(self, flat_in) -> None:
        made = self.chain["made"] if self.chain is not None else ()
        for t in flat_in:
            key = _key(t)
            if key is None or key in made or key not in self.pending:
                continue
            ref, size, group = self.pending.pop(key)
            if not ref.expired():
                group.bytes += size
