"""``--checkpoint_blocks auto``: the fewest checkpointed DiT blocks whose planned peak fits the GPU.

Before the DiT loads, ``qie train`` asks ``qie plan``'s analytic prediction (``memory/plan.py``) for the step the
preflight checks (``planned_side``: a 1024² target and one reference, or ``--on_the_fly``'s ``--max_pixels``, 300
prompt tokens, at ``--batch_size``; the run's rank, optimizer, policy, FP8 base, EMA, loss and ZeRO stage) with
0, 1, ... L blocks checkpointed, and keeps the first count that fits ``--gpu_memory_gb`` (else the visible GPU):
every block left plain skips its recompute. Without a GPU every block checkpoints (logged). When even every
block does not fit, it refuses before the load, naming the options that save more memory. The preflight then
runs the chosen mix on the fake device (``preflight/train.py``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

log = logging.getLogger(__name__)
RESOLUTION = 1024  # the side of the step planned (and preflighted): a cache's samples are not read before the load
PROMPT_TOKENS = 300


def planned_side(cfg, family) -> int:
    """The side of the square target (and reference) the preflight runs and ``auto`` plans."""
    if not cfg.onthefly.on_the_fly:
        return RESOLUTION
    return max(family.size_divisor, int(math.isqrt(cfg.onthefly.max_pixels)) // family.size_divisor
               * family.size_divisor)


def plan_options(cfg, preset, zero_stage: int = 0, num_gpus: int = 1):
    """The :class:`~..memory.plan.PlanOptions` of ``cfg``'s (a resolved ``RunConfig``) training step."""
    from ..memory.plan import PlanOptions
    from ..models.presets import family_of
    from .losses.registry import loss_spec

    t, spec = cfg.train, loss_spec(cfg.loss.loss)
    return PlanOptions(task="train", resolution=planned_side(cfg, family_of(preset)), ref_images=1,
                       prompt_tokens=PROMPT_TOKENS, batch_size=t.batch_size, lora_rank=cfg.lora.lora_rank,
                       optimizer=cfg.optim.optimizer, gradient_checkpointing=bool(t.gradient_checkpointing),
                       checkpoint_policy=t.checkpoint_policy, compile=t.compile, fp8_base=t.fp8_base or t.fp8_compute,
                       fp8_compute=t.fp8_compute, zero_stage=zero_stage, num_gpus=num_gpus,
                       on_the_fly=cfg.onthefly.on_the_fly, ema=t.ema_decay > 0,
                       validate_with=t.validate_with if t.ema_decay > 0 else "raw",
                       compute_precision=t.compute_precision, pairs=spec.preference,
                       rollouts=cfg.nft.nft_group_size if spec.needs_rollouts else 0, distill=spec.distills)


def fewest_fitting(census, options, budget: int) -> tuple[Optional[int], object]:
    """(the fewest checkpointed blocks whose planned peak fits ``budget`` bytes, or None; the plan of that count,
    else of every block checkpointed)."""
    from ..memory.plan import predict

    plan = None
    for n in range(census.num_layers + 1):
        plan = predict(census, dataclasses.replace(options, gradient_checkpointing=True, checkpoint_blocks=n))
        if plan.gpu_peak <= budget:
            return n, plan
    return None, plan


def resolve_checkpoint_blocks(cfg, preset, zero_stage: int = 0, num_gpus: int = 1):
    """``cfg`` with ``--checkpoint_blocks auto`` replaced by its count (a count is checked against the DiT's
    blocks); ValueError when even every block checkpointed does not fit the GPU."""
    from ..fakegpu.verdict import gpu_bytes_of
    from ..memory.census import preset_census
    from ..memory.plan import GiB
    from .block_setup import check_checkpoint_policy

    t = cfg.train
    if t.checkpoint_blocks is None:
        return cfg
    census = preset_census(preset.name, with_encoders=cfg.onthefly.on_the_fly)
    check_checkpoint_policy(t, census.num_layers)  # (a count: in 0..L)
    if t.checkpoint_blocks != "auto":
        return cfg
    gpu = gpu_bytes_of(t.gpu_memory_gb)
    if gpu is None:
        log.info("--checkpoint_blocks auto: no GPU visible and no --gpu_memory_gb: every block checkpoints")
        return dataclasses.replace(cfg, train=dataclasses.replace(t, checkpoint_blocks=None))
    options = plan_options(cfg, preset, zero_stage, num_gpus)
    n, plan = fewest_fitting(census, options, gpu)
    layers = census.num_layers
    if n is None:
        raise ValueError(f"--checkpoint_blocks auto: even with all {layers} blocks checkpointed the planned peak "
                         f"({plan.gpu_peak / GiB:.1f} GiB at {options.resolution}² + 1 reference, --batch_size "
                         f"{t.batch_size}) exceeds the GPU's {gpu / GiB:.1f} GiB; add --fp8_base, lower --batch_size, "
                         f"or drop --checkpoint_blocks and use --blocks_to_swap N (`qie plan --gpu_memory_gb "
                         f"{gpu / GiB:.0f}` names what fits)")
    log.info("--checkpoint_blocks auto: %d of %d blocks checkpointed (%s policy), planned peak %.1f GiB of the GPU's "
             "%.1f GiB (%d² + 1 reference, --batch_size %d)", n, layers, t.checkpoint_policy, plan.gpu_peak / GiB,
             gpu / GiB, options.resolution, t.batch_size)
    return dataclasses.replace(cfg, train=dataclasses.replace(t, checkpoint_blocks=n))
