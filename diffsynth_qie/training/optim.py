"""Optimizers, the learning-rate schedule, the clipping guard and schedule-free eval/train.

Not DiffSynth's ``runner.py`` defaults: it builds ``torch.optim.lr_scheduler.ConstantLR``
with PyTorch's defaults, which silently trains the first 5 steps at lr/3. Here the
schedule is an explicit ``LambdaLR``: linear warmup, then constant or cosine.

ProdigyPlusScheduleFree keeps two points: ``y`` where gradients are taken (what the
module holds while training) and the average ``x`` that should be evaluated and saved.
``optimizer.eval()`` moves the parameters to ``x`` and ``train()`` back. Under
DeepSpeed ZeRO the optimizer only sees ZeRO's flat fp32 partitions, so ``eval()`` moves
those and *not* the module's bf16 weights; :func:`schedule_free_eval` therefore copies
the fp32 partitions back into the module weights after ``eval()`` and again after
``train()`` (DeepSpeed's own ``update_lp_params`` / stage-3 re-partition), so
validation and saved LoRAs use ``x`` under ZeRO as well; an engine it cannot do that
for is an error, never a silent save of ``y``. Under DeepSpeed with several processes
Prodigy would estimate its step size per shard: :func:`check_schedule_free_sharding`
refuses that (train LoRAs with DDP).
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Iterable, Iterator, Optional

import torch

from ..utils.logging import prints_to_log
from .config import OptimConfig

log = logging.getLogger(__name__)


def fused_adamw(params: list, deepspeed: bool = False) -> bool:
    """Whether AdamW runs fused (one kernel per step for all tensors): every parameter a floating tensor on a CUDA
    device, and no DeepSpeed (which hands the optimizer its own flat partitions). Elsewhere PyTorch's default
    stays: ``foreach`` on CUDA, the per-tensor loop on the CPU."""
    return not deepspeed and all(p.is_floating_point() and p.device.type == "cuda" for p in params)


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimConfig,
                    deepspeed: bool = False) -> torch.optim.Optimizer:
    """AdamW (fused where :func:`fused_adamw` says) or ProdigyPlusScheduleFree over ``params`` (``config``
    resolved); ``deepspeed``: the optimizer goes to a DeepSpeed engine."""
    config = config.resolved()
    params = list(params)
    if not params:
        raise ValueError("no trainable parameters: check --lora_rank / --lora_target_modules / --full_finetune_modules")
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.learning_rate, betas=tuple(config.betas),
                                 weight_decay=config.weight_decay,
                                 **({"fused": True} if fused_adamw(params, deepspeed) else {}))
    if config.optimizer == "prodigy_sf":
        try:
            from prodigyplus.prodigy_plus_schedulefree import ProdigyPlusScheduleFree
        except ImportError as e:
            raise ValueError("--optimizer prodigy_sf needs `pip install prodigy-plus-schedule-free` "
                             "(or the project's [train] extra)") from e
        with prints_to_log("prodigyplus"):  # it prints its settings notes ("'split_groups' has been disabled")
            optimizer = ProdigyPlusScheduleFree(params, lr=config.learning_rate, betas=tuple(config.betas),
                                                weight_decay=config.weight_decay)
        optimizer.train()
        return optimizer
    raise ValueError(f"unknown --optimizer {config.optimizer!r}; use adamw or prodigy_sf")


def is_schedule_free(optimizer: Any) -> bool:
    """True for schedule-free optimizers (``eval()``/``train()`` move the parameters)."""
    return "ScheduleFree" in type(optimizer).__name__ and callable(getattr(optimizer, "eval", None))


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str = "constant",
              min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate for the optimizer step with index ``step`` (0-based).

    Warmup: ``(step+1)/warmup_steps`` (the first step already moves; peak at step
    ``warmup_steps-1``). Cosine: from 1 at the end of warmup to ``min_lr_ratio`` at
    the last step ``total_steps-1``.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, total_steps - 1 - warmup_steps)
        progress = min(1.0, max(0.0, (step - warmup_steps) / span))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown --lr_schedule {schedule!r}; use constant or cosine")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int
                       ) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with :func:`lr_factor`; step it once per optimizer step."""
    if config.optimizer == "prodigy_sf" and config.lr_schedule == "cosine":
        log.warning("--lr_schedule cosine with a schedule-free optimizer: schedule-free methods are meant to "
                    "run at a constant rate (after warmup); the cosine decay is applied anyway")

    def factor(step: int) -> float:
        return lr_factor(step, config.warmup_steps, total_steps, config.lr_schedule, config.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def check_clipping(config: OptimConfig, ds_config: Optional[dict] = None) -> float:
    """The gradient-norm clip of the run (0 = off): ``--max_grad_norm`` resolved per optimizer.

    ``--max_grad_norm`` is the one place clipping is configured: :func:`configure_deepspeed`
    writes it into the DeepSpeed config, whose shipped ``gradient_clipping`` is ``"auto"``. A
    config that sets another number is refused rather than silently preferred. A schedule-free
    Prodigy must not clip at all (it defeats the step-size estimate).
    """
    config = config.resolved()
    norm = float(config.max_grad_norm or 0.0)
    if config.optimizer == "prodigy_sf" and norm > 0:
        raise ValueError(f"--optimizer prodigy_sf must not clip gradients, but --max_grad_norm is "
                         f"{config.max_grad_norm}; pass --max_grad_norm 0")
    value = (ds_config or {}).get("gradient_clipping", "auto")
    if value not in ("auto", None) and float(value) != norm:
        if config.optimizer == "prodigy_sf":
            raise ValueError(f"--optimizer prodigy_sf must not clip gradients, but the DeepSpeed config sets "
                             f"gradient_clipping to {value}; set \"gradient_clipping\": \"auto\" (filled from "
                             "--max_grad_norm, 0 for prodigy_sf) as deepspeed_configs/*.json do")
        raise ValueError(f"the DeepSpeed config sets gradient_clipping to {value} but --max_grad_norm is {norm}; "
                         "set \"gradient_clipping\": \"auto\" in the JSON (deepspeed_configs/*.json do) so "
                         f"--max_grad_norm decides, or pass --max_grad_norm {value}")
    return norm


def configure_deepspeed(ds_config: dict, config: OptimConfig, micro_batch_size: int) -> None:
    """Fill the run's values into the DeepSpeed config before ``accelerator.prepare``: the micro-batch size
    (no DataLoader is prepared) and the gradient clipping (``--max_grad_norm``; accelerate would turn a
    missing or ``"auto"`` value into 1.0)."""
    if ds_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds_config["train_micro_batch_size_per_gpu"] = micro_batch_size
    ds_config["gradient_clipping"] = check_clipping(config, ds_config)


def check_schedule_free_sharding(config: OptimConfig, ds_config: Optional[dict], num_processes: int) -> None:
    """Refuse ProdigyPlusScheduleFree under DeepSpeed with more than one process.

    Under DeepSpeed the client optimizer steps each rank's own flat partition, and Prodigy's
    step-size estimate ``d`` is computed from that partition alone (no cross-rank reduction):
    every rank would move its shard at its own rate, unlike a single-process run. DDP keeps
    whole parameters on every rank (gradients averaged), so ``d`` is the same everywhere and
    equals the single-process value. One process under DeepSpeed holds the whole flat group.
    """
    config = config.resolved()
    if config.optimizer != "prodigy_sf" or ds_config is None or num_processes <= 1:
        return
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    raise ValueError(f"--optimizer prodigy_sf under DeepSpeed (ZeRO stage {stage}) with {num_processes} processes "
                     "would estimate its step size per shard, so every rank would train at its own rate; train "
                     "the LoRA with DDP instead (`accelerate launch --multi_gpu`, no DeepSpeed config: with "
                     "Qwen-Image-Edit-LBM.sh leave DS_CONFIG unset), or use --optimizer adamw under DeepSpeed")


def _zero_optimizer(engine: Any) -> Any:
    return getattr(engine, "optimizer", None) if engine is not None else None


@torch.no_grad()
def set_schedule_free_mode(optimizer: Any, train: bool, engine: Any = None) -> None:
    """``optimizer.train()``/``eval()``, also where ZeRO-3 hides the parameters.

    ZeRO-1/2 leave their flat fp32 partitions in the client optimizer's param groups, so
    the plain call moves them. ZeRO-3 empties the groups between steps (it puts one
    sub-group's partition in only while stepping), so here every sub-group's partition
    is put in and moved the same way, one at a time.
    """
    zero_opt = _zero_optimizer(engine)
    flats = getattr(zero_opt, "fp32_partitioned_groups_flat", None)
    if flats is None:
        optimizer.train() if train else optimizer.eval()
        return
    groups = optimizer.param_groups
    saved = [(g["params"], g.get("train_mode", True)) for g in groups]
    try:
        for sub_group_id, flat in enumerate(flats):
            gid = zero_opt.sub_group_to_group_id[sub_group_id]
            for g in groups:
                g["params"] = []
            groups[gid]["params"] = [flat]
            groups[gid]["train_mode"] = saved[gid][1]  # so the switch applies to this sub-group too
            optimizer.set_train_mode(train)
    finally:
        for g, (params, _) in zip(groups, saved):
            g["params"] = params
            g["train_mode"] = train


@torch.no_grad()
def sync_deepspeed_module_weights(engine: Any) -> bool:
    """Copy ZeRO's fp32 master partitions into the module's (bf16) weights. True if done."""
    zero_opt = _zero_optimizer(engine)
    if zero_opt is None:
        return False
    if hasattr(zero_opt, "update_lp_params"):  # ZeRO-1/2 and the BF16 optimizer
        zero_opt.update_lp_params()
        return True
    if hasattr(zero_opt, "_reassign_or_swap_out_partitioned_parameters"):  # ZeRO-3
        for sub_group_id in range(len(zero_opt.fp16_groups)):
            if zero_opt.fp16_partitioned_groups_flat[sub_group_id] is None:
                raise ValueError("schedule-free eval() with ZeRO-3 NVMe parameter offload is not supported; "
                                 "use AdamW or a config without offload_param to nvme")
            zero_opt._reassign_or_swap_out_partitioned_parameters(sub_group_id)
        return True
    return False


@contextlib.contextmanager
def schedule_free_eval(optimizer: Any, engine: Any = None) -> Iterator[str]:
    """Inside: the module holds the schedule-free average ``x``; yields a description of
    what the module holds (logged with every save).

    ``optimizer`` is the optimizer as built (not accelerate's wrapper); a no-op for
    ordinary optimizers. ``engine`` is the DeepSpeed engine when training under
    DeepSpeed (its fp32 partitions are what ``eval()`` moves).
    """
    if not is_schedule_free(optimizer):
        yield "trained weights"
        return
    set_schedule_free_mode(optimizer, False, engine)
    if engine is not None and not sync_deepspeed_module_weights(engine):
        # Saving now would silently store the training point y as if it were the average x.
        set_schedule_free_mode(optimizer, True, engine)
        raise ValueError(f"cannot copy the schedule-free average into the module weights of this DeepSpeed "
                         f"engine (its optimizer {type(_zero_optimizer(engine)).__name__} is neither ZeRO-1/2 "
                         "nor ZeRO-3); train with --optimizer adamw, or with DDP (no DeepSpeed config)")
    try:
        yield "schedule-free average x"
    finally:
        set_schedule_free_mode(optimizer, True, engine)
        if engine is not None:
            sync_deepspeed_module_weights(engine)
