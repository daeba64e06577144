"""``qie train``'s preflight: the run's configuration, one training step on the fake device, and a memory verdict.

Before a real preset's weights load (tens of GB, minutes), :func:`preflight` runs one optimizer step of the
user's whole resolved ``RunConfig`` (``train_step.verify_train_step``: every flag the step reads, as ``qie train``
reads it) at full width on a DiT of a few blocks, twice: at two depths. A device or dtype mismatch, or a host
read of a device tensor, raises ``ValueError`` naming the operator and our line. Every block runs the same code
and holds the same, so the difference of the two peaks is one block's share (its weights, LoRA, optimizer state
and saved activations); :func:`scaled_verdict` scales it to the whole DiT (the blocks ``--blocks_to_swap``
keeps in host memory excepted; with ``--on_the_fly`` the encoders and one encode run in the deeper run only,
and are added once) and judges the result against ``--gpu_memory_gb`` (default: the visible GPU),
``fakegpu/verdict.py``: one line, exit code 2, when it does not fit. With ``--checkpoint_blocks N`` (0 < N < L) a
third run gives a plain block's share beside a checkpointed one's, mixed to N of L (``train_partial.py``).

One of the two runs goes on for :data:`GROWTH_STEPS` steps on other samples (the shallower one; with
``--on_the_fly`` the one that encodes, each step's sample encoded first): device memory still held after the last
beyond the one before fails the check with the lines that allocated it (``train_growth.py``); the frozen LoRA's
branches must sit where their layers' weights are.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Optional

from ..training.block_setup import checkpoint_count
from ..training.checkpoint_auto import planned_side
from .timing import full_depth, predict_train
from .train_partial import mixed_profile, mixed_verdict, run_three
from .train_step import StepReport, verify_train_step
from .train_batch import batch_shapes

log = logging.getLogger(__name__)

PREFLIGHT_BLOCKS = 2  # the deeper of the two runs (one block to hand over to the next)
GROWTH_STEPS = 3  # steps of one run: from the second on the optimizer's state exists, so the third must add nothing


def scaled_verdict(shallow: StepReport, deep: StepReport, depths: tuple[int, int], blocks: int,
                   blocks_to_swap: int, gpu_bytes: Optional[int]):
    """The steady-state step's :class:`~..fakegpu.verdict.MemoryVerdict` for the whole ``blocks``-block DiT, from
    runs at ``depths`` (with block swapping each run keeps its last block in host memory)."""
    from ..fakegpu.verdict import MemoryVerdict

    encoders = deep.encoder_weights + deep.encode_transient - shallow.encoder_weights - shallow.encode_transient
    per_block = max(0, (deep.peak - shallow.peak - encoders) // (depths[1] - depths[0]))
    block_weights = max(0, (deep.weights - shallow.weights - deep.encoder_weights + shallow.encoder_weights)
                        // (depths[1] - depths[0]))
    swapped_run = 1 if blocks_to_swap else 0
    resident_run, resident = depths[1] - swapped_run, blocks - blocks_to_swap
    # training holds up to two swapped blocks at once (the kept last one and the prefetched one); the run one
    in_flight = max(0, min(blocks_to_swap, 2) - swapped_run) * block_weights
    peak = deep.peak + (resident - resident_run) * per_block + in_flight
    holders = sorted([(f"{resident} resident blocks (weights, LoRA, optimizer state, saved activations)",
                       resident * per_block),
                      ("embeddings, the last block's working set, the loss",
                       deep.peak - resident_run * per_block - deep.encoder_weights - deep.encode_transient),
                      ("--on_the_fly: text encoder and VAE encoder, one encode's working set",
                       deep.encoder_weights + deep.encode_transient)],
                     key=lambda h: -h[1])
    holders = [h for h in holders if h[1] > 0]
    swap = f", {blocks_to_swap} in host memory" if blocks_to_swap else ""
    return MemoryVerdict(phase="training step (steady state)", peak_bytes=int(peak), gpu_bytes=gpu_bytes,
                         holders=tuple(holders),
                         scaled=f"{depths[0]} and {depths[1]} of {blocks} blocks run, scaled to {blocks}{swap}")


def preflight(cfg, preset, gpu_memory_gb: Optional[float] = None) -> StepReport:
    """The check of the module docstring; returns the deeper run's report (``.verdict``: the memory verdict).
    ``gpu_memory_gb`` overrides ``cfg.train.gpu_memory_gb``."""
    from ..fakegpu.device import FakeRunError
    from ..fakegpu.verdict import MemoryVerdictError, check_memory, gpu_bytes_of
    from ..models.presets import family_of

    t, family = cfg.train, family_of(preset)
    gpu = gpu_bytes_of(t.gpu_memory_gb if gpu_memory_gb is None else gpu_memory_gb)  # (outside the fake device)
    side = planned_side(cfg, family)
    shapes = batch_shapes(side, 1, 300, t.batch_size, mixed=t.batch_size > 1, multiple=family.size_divisor)
    depths = (PREFLIGHT_BLOCKS - 1, PREFLIGHT_BLOCKS)
    run_cfg = cfg
    if t.blocks_to_swap:  # the last of the check's blocks is swapped (the first ones hand over to it)
        depths = (PREFLIGHT_BLOCKS, PREFLIGHT_BLOCKS + 1)
        run_cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, blocks_to_swap=1))
    where = f"training steps on a fake CUDA device, before loading {preset.name}"
    blocks = full_depth(preset)
    count = checkpoint_count(t, blocks)
    partial = 0 < count < blocks and not t.blocks_to_swap  # --checkpoint_blocks N: both kinds run (train_partial.py)
    # --on_the_fly: the encoders and their encode run once, in the deeper run (the same in both), which then
    # also runs the later steps (each encodes its sample); else the cheaper shallower run does
    growth = depths[1] if cfg.onthefly.on_the_fly else depths[0]

    def step(c, n, grows=True):
        return verify_train_step(c, preset, shapes, num_layers=n, encode=n == depths[1], costs=True,
                                 steps=GROWTH_STEPS if n == growth and grows else 1)

    try:
        if partial:
            runs = run_three(run_cfg, depths, step)
        else:  # (the shallower and the deeper run)
            runs = dict(zip(("c1", "c2"), (step(run_cfg, n) for n in depths)))
    except FakeRunError as e:
        raise ValueError(f"preflight ({where}): {e}; pass --no_preflight to skip the check") from None
    shallow, deep = runs["c1"], runs["m2" if partial else "c2"]
    verdict = (mixed_verdict(runs, depths, blocks, count, gpu) if partial else
               scaled_verdict(shallow, deep, depths, blocks, min(t.blocks_to_swap, blocks), gpu))
    deep.verdict = verdict
    try:
        line = check_memory(verdict)
    except MemoryVerdictError as e:
        raise MemoryVerdictError(f"preflight ({where}): {e}") from None
    log.info("preflight: training steps of %s (full width; %d steps on other samples, no memory held beyond the "
             "step before) on a fake CUDA device passed in %.1f s; %s", preset.name, GROWTH_STEPS,
             sum(r.seconds for r in runs.values()), line)
    profile = mixed_profile(runs, blocks, count) if partial else None
    deep.prediction = predict_train(cfg, preset, shapes, reports=(shallow, deep), depths=depths, profile=profile)
    log.info("preflight: %s", deep.prediction.line(cfg.train.max_steps, cfg.train.gradient_accumulation_steps))
    return deep
