"""How the DiT's blocks run in training: ``--compile``, ``--checkpoint_policy`` and which blocks recompute.

:func:`prepare_blocks` is called once on the built module, by ``qie train`` (``run_setup.py``) and by the
fake-device preflight (with the eager backend), so both run the same blocks:

- gradient checkpointing with the default ``full`` policy, not compiled: DiffSynth's checkpoint around each
  block call, unchanged;
- ``--checkpoint_policy selective``, or ``--compile`` with checkpointing: each block checkpoints itself, inside
  the compiled region when compiled (``models/load/block_checkpoint.py``);
- ``--checkpoint_blocks N``: the blocks checkpoint themselves, the first N recomputing and the others keeping
  everything (``auto``: the fewest that fit the GPU, chosen before the load by ``checkpoint_auto.py``);
- ``--blocks_to_swap``: DiffSynth's checkpoint (its recompute passes the swapper's forward hook), the compiled
  forward inside it; ``selective`` and ``--checkpoint_blocks`` are refused.
"""
from __future__ import annotations

import argparse
import logging
from typing import Optional

log = logging.getLogger(__name__)


def checkpoint_blocks_type(value: str):
    """``--checkpoint_blocks``: a number of blocks (>= 0) or ``auto``."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"--checkpoint_blocks {value!r}: give a number of blocks (0 or more) or auto")
    return n


def check_checkpoint_policy(t, blocks: Optional[int] = None) -> None:
    """Refuse ``--checkpoint_policy selective`` and ``--checkpoint_blocks`` where they cannot apply (``t``: a
    ``TrainConfig``; ``blocks``: the DiT's, to check a count against)."""
    if t.checkpoint_policy == "selective" and t.blocks_to_swap:
        raise ValueError(f"--checkpoint_policy selective cannot be combined with --blocks_to_swap {t.blocks_to_swap} "
                         "(a swapped block recomputes whole, through the swapper's hooks); pass --checkpoint_policy "
                         "full, or --blocks_to_swap 0")
    n = t.checkpoint_blocks
    if n is None:
        return
    if not t.gradient_checkpointing:
        raise ValueError(f"--checkpoint_blocks {n} counts checkpointed blocks, but --no-gradient_checkpointing turns "
                         "checkpointing off; drop one of the two")
    if t.blocks_to_swap:
        raise ValueError(f"--checkpoint_blocks {n} cannot be combined with --blocks_to_swap {t.blocks_to_swap} (every "
                         "block recomputes whole, through the swapper's hooks); drop --checkpoint_blocks, or pass "
                         "--blocks_to_swap 0")
    if blocks is not None and n != "auto" and not 0 <= n <= blocks:
        raise ValueError(f"--checkpoint_blocks {n}: this DiT has {blocks} blocks; give 0..{blocks} or auto")


def checkpoint_count(t, blocks: int) -> int:
    """How many of ``blocks`` blocks recompute in the backward under ``t`` (a ``TrainConfig`` whose
    ``--checkpoint_blocks`` is a number or unset: ``auto`` is resolved before the load)."""
    if not t.gradient_checkpointing:
        return 0
    if t.checkpoint_blocks == "auto":
        raise ValueError("--checkpoint_blocks auto is chosen before the DiT loads (training/checkpoint_auto.py)")
    return blocks if t.checkpoint_blocks is None else min(t.checkpoint_blocks, blocks)


def checkpointed_blocks(t, blocks: int) -> Optional[list]:
    """Which blocks checkpoint themselves (None: the blocks do not own their checkpointing)."""
    from ..models.load.block_checkpoint import spread

    if t.blocks_to_swap or not t.gradient_checkpointing:
        return None
    if t.checkpoint_policy == "full" and not t.compile and t.checkpoint_blocks is None:
        return None
    return spread(checkpoint_count(t, blocks), blocks)


def prepare_blocks(dit, t, backend: Optional[str] = "inductor") -> None:
    """Compile and / or make ``dit``'s blocks checkpoint themselves as ``t`` (a ``TrainConfig``) asks;
    ``backend=None``: the blocks checkpoint themselves as compiled ones would, but run without ``torch.compile``
    (the same operators, for the fake device's counted timing runs, which need no tracing)."""
    from ..models.load.block_checkpoint import own_checkpointing
    from ..models.load.compile import compile_blocks

    check_checkpoint_policy(t)
    checkpointed = checkpointed_blocks(t, len(list(getattr(dit, "transformer_blocks", []))))
    if t.compile and backend is not None:
        compile_blocks(dit, backend=backend, checkpointed=checkpointed, policy=t.checkpoint_policy)
    elif checkpointed is not None:
        own_checkpointing(dit, checkpointed, t.checkpoint_policy)
