"""A training run's set-up: the Accelerator, the checked config, then cache, DiT + LoRA, optimizer, schedule,
resume and logging, gathered in one :class:`Run` that the loop (``loop.py``) works with.

Order matters: the Accelerator comes first (under ZeRO-3 the DiT must be built partitioned), every flag is
checked before the output directory is locked or anything is loaded, the loss's own set-up
(``LossSpec.setup``) runs on the built module, and a resume is checked against what changed
(``resume.py``) before its state is loaded.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..utils.dir_lock import TrainLock
from .config import RunConfig
from .exports import check_exports
from .placement import process_group_timeout, weight_dtype

log = logging.getLogger(__name__)

_DISTRIBUTION = {"NO": "no distribution", "MULTI_GPU": "DDP", "MULTI_CPU": "DDP on CPUs"}  # accelerate's names


def make_accelerator(config: RunConfig):
    """The Accelerator (created before the DiT is loaded: ZeRO-3 must be known by then)."""
    from accelerate import Accelerator
    from accelerate.utils import AutocastKwargs, DistributedDataParallelKwargs, InitProcessGroupKwargs

    train = config.train
    mp = train.mixed_precision
    if mp == "auto":
        if os.environ.get("ACCELERATE_MIXED_PRECISION") or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
            mp = None  # the launcher's config (or the DeepSpeed JSON) decides
        else:
            mp = "bf16" if torch.cuda.is_available() and train.device != "cpu" else "no"
    # find_unused_parameters: the last block's text-stream LoRAs get no gradient (its outputs are discarded)
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
    group = InitProcessGroupKwargs(timeout=process_group_timeout())  # sized for a turn of a host load
    # the module's forward autocasts itself where --compute_precision asks (precision.py): accelerate's is off
    autocast = AutocastKwargs(enabled=False)
    return Accelerator(gradient_accumulation_steps=train.gradient_accumulation_steps, mixed_precision=mp,
                       cpu=train.device == "cpu", step_scheduler_with_optimizer=False,
                       kwargs_handlers=[ddp, group, autocast])


def deepspeed_config(accelerator) -> Optional[dict]:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin.deepspeed_config if plugin is not None else None


def total_optimizer_steps(config: RunConfig, batches_per_epoch: int) -> int:
    """``--max_steps``, or ``--num_epochs`` epochs of ``batches_per_epoch`` (the first epoch's count: with
    weighted sampling later epochs may cut their draws into a few more or fewer batches)."""
    t = config.train
    if t.max_steps > 0:
        return t.max_steps
    return max(1, math.ceil(batches_per_epoch * t.num_epochs / t.gradient_accumulation_steps))


@dataclass
class Run:
    """Everything the loop works with, built by :func:`setup`."""

    cfg: RunConfig
    accelerator: object
    module: object            # the unwrapped QIETrainingModule
    wrapped: object           # what accelerate returned (DDP / DeepSpeed engine / the module)
    optimizer: object         # the optimizer as built (schedule-free eval()/train() go here)
    wrapped_optimizer: object
    lr_scheduler: object
    engine: object            # the DeepSpeed engine, or None
    dataset: object
    sampler: object
    state: object             # checkpoint.TrainerState
    total_steps: int
    resumed: bool
    tracker: object
    validator: object
    lock: object = None       # the output directory's TrainLock (rank 0)
    ema: object = None        # --ema_decay's LoraEMA (training/ema.py)


def check_flags(config: RunConfig) -> None:
    """What the flags alone can tell, before anything is created or loaded: every device flag names a device
    of this machine; the flags that only mean something with ``--on_the_fly`` are warned about without it."""
    from ..models.load.devices import check_device_flags
    from .config import OnTheFlyConfig

    o = config.onthefly
    check_device_flags({"--text_encoder_device": o.text_encoder_device, "--vae_device": o.vae_device})
    if not o.on_the_fly:
        given = [flag for flag, set_ in (("--augment", o.augment), ("--text_encoder_device", o.text_encoder_device),
                                         ("--vae_device", o.vae_device),
                                         ("--prefetch", o.prefetch != OnTheFlyConfig.prefetch)) if set_]
        if given:
            log.warning("%s only mean%s something with --on_the_fly; ignored (this run reads --cache_dir)",
                        ", ".join(given), "s" if len(given) == 1 else "")


def forget_refused(output_dir: Path, existed: bool, had_lock: bool) -> None:
    """A run refused during its set-up leaves nothing behind: the output folder it created (nothing was
    trained into it), else the lock file it created."""
    import shutil

    if not existed:
        shutil.rmtree(output_dir, ignore_errors=True)
    elif not had_lock:
        (output_dir / TrainLock.name).unlink(missing_ok=True)


def setup(config: RunConfig, preflight: Optional[Callable] = None) -> Run:
    """Accelerator, the checked config, the output-directory lock, then the run (:func:`build_run`). Every flag
    is checked before the lock creates --output_dir; if the set-up still fails (a missing weight file, a
    refused resume), the lock is released and what this run created is removed (:func:`forget_refused`).
    ``preflight(cfg, preset)`` runs before a real preset's DiT loads (``Hooks.before_load``)."""
    from ..models.presets import get_preset

    accelerator = make_accelerator(config)  # first: under ZeRO-3 the DiT must be built partitioned
    ds_config = deepspeed_config(accelerator)
    preset = get_preset(config.train.model, zero_cond_t=config.train.zero_cond_t)
    cfg = config.resolved(preset)
    check_flags(cfg)
    check_exports(cfg, preset)  # --export against the modules this run trains, not after the last step
    out = Path(config.train.output_dir)
    existed, had_lock = out.exists(), (out / TrainLock.name).exists()
    lock = TrainLock(config.train.output_dir).acquire_for_ranks(accelerator)  # one run per --output_dir
    try:
        return build_run(cfg, preset, accelerator, ds_config, lock, preflight)
    except BaseException:
        lock.release()
        if accelerator.is_main_process:
            forget_refused(out, existed, had_lock)
        raise


def build_run(cfg: RunConfig, preset, accelerator, ds_config: Optional[dict], lock,
              preflight: Optional[Callable] = None) -> Run:
    """Cache, DiT + LoRA, optimizer, schedule, resume, logging — in that order."""
    from accelerate.utils import set_seed

    from ..models.load.devices import check_device_for
    from ..models.presets import family_of
    from ..utils.shared_dir import check_shared_dir
    from . import checkpoint as ckpt
    from .block_setup import check_checkpoint_policy, prepare_blocks
    from .checkpoint_auto import resolve_checkpoint_blocks
    from .data import build_training_data
    from .module import check_fp8_base
    from .optim import (build_lr_scheduler, build_optimizer, check_clipping, check_schedule_free_sharding,
                        configure_deepspeed)
    from .ema import EMAResume
    from .losses.registry import loss_spec
    from .onthefly import check_on_the_fly, live_store
    from .placement import build_module, check_block_swap, device_placement
    from .resume import apply_schedule, cache_identity, check_resume, frozen_identity, warn_data_order
    from .tracking import Tracker
    from .validation import Validator

    check_clipping(cfg.optim, ds_config)
    check_schedule_free_sharding(cfg.optim, ds_config, accelerator.num_processes)
    t = cfg.train
    log.info("training %s (zero_cond_t=%s) on %d process(es), %s, mixed precision %s", preset.name, t.zero_cond_t,
             accelerator.num_processes, "DeepSpeed ZeRO-%s" % ds_config.get("zero_optimization", {}).get("stage")
             if ds_config else _DISTRIBUTION.get(accelerator.distributed_type.value, accelerator.distributed_type.value),
             accelerator.mixed_precision)

    check_on_the_fly(cfg, ds_config)
    live = live_store(cfg, preset, accelerator) if cfg.onthefly.on_the_fly else None  # the encoders, loaded
    data = build_training_data(t.cache_dir, preset, cfg.sampling, seed=t.seed, cfg_dropout=t.cfg_dropout,
                               num_validation=t.num_validation if t.validate_every > 0 else 0,
                               num_replicas=accelerator.num_processes, rank=accelerator.process_index, live=live)
    dataset, sampler, store, val_idx = data.dataset, data.sampler, data.validation_store, data.validation_indices
    check_data = loss_spec(cfg.loss.loss).check_data
    if check_data is not None:  # the loss's own rows, before the DiT loads (--loss dpo: every row a pair)
        check_data(dataset)
    total_steps = total_optimizer_steps(cfg, len(sampler.epoch_batches(0)))

    set_seed(t.seed)  # the LoRA init, identical on every rank
    check_device_for(preset, accelerator.device, explicit_cpu=t.device == "cpu")
    check_fp8_base(cfg, ds_config)
    if t.fp8_compute:  # an A100 has no FP8 tensor cores: refused before the load
        from ..memory.fp8_compute import check_fp8_gpu

        check_fp8_gpu(accelerator.device)
    check_block_swap(cfg, ds_config)  # all before the (long) load
    check_checkpoint_policy(t)
    if t.checkpoint_blocks is not None:  # checked against the DiT; auto: the fewest that fit (checkpoint_auto.py)
        stage = int((ds_config or {}).get("zero_optimization", {}).get("stage", 0) or 0)
        cfg = resolve_checkpoint_blocks(cfg, preset, stage, accelerator.num_processes)
        t = cfg.train
    if loss_spec(cfg.loss.loss).check_launch is not None:  # the loss's own refusals of the launch (dmd: ZeRO-3)
        loss_spec(cfg.loss.loss).check_launch(cfg, ds_config)
    if preflight is not None and not preset.is_tiny and not t.no_preflight and family_of(preset).fullsize_verify:
        preflight(cfg, preset)  # seconds on a fake device, before a 41 GB load
        set_seed(t.seed)
    module, swapper = build_module(cfg, preset, accelerator, ds_config)
    if weight_dtype(accelerator) != torch.float32 and ds_config is None:
        log.info("compute precision: %s", "autocast to %s" % str(module.autocast_dtype).replace("torch.", "")
                 if module.autocast_dtype is not None else "pure bf16 over fp32 trainable weights")
    loss = loss_spec(cfg.loss.loss)
    if loss.setup is not None:  # the loss's own set-up (LBM: --lbm_pixel_loss's critic)
        loss.setup(module, cfg, preset, accelerator.device, weight_dtype(accelerator), ds_config)
        for state in module.loss_extras.values():  # a loss's own state (--loss nft's old policy) is checkpointed
            if hasattr(state, "state_dict"):
                accelerator.register_for_checkpointing(state)
    prepare_blocks(module.dit, t)  # --compile, --checkpoint_policy (block_setup.py)
    optimizer = build_optimizer(module.trainable_modules(), cfg.optim, deepspeed=ds_config is not None)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.optim, total_steps)
    if ds_config is not None:
        configure_deepspeed(ds_config, cfg.optim, t.batch_size)  # micro-batch size and --max_grad_norm
    # only a swapper places the module itself (accelerate refuses any device_placement under DeepSpeed)
    placement = {} if swapper is None else {"device_placement": device_placement(swapper, 3)}
    wrapped, wrapped_opt, wrapped_sched = accelerator.prepare(module, optimizer, lr_scheduler, **placement)
    ckpt.install_state_hooks(accelerator, module)

    state = ckpt.TrainerState(seed=t.seed, world_size=accelerator.num_processes, batch_size=t.batch_size,
                              gradient_accumulation_steps=t.gradient_accumulation_steps,
                              extra={"total_steps": total_steps, "config": cfg.to_json(),
                                     "cache": [live.identity()] if live else cache_identity(t.cache_dir),
                                     "frozen_lora": frozen_identity(module.frozen)})
    if accelerator.num_processes > 1:  # every rank writes here, rank 0 renames: one directory for all nodes
        check_shared_dir(t.output_dir, accelerator.is_main_process, accelerator.wait_for_everyone)
    if accelerator.is_main_process:
        ckpt.remove_leftovers(t.output_dir)
    resume_from = ckpt.resolve_resume(t.resume, t.output_dir)
    saved_extra = ckpt.read_trainer_state(resume_from).extra if resume_from is not None else None
    if saved_extra is not None:  # what changed since the checkpoint: refused, or applied (training/resume.py)
        changes = check_resume(saved_extra, state.extra, resume_from)
    ema_resume = EMAResume(cfg, module, accelerator, saved_extra.get("config", {}) if saved_extra is not None else None)
    if resume_from is not None:
        saved = ckpt.load_checkpoint(accelerator, module, resume_from)
        warn_data_order(saved, state, saved.extra.get("config"), cfg.to_json())
        state.step, state.position = saved.step, saved.position
        if changes:
            apply_schedule(optimizer, wrapped_sched, cfg.optim, state.step)
        # the position must lie inside its epoch's batches (ValueError if the data or flags changed)
        sampler.load_state_dict({"epoch": state.position.epoch, "batch": state.position.batch})
    ema = ema_resume.after_load()  # the checkpoint's EMA continued, added or dropped (training/ema.py)
    tracker = Tracker(t.output_dir, accelerator.is_main_process, t.report_to, cfg.to_json(),
                      resume_step=state.step if resume_from else None)
    validator = None
    if t.validate_every > 0 and val_idx:
        validator = Validator(store, val_idx, t.output_dir, preset, t.model_dir, t.validation_steps,
                              t.validation_cfg_scale, bool(t.zero_cond_t), accelerator, weight_dtype(accelerator))
    return Run(cfg=cfg, accelerator=accelerator, module=module, wrapped=wrapped, optimizer=optimizer,
               wrapped_optimizer=wrapped_opt, lr_scheduler=wrapped_sched,
               engine=wrapped if ds_config is not None else None, dataset=dataset, sampler=sampler, state=state,
               total_steps=total_steps, resumed=resume_from is not None, tracker=tracker, validator=validator, ema=ema,
               lock=lock)
