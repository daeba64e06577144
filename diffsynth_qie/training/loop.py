"""Phase-2 training loop: the DiT alone, from the cache (or encoding on the fly), with accelerate.

As torchtitan's trainer: :func:`train` sets the run up (``run_setup.py``) and runs :func:`run_loop`, the
outer loop (fetch a step's micro-batches, :func:`train_step`, log, validate, save); :func:`train_step` is
one optimizer step, a function tests can call on a set-up run.

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .config import RunConfig
from .losses.registry import loss_spec
from .run_setup import Run, setup

log = logging.getLogger(__name__)


@dataclass
class Hooks:
    """Few, named extension points (see the module docstring for when they run)."""

    on_step_end: Optional[Callable[[int, dict], None]] = None
    on_save: Optional[Callable[[Path], None]] = None
    # once, after every flag is checked and before a real preset's DiT loads (tiny presets and --no_preflight
    # skip it): ``qie train`` passes its fake-device preflight (``preflight/train.py``), which sits above training/
    before_load: Optional[Callable[[object, object], object]] = None


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


@dataclass
class StepOutput:
    """What one optimizer step leaves for the log (:func:`train_step`)."""

    micro: list               # per micro-batch: (detached loss, metrics, loss scale)
    lr: float                 # the learning rate this step used
    grad_norm: Optional[torch.Tensor] = None


def micro_seed(seed: int, rank: int, step: int, micro: int) -> int:
    """Seed of the σ/noise generator for one micro-batch (independent of history)."""
    digest = hashlib.sha256(f"{seed}/{rank}/{step}/{micro}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def train(config: RunConfig, hooks: Optional[Hooks] = None) -> TrainResult:
    """Train a LoRA from the cache; returns where the final LoRA is and the loss curve."""
    t_start = time.perf_counter()
    hooks = hooks or Hooks()
    run = setup(config, hooks.before_load)
    try:
        result = run_loop(run, hooks)
    finally:
        run.tracker.close()
        run.lock.release()
    result.seconds = time.perf_counter() - t_start
    log.info("trained %d step(s) in %.1f s (%.2f steps/s); LoRA: %s", result.new_steps, result.seconds,
             result.steps_per_second, result.lora_path)
    run.accelerator.end_training()
    return result


def run_loop(run: Run, hooks: Hooks) -> TrainResult:
    """Optimizer steps until ``total_steps``, then a last checkpoint and ``<output_dir>/lora.safetensors``."""
    from tqdm import tqdm

    from ..models.load.compile import log_compile_counts
    from . import checkpoint as ckpt
    from .data import iterate_batches
    from .ema import remove_stale_ema
    from .onthefly import prefetched
    from .validation import validate_step

    t, acc, state = run.cfg.train, run.accelerator, run.state
    result = TrainResult(lora_path=Path(t.output_dir) / ckpt.LORA_NAME, steps=state.step, total_steps=run.total_steps)
    ahead = run.cfg.onthefly.prefetch if run.cfg.onthefly.on_the_fly else 0  # encoded while the DiT trains
    stream = prefetched(iterate_batches(run.dataset, run.sampler, state.position, t.num_workers), ahead)
    bar = tqdm(total=run.total_steps, initial=state.step, disable=not acc.is_main_process, unit="step",
               desc="qie train", dynamic_ncols=True)
    last_saved = state.step if run.resumed else -1
    first_step, t_loop = state.step, time.perf_counter()

    def save():
        path = ckpt.save_checkpoint(acc, run.module, run.optimizer, run.engine, t.output_dir, state, t.keep_last)
        result.checkpoints.append(path)
        if acc.is_main_process and hooks.on_save is not None:
            hooks.on_save(path)
        return path

    run.wrapped.train()
    step_seconds = []  # wall time of the optimizer steps since the last log (the report shows it beside the prediction)
    try:
        while state.step < run.total_steps:
            t_step = time.perf_counter()
            out = train_step(run, [next(stream) for _ in range(t.gradient_accumulation_steps)])
            step_seconds.append(time.perf_counter() - t_step)
            if state.step in (first_step + 1, run.total_steps):  # the first step compiles; any later graph recompiled
                log_compile_counts(run.module.dit, f"after step {state.step}")
            record: dict = {}
            if state.step % t.log_every == 0 or state.step == run.total_steps:
                record = _step_record(acc, out.micro, out.lr, run.optimizer, out.grad_norm, run.engine, state)
                record["step_s"] = sum(step_seconds) / len(step_seconds)
                step_seconds.clear()
                if not math.isfinite(record["loss"]):  # the same reduced value on every rank: all stop together
                    raise RuntimeError(f"loss became {record['loss']} at step {state.step}; lower --learning_rate, "
                                       "or use bf16 instead of fp16")
                if acc.is_main_process:
                    run.tracker.log(state.step, record)
                    result.losses.append(record["loss"])
                    bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{out.lr:.2e}")
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
        if run.cfg.lora.export and acc.is_main_process:  # --export: checked exports beside it
            from .exports import write_exports

            write_exports(run.cfg, result.lora_path)
        finish = loss_spec(run.cfg.loss.loss).finish
        if finish is not None and acc.is_main_process:  # the loss's own files beside it (dmd: --merge_teacher)
            finish(run.cfg, result.lora_path)
        if run.ema is not None:  # lora_ema.safetensors beside it
            run.ema.save(acc, run.module, t.output_dir, {"step": state.step})
        elif acc.is_main_process:  # (an earlier run's average is not this LoRA's)
            remove_stale_ema(t.output_dir)
    finally:
        stream.close()
        bar.close()
    result.steps, result.new_steps = state.step, state.step - first_step
    result.steps_per_second = result.new_steps / max(time.perf_counter() - t_loop, 1e-9)
    return result


def train_step(run: Run, fetched: list) -> StepOutput:
    """One optimizer step over its micro-batches ``fetched`` (``(batch, position)`` pairs, as the data stream
    yields them): forward and backward of each with the loss normalised over the whole step, clipping, the
    optimizer step, the EMA update and the LR schedule; ``run.state`` moves to the next step."""
    from .accumulation import micro_loss_scale, step_sample_count
    from .data import batch_image_tokens

    t, acc, state = run.cfg.train, run.accelerator, run.state
    # DeepSpeed clips itself (setup wrote --max_grad_norm into its config)
    max_norm = run.cfg.optim.resolved().max_grad_norm if run.engine is None else 0.0
    # The whole step's micro-batches first: their sizes summed over the ranks normalise the loss,
    # so every sample of the step weighs the same whatever micro-batch it lands in (accumulation.py).
    sizes = [len(batch["target_latents"]) for batch, _ in fetched]
    step_samples = step_sample_count(sizes, acc)
    if run.cfg.timesteps.timestep_sampling == "stratified":  # the step's σ's: one per stratum
        _attach_strata(fetched, sizes, t.seed, state.step, acc)
    micro: list[tuple[torch.Tensor, dict, float]] = []
    grad_norm = None
    for m, (batch, _) in enumerate(fetched):
        # σ and noise of this micro-batch depend only on (seed, rank, step, micro index): exact resumes
        gen = torch.Generator().manual_seed(micro_seed(t.seed, acc.process_index, state.step, m))
        scale = micro_loss_scale(sizes[m], step_samples, len(fetched), acc.num_processes)
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
    for loss_state in run.module.loss_extras.values():  # a loss's own state that follows the steps (--loss nft)
        if hasattr(loss_state, "after_step"):
            loss_state.after_step()
    lr = run.optimizer.param_groups[0]["lr"]  # the rate this step used
    run.lr_scheduler.step()
    state.step += 1
    state.position = fetched[-1][1]
    return StepOutput(micro=micro, lr=lr, grad_norm=grad_norm)

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
