"""Phase-2 training loop: the DiT alone, from the cache (or encoding on the fly), with accelerate.

Runs the same way under ``python -m diffsynth_qie.cli train`` / ``qie train`` (one
process) and under ``accelerate launch`` (DDP, DeepSpeed ZeRO-2/3; see
``deepspeed_configs/``). What DiffSynth's ``runner.py`` does differently, and why we
don't: batch size fixed at 1 (we train real batches: bucketed, mixed shapes
padded and masked, see ``data.py``), ``ConstantLR`` with
PyTorch's defaults (lr/3 for 5 steps; we use warmup + constant/cosine), weights-only
checkpoints (ours resume exactly), a whole-model ``get_state_dict`` per save (ours
gathers only the trainable parameters).

Determinism: the LoRA init comes from ``seed``; data order, CFG dropout and prompt
choice from ``(seed, epoch, entry)`` (``data.py``); σ and noise of micro-batch ``m`` of
optimizer step ``s`` on rank ``r`` from a generator seeded with ``(seed, r, s, m)``. So a
resumed run reproduces an uninterrupted one (on CPU exactly; on GPU up to kernel
non-determinism) without carrying generator states around.

Hooks (all optional, on :class:`Hooks`): ``on_step_end(step, record)`` runs on every
process after each optimizer step, before validation and saving; ``record`` holds the
step's logged values (the per-sample mean loss over the step's micro-batches and ranks, lr, metrics), or is
empty on steps ``--log_every`` skips. ``on_save(path)`` runs on the main process after a
checkpoint directory is complete.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from ..utils.dir_lock import TrainLock
from .config import RunConfig
from .placement import weight_dtype

log = logging.getLogger(__name__)


@dataclass
class Hooks:
    """Few, named extension points (see the module docstring for when they run)."""

    on_step_end: Optional[Callable[[int, dict], None]] = None
    on_save: Optional[Callable[[Path], None]] = None


@dataclass
class TrainResult:
    lora_path: Path
    steps: int                # the step training stopped at
    total_steps: int
    new_steps: int = 0        # steps trained by this call (not counting a resumed-from checkpoint)
    losses: list[float] = field(default_factory=list)  # logged losses (main process)
    checkpoints: list[Path] = field(default_factory=list)
    seconds: float = 0.0
    steps_per_second: float = 0.0


_DISTRIBUTION = {"NO": "no distribution", "MULTI_GPU": "DDP", "MULTI_CPU": "DDP on CPUs"}  # accelerate's names


def micro_seed(seed: int, rank: int, step: int, micro: int) -> int:
    """Seed of the σ/noise generator for one micro-batch (independent of history)."""
    digest = hashlib.sha256(f"{seed}/{rank}/{step}/{micro}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def make_accelerator(config: RunConfig):
    """The Accelerator (created before the DiT is loaded: ZeRO-3 must be known by then)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    train = config.train
    mp = train.mixed_precision
    if mp == "auto":
        if os.environ.get("ACCELERATE_MIXED_PRECISION") or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
            mp = None  # the launcher's config (or the DeepSpeed JSON) decides
        else:
            mp = "bf16" if torch.cuda.is_available() and train.device != "cpu" else "no"
    # find_unused_parameters: the last block's text-stream LoRAs get no gradient (its outputs are discarded)
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
    return Accelerator(gradient_accumulation_steps=train.gradient_accumulation_steps, mixed_precision=mp,
                       cpu=train.device == "cpu", step_scheduler_with_optimizer=False, kwargs_handlers=[ddp])


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
class _Run:
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


def setup(config: RunConfig) -> _Run:
    """Accelerator, the checked config, the output-directory lock, then the run (:func:`_build_run`); the lock
    is released if that fails. (A bad flag fails before the lock: nothing is written into --output_dir.)"""
    from ..models.presets import get_preset

    accelerator = make_accelerator(config)  # first: under ZeRO-3 the DiT must be built partitioned
    ds_config = deepspeed_config(accelerator)
    preset = get_preset(config.train.model, zero_cond_t=config.train.zero_cond_t)
    cfg = config.resolved(preset)
    lock = TrainLock(config.train.output_dir).acquire_for_ranks(accelerator)  # one run per --output_dir
    try:
        return _build_run(cfg, preset, accelerator, ds_config, lock)
    except BaseException:
        lock.release()
        raise


def _build_run(cfg: RunConfig, preset, accelerator, ds_config: Optional[dict], lock) -> _Run:
    """Cache, DiT + LoRA, optimizer, schedule, resume, logging — in that order."""
    from accelerate.utils import set_seed

    from ..models.compile import compile_blocks
    from ..models.devices import check_device_for
    from ..models.presets import family_of
    from ..utils.shared_dir import check_shared_dir
    from . import checkpoint as ckpt
    from .data import build_training_data
    from .module import check_fp8_base
    from .optim import (build_lr_scheduler, build_optimizer, check_clipping, check_schedule_free_sharding,
                        configure_deepspeed)
    from .ema import build_ema
    from .losses.registry import loss_spec
    from .onthefly import check_on_the_fly, live_store
    from .placement import build_module, check_block_swap, device_placement
    from .resume import apply_schedule, cache_identity, check_resume, warn_data_order
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
    total_steps = total_optimizer_steps(cfg, len(sampler.epoch_batches(0)))

    set_seed(t.seed)  # the LoRA init, identical on every rank
    check_device_for(preset, accelerator.device, explicit_cpu=t.device == "cpu")
    check_fp8_base(cfg, ds_config)
    check_block_swap(cfg, ds_config)  # both before the (long) load
    if not preset.is_tiny and not t.no_preflight and family_of(preset).fullsize_verify:
        from .verify import preflight

        preflight(cfg, preset)  # seconds on a fake device, before a 41 GB load
        set_seed(t.seed)
    module, swapper = build_module(cfg, preset, accelerator, ds_config)
    loss = loss_spec(cfg.loss.loss)
    if loss.setup is not None:  # the loss's own set-up (LBM: --lbm_pixel_loss's critic)
        loss.setup(module, cfg, preset, accelerator, ds_config)
    if t.compile:
        compile_blocks(module.dit)
    optimizer = build_optimizer(module.trainable_modules(), cfg.optim)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.optim, total_steps)
    if ds_config is not None:
        configure_deepspeed(ds_config, cfg.optim, t.batch_size)  # micro-batch size and --max_grad_norm
    # only a swapper places the module itself (accelerate refuses any device_placement under DeepSpeed)
    placement = {} if swapper is None else {"device_placement": device_placement(swapper, 3)}
    wrapped, wrapped_opt, wrapped_sched = accelerator.prepare(module, optimizer, lr_scheduler, **placement)
    ckpt.install_state_hooks(accelerator, module)
    ema = build_ema(cfg, module, accelerator)  # registered before a resume loads the state

    state = ckpt.TrainerState(seed=t.seed, world_size=accelerator.num_processes, batch_size=t.batch_size,
                              gradient_accumulation_steps=t.gradient_accumulation_steps,
                              extra={"total_steps": total_steps, "config": cfg.to_json(),
                                     "cache": [live.identity()] if live else cache_identity(t.cache_dir)})
    if accelerator.num_processes > 1:  # every rank writes here, rank 0 renames: one directory for all nodes
        check_shared_dir(t.output_dir, accelerator.is_main_process, accelerator.wait_for_everyone)
    if accelerator.is_main_process:
        ckpt.remove_leftovers(t.output_dir)
    resume_from = ckpt.resolve_resume(t.resume, t.output_dir)
    if resume_from is not None:  # what changed since the checkpoint: refused, or applied (training/resume.py)
        changes = check_resume(ckpt.read_trainer_state(resume_from).extra, state.extra, resume_from)
        saved = ckpt.load_checkpoint(accelerator, module, resume_from)
        warn_data_order(saved, state, saved.extra.get("config"), cfg.to_json())
        state.step, state.position = saved.step, saved.position
        if changes:
            apply_schedule(optimizer, wrapped_sched, cfg.optim, state.step)
        # the position must lie inside its epoch's batches (ValueError if the data or flags changed)
        sampler.load_state_dict({"epoch": state.position.epoch, "batch": state.position.batch})
    tracker = Tracker(t.output_dir, accelerator.is_main_process, t.report_to, cfg.to_json(),
                      resume_step=state.step if resume_from else None)
    validator = None
    if t.validate_every > 0 and val_idx:
        validator = Validator(store, val_idx, t.output_dir, preset, t.model_dir, t.validation_steps,
                              t.validation_cfg_scale, bool(t.zero_cond_t), accelerator, weight_dtype(accelerator))
    return _Run(cfg=cfg, accelerator=accelerator, module=module, wrapped=wrapped, optimizer=optimizer,
                wrapped_optimizer=wrapped_opt, lr_scheduler=wrapped_sched,
                engine=wrapped if ds_config is not None else None, dataset=dataset, sampler=sampler, state=state,
                total_steps=total_steps, resumed=resume_from is not None, tracker=tracker, validator=validator, ema=ema,
                lock=lock)


def train(config: RunConfig, hooks: Optional[Hooks] = None) -> TrainResult:
    """Train a LoRA from the cache; returns where the final LoRA is and the loss curve."""
    t_start = time.perf_counter()
    run = setup(config)
    try:
        result = run_loop(run, hooks or Hooks())
    finally:
        run.tracker.close()
        run.lock.release()
    result.seconds = time.perf_counter() - t_start
    log.info("trained %d step(s) in %.1f s (%.2f steps/s); LoRA: %s", result.new_steps, result.seconds,
             result.steps_per_second, result.lora_path)
    run.accelerator.end_training()
    return result


def run_loop(run: _Run, hooks: Hooks) -> TrainResult:
    """Optimizer steps until ``total_steps``, then a last checkpoint and ``<output_dir>/lora.safetensors``."""
    from tqdm import tqdm

    from . import checkpoint as ckpt
    from .accumulation import micro_loss_scale, step_sample_count
    from .data import batch_image_tokens, iterate_batches
    from .onthefly import prefetched
    from .validation import validate_step

    t, acc, state = run.cfg.train, run.accelerator, run.state
    # DeepSpeed clips itself (setup wrote --max_grad_norm into its config)
    max_norm = run.cfg.optim.resolved().max_grad_norm if run.engine is None else 0.0
    result = TrainResult(lora_path=Path(t.output_dir) / ckpt.LORA_NAME, steps=state.step, total_steps=run.total_steps)
    ahead = run.cfg.onthefly.prefetch if run.cfg.onthefly.on_the_fly else 0  # encoded while the DiT trains
    stream = prefetched(iterate_batches(run.dataset, run.sampler, state.position, t.num_workers), ahead)
    bar = tqdm(total=run.total_steps, initial=state.step, disable=not acc.is_main_process, unit="step",
               desc="qie train", dynamic_ncols=True)
    last_saved = state.step if run.resumed else -1
    first_step, t_loop = state.step, time.perf_counter()
    accumulation = t.gradient_accumulation_steps

    def save():
        path = ckpt.save_checkpoint(acc, run.module, run.optimizer, run.engine, t.output_dir, state, t.keep_last)
        result.checkpoints.append(path)
        if acc.is_main_process and hooks.on_save is not None:
            hooks.on_save(path)
        return path

    run.wrapped.train()
    try:
        while state.step < run.total_steps:
            # The whole step's micro-batches first: their sizes summed over the ranks normalise the loss,
            # so every sample of the step weighs the same whatever micro-batch it lands in (accumulation.py).
            fetched = [next(stream) for _ in range(accumulation)]
            sizes = [len(batch["target_latents"]) for batch, _ in fetched]
            step_samples = step_sample_count(sizes, acc)
            if run.cfg.timesteps.timestep_sampling == "stratified":  # the step's σ's: one per stratum
                _attach_strata(fetched, sizes, t.seed, state.step, acc)
            micro: list[tuple[torch.Tensor, dict, float]] = []
            grad_norm = None
            for m, (batch, _) in enumerate(fetched):
                # σ and noise of this micro-batch depend only on (seed, rank, step, micro index): exact resumes
                gen = torch.Generator().manual_seed(micro_seed(t.seed, acc.process_index, state.step, m))
                scale = micro_loss_scale(sizes[m], step_samples, accumulation, acc.num_processes)
                with acc.accumulate(run.wrapped):
                    loss, metrics = run.wrapped(batch, gen)
                    acc.backward(loss * scale if scale != 1.0 else loss)
                    if acc.sync_gradients and max_norm:
                        grad_norm = acc.clip_grad_norm_(run.module.trainable_modules(), max_norm)
                    run.wrapped_optimizer.step()  # no-op until the last micro-batch of the step
                    run.wrapped_optimizer.zero_grad(set_to_none=True)
                real, padded = batch_image_tokens(batch)
                micro.append((loss.detach(), {**metrics, "image_tokens": real, "padded_image_tokens": padded,
                                              "samples": sizes[m]}, scale))
            assert acc.sync_gradients, "the step's last micro-batch must step the optimizer"
            # -- one optimizer step is complete
            if run.ema is not None:  # (--ema_decay)
                run.ema.update()
            lr = run.optimizer.param_groups[0]["lr"]  # the rate this step used
            run.lr_scheduler.step()
            state.step += 1
            state.position = fetched[-1][1]
            record: dict = {}
            if state.step % t.log_every == 0 or state.step == run.total_steps:
                record = _step_record(acc, micro, lr, run.optimizer, grad_norm, run.engine, state)
                if not math.isfinite(record["loss"]):  # the same reduced value on every rank: all stop together
                    raise RuntimeError(f"loss became {record['loss']} at step {state.step}; lower --learning_rate, "
                                       "or use bf16 instead of fp16")
                if acc.is_main_process:
                    run.tracker.log(state.step, record)
                    result.losses.append(record["loss"])
                    bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}")
            if hooks.on_step_end is not None:
                hooks.on_step_end(state.step, record)
            bar.update(1)
            if run.validator is not None and state.step % t.validate_every == 0:
                validate_step(run, state.step)
            if t.save_every > 0 and state.step % t.save_every == 0 and state.step < run.total_steps:
                save()
                last_saved = state.step
        if last_saved != state.step:  # a last checkpoint: the run can be resumed or extended
            save()
        ckpt.save_final_lora(acc, run.module, run.optimizer, run.engine, t.output_dir, {"step": state.step})
        if run.ema is not None:  # lora_ema.safetensors beside it
            run.ema.save(acc, run.module, t.output_dir, {"step": state.step})
    finally:
        stream.close()
        bar.close()
    result.steps, result.new_steps = state.step, state.step - first_step
    result.steps_per_second = result.new_steps / max(time.perf_counter() - t_loop, 1e-9)
    return result


def _attach_strata(fetched, sizes, seed: int, step: int, accelerator) -> None:
    """Give each fetched micro-batch its samples' strata of the step (``--timestep_sampling stratified``)."""
    from .accumulation import step_sample_starts
    from .timesteps import micro_strata, step_strata

    starts, total = step_sample_starts(sizes, accelerator)
    for (batch, _), strata in zip(fetched, micro_strata(step_strata(seed, step, total), starts, sizes)):
        batch["timestep_strata"] = strata


def _step_record(accelerator, micro, lr, optimizer, grad_norm, engine, state) -> dict:
    """The logged values of one optimizer step: the loss as the per-sample mean over all micro-batches
    and ranks (what the gradient is the gradient of), this rank's other metrics as per-sample means, and
    the padding fraction of the image tokens the step computed on (token-weighted, all ranks)."""
    from .accumulation import step_mean

    tokens = [(m.pop("image_tokens"), m.pop("padded_image_tokens")) for _, m, _ in micro]
    samples = [m.pop("samples") for _, m, _ in micro]
    shared = torch.stack([step_mean([l for l, _, _ in micro], [s for _, _, s in micro]).cpu(),
                          torch.tensor([float(r) for r, _ in tokens]).mean(),
                          torch.tensor([float(p) for _, p in tokens]).mean()]).to(accelerator.device)
    shared = accelerator.reduce(shared, reduction="mean") if accelerator.num_processes > 1 else shared
    loss, real, padded = (float(v) for v in shared)
    record = {"loss": loss, "lr": float(lr), "epoch": state.position.epoch,
              "padding_fraction": 1.0 - real / padded if padded else 0.0}
    keys = {k for _, m, _ in micro for k in m}
    for k in sorted(keys):
        pairs = [(float(m[k]), n) for (_, m, _), n in zip(micro, samples) if k in m and n]
        if pairs:
            record[k] = sum(v * n for v, n in pairs) / sum(n for _, n in pairs)
    group = optimizer.param_groups[0]
    if "d" in group:  # Prodigy's step-size estimate: the effective lr is d * lr
        record["prodigy_d"] = float(group["d"])
    if grad_norm is None and engine is not None and hasattr(engine, "get_global_grad_norm"):
        grad_norm = engine.get_global_grad_norm()
    if grad_norm is not None:
        record["grad_norm"] = float(grad_norm)
    return record
