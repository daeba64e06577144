"""Phase-2 training loop: the DiT alone, from the cache, with accelerate.

Runs the same way under ``python -m diffsynth_qie.cli train`` / ``qie train`` (one
process) and under ``accelerate launch`` (DDP, DeepSpeed ZeRO-2/3; see
``deepspeed_configs/``). What DiffSynth's ``runner.py`` does differently, and why we
don't: batch size fixed at 1 (we batch shape-grouped samples), ``ConstantLR`` with
PyTorch's defaults (lr/3 for 5 steps; we use warmup + constant/cosine), weights-only
checkpoints (ours resume exactly), a whole-model ``get_state_dict`` per save (ours
gathers only the trainable parameters).

Determinism: the LoRA init comes from ``seed``; data order, CFG dropout and prompt
choice from ``(seed, epoch, entry)`` (``data.py``); σ and noise of micro-batch ``m`` of
optimizer step ``s`` on rank ``r`` from a generator seeded with ``(seed, r, s, m)``. So a
resumed run reproduces an uninterrupted one (on CPU exactly; on GPU up to kernel
non-determinism) without carrying generator states around.

Hooks (all optional, on :class:`Hooks`): ``on_step_end(step, record)`` runs on every
process after each optimizer step, once the step's loss is known on the main process;
``on_save(path)`` runs on the main process after a checkpoint directory is complete.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .config import RunConfig

log = logging.getLogger(__name__)


@dataclass
class Hooks:
    """Few, named extension points (see the module docstring for when they run)."""

    on_step_end: Optional[Callable[[int, dict], None]] = None
    on_save: Optional[Callable[[Path], None]] = None


@dataclass
class TrainResult:
    lora_path: Path
    steps: int
    total_steps: int
    losses: list[float] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)
    seconds: float = 0.0
    steps_per_second: float = 0.0


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
    # find_unused_parameters: in the last DiT block the text stream's outputs are discarded, so LoRAs on
    # its add_q_proj / to_add_out / txt_mlp get no gradient; plain DDP would fail on them.
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
    return Accelerator(gradient_accumulation_steps=train.gradient_accumulation_steps, mixed_precision=mp,
                       cpu=train.device == "cpu", step_scheduler_with_optimizer=False, kwargs_handlers=[ddp])


def deepspeed_config(accelerator) -> Optional[dict]:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin.deepspeed_config if plugin is not None else None


def weight_dtype(accelerator) -> torch.dtype:
    """Load dtype of the frozen DiT: the mixed-precision dtype, fp32 without mixed precision."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(accelerator.mixed_precision), torch.float32)


def split_holdout(n: int, num_validation: int, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out validation indices), deterministic per seed."""
    if num_validation <= 0:
        return list(range(n)), []
    if num_validation >= n:
        raise ValueError(f"--num_validation {num_validation} would hold out all {n} cache entries; "
                         f"use at most {n - 1} (or --validate_every 0)")
    held = sorted(random.Random(f"{seed}/validation").sample(range(n), num_validation))
    return [i for i in range(n) if i not in set(held)], held


def open_cache(cache_dir: str, preset):
    from ..cache.store import CacheStore

    store = CacheStore.open(cache_dir)
    if len(store) == 0:
        raise ValueError(f"cache {cache_dir} has no entries; check `qie cache`'s skipped.jsonl")
    cached = store.manifest.get("preset")
    multi = store.manifest.get("multi_image_prompt")
    if multi is not None and bool(multi) != preset.multi_image_prompt:
        raise ValueError(f"cache {cache_dir} was encoded for preset {cached!r} with the "
                         f"{'multi' if multi else 'single'}-image prompt template, but --model {preset.name} uses the "
                         f"{'multi' if preset.multi_image_prompt else 'single'}-image one; re-run `qie cache --model "
                         f"{preset.name}` or train with a matching --model")
    if cached and cached != preset.name:
        log.warning("cache %s was encoded with preset %r; training preset %r", cache_dir, cached, preset.name)
    return store


def total_optimizer_steps(config: RunConfig, batches_per_epoch: int) -> int:
    t = config.train
    if t.max_steps > 0:
        return t.max_steps
    return max(1, math.ceil(batches_per_epoch * t.num_epochs / t.gradient_accumulation_steps))


def load_dit(preset, config: RunConfig, accelerator):
    from ..models.loading import load_pipeline

    pipe = load_pipeline(preset, model_dir=config.train.model_dir, components=("dit",),
                         device=str(accelerator.device), torch_dtype=weight_dtype(accelerator))
    return pipe.dit


def train(config: RunConfig, hooks: Optional[Hooks] = None) -> TrainResult:
    """Train a LoRA from the cache; returns where the final LoRA is and the loss curve."""
    from accelerate.utils import set_seed
    from tqdm import tqdm

    from ..models.presets import get_preset
    from . import checkpoint as ckpt
    from .data import CacheDataset, GroupedBatchSampler, iterate_batches
    from .module import QIETrainingModule
    from .optim import build_lr_scheduler, build_optimizer, check_clipping
    from .tracking import Tracker
    from .validation import Validator

    hooks = hooks or Hooks()
    t_start = time.perf_counter()
    accelerator = make_accelerator(config)
    ds_config = deepspeed_config(accelerator)
    preset = get_preset(config.train.model, zero_cond_t=config.train.zero_cond_t)
    cfg = config.resolved(preset)
    check_clipping(cfg.optim, ds_config)
    t, main = cfg.train, accelerator.is_main_process
    log.info("training %s (zero_cond_t=%s) on %d process(es), %s, mixed precision %s", preset.name, t.zero_cond_t,
             accelerator.num_processes, "DeepSpeed ZeRO-%s" % ds_config.get("zero_optimization", {}).get("stage")
             if ds_config else accelerator.distributed_type.value, accelerator.mixed_precision)

    # --- data and model ----------------------------------------------------------
    store = open_cache(t.cache_dir, preset)
    train_idx, val_idx = split_holdout(len(store), t.num_validation if t.validate_every > 0 else 0, t.seed)
    dataset = CacheDataset(store, train_idx, seed=t.seed, cfg_dropout=t.cfg_dropout)
    sampler = GroupedBatchSampler([dataset.group_key(i) for i in range(len(dataset))], t.batch_size, seed=t.seed,
                                  num_replicas=accelerator.num_processes, rank=accelerator.process_index)
    total_steps = total_optimizer_steps(cfg, len(sampler))
    set_seed(t.seed)  # LoRA init (identical on every rank)
    module = QIETrainingModule(load_dit(preset, cfg, accelerator), cfg, preset.name)
    if ds_config is None:
        module.upcast_trainable(torch.float32)
    optimizer = build_optimizer(module.trainable_modules(), cfg.optim)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.optim, total_steps)
    if ds_config is not None and ds_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds_config["train_micro_batch_size_per_gpu"] = t.batch_size  # we prepare no DataLoader
    wrapped, wrapped_opt, wrapped_sched = accelerator.prepare(module, optimizer, lr_scheduler)
    engine = wrapped if ds_config is not None else None
    ckpt.install_state_hooks(accelerator, module)
    if ds_config is not None and cfg.optim.max_grad_norm and cfg.optim.max_grad_norm > 0:
        log.info("DeepSpeed clips gradients per its config (gradient_clipping=%s); --max_grad_norm is not used",
                 ds_config.get("gradient_clipping"))

    state = ckpt.TrainerState(seed=t.seed, world_size=accelerator.num_processes, batch_size=t.batch_size,
                              gradient_accumulation_steps=t.gradient_accumulation_steps,
                              extra={"total_steps": total_steps, "config": cfg.to_json()})
    resume_from = ckpt.resolve_resume(t.resume, t.output_dir)
    if resume_from is not None:
        saved = ckpt.load_checkpoint(accelerator, module, resume_from)
        for name in ("seed", "world_size", "batch_size", "gradient_accumulation_steps"):
            if getattr(saved, name) != getattr(state, name):
                log.warning("resuming with %s=%s (checkpoint: %s): the data order will differ from the original run",
                            name, getattr(state, name), getattr(saved, name))
        state.step, state.position = saved.step, saved.position
    tracker = Tracker(t.output_dir, main, t.report_to, cfg.to_json(), resume_step=state.step if resume_from else None)
    validator = None
    if t.validate_every > 0 and val_idx:
        validator = Validator(store, val_idx, t.output_dir, preset, t.model_dir, t.validation_steps,
                              t.validation_cfg_scale, bool(t.zero_cond_t), accelerator, weight_dtype(accelerator))

    # --- the loop --------------------------------------------------------------------
    device, dtype = module.compute_device_dtype()
    max_norm = cfg.optim.max_grad_norm if ds_config is None else 0.0
    result = TrainResult(lora_path=Path(t.output_dir) / ckpt.LORA_NAME, steps=state.step, total_steps=total_steps)
    stream = iterate_batches(dataset, sampler, state.position, t.num_workers)
    bar = tqdm(total=total_steps, initial=state.step, disable=not main, unit="step", desc="qie train",
               dynamic_ncols=True)
    last_saved, first_step, t_loop = state.step if resume_from else -1, state.step, time.perf_counter()
    micro: list[tuple[torch.Tensor, dict]] = []
    wrapped.train()
    try:
        while state.step < total_steps:
            batch, next_position = next(stream)
            gen = torch.Generator().manual_seed(micro_seed(t.seed, accelerator.process_index, state.step, len(micro)))
            with accelerator.accumulate(wrapped):
                loss, metrics = wrapped(batch, gen)
                accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients and max_norm and max_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(module.trainable_modules(), max_norm)
                wrapped_opt.step()
                wrapped_opt.zero_grad(set_to_none=True)
            micro.append((loss.detach(), metrics))
            if not accelerator.sync_gradients:
                continue
            # -- one optimizer step is complete
            wrapped_sched.step()
            state.step += 1
            state.position = next_position
            if state.step % t.log_every == 0 or state.step == total_steps:
                record = _step_record(accelerator, micro, wrapped_sched, optimizer, grad_norm, engine, state)
                if not math.isfinite(record["loss"]):  # same reduced value on every rank: all stop together
                    raise RuntimeError(f"loss became {record['loss']} at step {state.step}; lower --learning_rate, "
                                       "or use bf16 instead of fp16")
                if main:
                    tracker.log(state.step, record)
                    result.losses.append(record["loss"])
                    bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
                if hooks.on_step_end is not None:
                    hooks.on_step_end(state.step, record)
            micro = []
            bar.update(1)
            if validator is not None and state.step % t.validate_every == 0:
                _validate(validator, state.step, wrapped, optimizer, engine, tracker, device, dtype)
            if t.save_every > 0 and state.step % t.save_every == 0 and state.step < total_steps:
                path = ckpt.save_checkpoint(accelerator, module, optimizer, engine, t.output_dir, state, t.keep_last)
                result.checkpoints.append(path)
                last_saved = state.step
                if main and hooks.on_save is not None:
                    hooks.on_save(path)
        # --- the end: a last checkpoint (resumable / extendable) and the LoRA users load
        if last_saved != state.step:
            path = ckpt.save_checkpoint(accelerator, module, optimizer, engine, t.output_dir, state, t.keep_last)
            result.checkpoints.append(path)
            if main and hooks.on_save is not None:
                hooks.on_save(path)
        ckpt.save_final_lora(accelerator, module, optimizer, engine, t.output_dir)
    finally:
        bar.close()
        tracker.close()
    result.steps = state.step
    result.seconds = time.perf_counter() - t_start
    trained = state.step - first_step
    result.steps_per_second = trained / max(time.perf_counter() - t_loop, 1e-9)
    log.info("trained %d step(s) in %.1f s (%.2f steps/s); LoRA: %s", trained, result.seconds,
             result.steps_per_second, result.lora_path)
    accelerator.end_training()
    return result


def _step_record(accelerator, micro, scheduler, optimizer, grad_norm, engine, state) -> dict:
    """The logged values of one optimizer step: loss averaged over micro-batches and ranks."""
    loss = torch.stack([l.float() for l, _ in micro]).mean().to(accelerator.device)
    loss = accelerator.reduce(loss, reduction="mean") if accelerator.num_processes > 1 else loss
    record = {"loss": float(loss), "lr": float(scheduler.get_last_lr()[0]), "epoch": state.position.epoch}
    keys = {k for _, m in micro for k in m}
    for k in sorted(keys):
        vals = [float(m[k]) for _, m in micro if k in m]
        record[k] = sum(vals) / len(vals)
    group = optimizer.param_groups[0]
    if "d" in group:  # Prodigy's step-size estimate: the effective lr is d * lr
        record["prodigy_d"] = float(group["d"])
    if grad_norm is None and engine is not None and hasattr(engine, "get_global_grad_norm"):
        grad_norm = engine.get_global_grad_norm()
    if grad_norm is not None:
        record["grad_norm"] = float(grad_norm)
    return record


def _validate(validator, step, wrapped, optimizer, engine, tracker, device, dtype) -> None:
    """Render with the weights users would get (schedule-free: the average x), then train on."""
    from .optim import schedule_free_eval

    was_training = wrapped.training
    wrapped.eval()
    with schedule_free_eval(optimizer, engine):
        images = validator.run(step, wrapped, device, dtype)
    wrapped.train(was_training)
    tracker.log_images(step, images)
