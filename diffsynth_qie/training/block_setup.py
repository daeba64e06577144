"""How the DiT's blocks run in training: ``--compile``, ``--checkpoint_policy`` and which blocks recompute.

:func:`prepare_blocks` is called once on the built module, by ``qie train`` (``run_setup.py``) and by the
fake-device preflight (with the eager backend), so both run the same blocks:

- gradient checkpointing with the default ``full`` policy, not compiled: DiffSynth's checkpoint around each
  block call, unchanged;
- ``--checkpoint_policy selective``, or ``--compile`` with checkpointing: each block checkpoints itself, inside
  the compiled region when compiled (``models/load/block_checkpoint.py``);
- ``--blocks_to_swap``: DiffSynth's checkpoint (its recompute passes the swapper's forward hook), the compiled
  forward inside it; ``selective`` is refused.
"""
from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger(__name__)


def check_checkpoint_policy(t) -> None:
    """Refuse ``--checkpoint_policy selective`` where it cannot apply (``t``: a ``TrainConfig``)."""
    if t.checkpoint_policy == "selective" and t.blocks_to_swap:
        raise ValueError(f"--checkpoint_policy selective cannot be combined with --blocks_to_swap {t.blocks_to_swap} "
                         "(a swapped block recomputes whole, through the swapper's hooks); pass --checkpoint_policy "
                         "full, or --blocks_to_swap 0")


def checkpointed_blocks(t, blocks: int) -> Optional[list]:
    """Which blocks checkpoint themselves (None: the blocks do not own their checkpointing)."""
    from ..models.load.block_checkpoint import spread

    if t.blocks_to_swap or not t.gradient_checkpointing:
        return None
    if t.checkpoint_policy == "full" and not t.compile:
        return None
    return spread(blocks, blocks)


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
