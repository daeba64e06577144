"""Checkpoints: a canonical LoRA plus everything needed to resume exactly, written atomically.

Layout of ``<output_dir>``::

    checkpoint-<step>/
        lora.safetensors      canonical LoRA (lora/__init__.py): loads in `qie edit --lora`
                              and DiffSynth's pipe.load_lora. For a schedule-free optimizer
                              it holds the average x (see optim.schedule_free_eval).
        trainable.safetensors the raw trainable tensors (training point y, PEFT names);
                              not under DeepSpeed, whose engine checkpoint holds them
        state/                accelerator.save_state: optimizer, LR scheduler, RNG states;
                              under DeepSpeed the engine checkpoint (frozen weights excluded)
        trainer_state.json    step, data position, seed, world size, config, what was saved
    lora.safetensors          the final LoRA (written when training ends)

A checkpoint is written into ``.checkpoint-<step>.tmp/`` and renamed when complete, so
``checkpoint-*`` directories are always whole; ``--resume latest`` picks the newest.
Nothing here gathers the frozen DiT: under ZeRO-3 only the trainable parameters are
gathered (``deepspeed.zero.GatheredParameters``), never ``accelerator.get_state_dict``.
Finding, checking and recovering checkpoints (``--resume``) is ``checkpoint_recovery.py``.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from ..utils.atomic import DiskFullError, atomic_save, atomic_write_json, is_disk_full
from ..utils.collective import raise_on_every_rank
from .checkpoint_recovery import (FORMAT_VERSION, LORA_NAME, PREFIX, STATE_DIR, TRAINABLE_NAME,  # noqa: F401
                                  TRAINER_STATE, TrainerState, checkpoint_problem, list_checkpoints,
                                  read_trainer_state, remove_leftovers, resolve_resume)

log = logging.getLogger(__name__)


# --- gathering trainable weights ------------------------------------------------------
def gather_trainable(module, accelerator, fp32_master: bool = True) -> Optional[dict[str, torch.Tensor]]:
    """CPU copies of the trainable parameters on the main process (None elsewhere); under DeepSpeed the fp32
    masters, not the module's bf16 copies (``fp32_master=False``: the module's copies, e.g. while they hold a
    schedule-free optimizer's average x, which the masters do not).

    Under DeepSpeed every rank must call this (the gather is collective); only the
    trainable parameters are gathered.
    """
    named = module.trainable_named_parameters()
    params = [p for _, p in named]
    if fp32_master and any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in params):
        # DeepSpeed trains fp32 masters behind the module's bf16 copies: save the masters (as the single-GPU and
        # DDP paths save their fp32 weights), gathered from every rank's partition (collective, every rank)
        from deepspeed.utils import safe_get_full_fp32_param

        masters = {n: safe_get_full_fp32_param(p) for n, p in named}
        if all(m is not None for m in masters.values()):
            return {n: m.detach().to("cpu", torch.float32, copy=True) for n, m in masters.items()} \
                if accelerator.is_main_process else None
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3: gather the module's copies
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {n: p.detach().to("cpu", copy=True) for n, p in named} if accelerator.is_main_process else None
    if not accelerator.is_main_process:
        return None
    return {n: p.detach().to("cpu", copy=True) for n, p in named}


def save_lora_file(path: str | os.PathLike, module, state: dict[str, torch.Tensor],
                   extra_metadata: Optional[dict] = None) -> Path:
    """Write ``state`` (from :func:`gather_trainable`) as a canonical LoRA file, atomically."""
    from ..lora import save_lora

    return save_lora(path, module.export_lora_state_dict(state), metadata={**module.lora_metadata(),
                                                                          **(extra_metadata or {})})


# --- save / load ----------------------------------------------------------------------
def install_state_hooks(accelerator, module) -> None:
    """Keep accelerate's save_state/load_state from writing or reading the whole DiT.

    Without DeepSpeed, ``save_state`` would store ``model.state_dict()`` — every frozen
    weight. The hooks drop the model from accelerate's lists; :func:`save_checkpoint`
    stores the trainable tensors itself (``trainable.safetensors``). Under DeepSpeed
    the engine checkpoint is kept, with ``exclude_frozen_parameters=True``.
    """
    def on_save(models, weights, output_dir):
        weights.clear()

    def on_load(models, input_dir):
        models.clear()

    accelerator.register_save_state_pre_hook(on_save)
    accelerator.register_load_state_pre_hook(on_load)


def _uses_deepspeed(accelerator) -> bool:
    return getattr(accelerator.state, "deepspeed_plugin", None) is not None


def save_checkpoint(accelerator, module, optimizer, engine, output_dir: str | os.PathLike, state: TrainerState,
                    keep_last: int = 0, metadata: Optional[dict] = None) -> Path:
    """Write ``checkpoint-<step>`` (all ranks call this) and prune old ones; returns its path.

    ``module`` is the unwrapped training module, ``optimizer`` the optimizer as built
    (for schedule-free eval/train), ``engine`` the DeepSpeed engine or None. A full disk
    raises :class:`DiskFullError` naming the newest complete checkpoint.
    """
    try:
        return _save_checkpoint(accelerator, module, optimizer, engine, Path(output_dir), state, keep_last, metadata)
    except Exception as e:  # also accelerate's save_state, which writes without atomic_path
        if not is_disk_full(e):
            raise
        tmp = Path(output_dir) / f".{PREFIX}{state.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        done = list_checkpoints(output_dir)
        safe = (f"the newest complete checkpoint is {done[-1]} (--resume latest continues from it)" if done
                else "no checkpoint is complete yet")
        raise DiskFullError(getattr(e, "path", tmp / STATE_DIR),
                            f"{PREFIX}{state.step} was not saved; {safe}") from None


def _save_checkpoint(accelerator, module, optimizer, engine, out: Path, state: TrainerState,
                     keep_last: int, metadata: Optional[dict]) -> Path:
    from .optim import schedule_free_eval

    final = out / f"{PREFIX}{state.step}"
    tmp = out / f".{PREFIX}{state.step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()

    failure = None
    try:
        # The LoRA users load: for a schedule-free optimizer, its average x.
        with schedule_free_eval(optimizer, engine) as held:
            lora_state = gather_trainable(module, accelerator, fp32_master=held == "trained weights")
            if accelerator.is_main_process:
                save_lora_file(tmp / LORA_NAME, module, lora_state, {**(metadata or {}), "step": state.step,
                                                                     "weights": held})
        # The resumable state: the training point y, exactly as the optimizer left it.
        if _uses_deepspeed(accelerator):
            accelerator.save_state(str(tmp / STATE_DIR), exclude_frozen_parameters=True)
        else:
            accelerator.save_state(str(tmp / STATE_DIR))
            raw = gather_trainable(module, accelerator)
            if accelerator.is_main_process:
                from safetensors.torch import save_file

                atomic_save(tmp / TRAINABLE_NAME,
                            lambda p: save_file({k: v.contiguous() for k, v in raw.items()}, str(p)))
    except Exception as e:  # told to every rank below, instead of leaving the others at the barrier
        failure = e
    raise_on_every_rank(accelerator, failure)  # (a barrier) every rank's part of state/ is written
    if accelerator.is_main_process:
        state.extra["weights_in_lora"] = held
        atomic_write_json(tmp / TRAINER_STATE, state.to_json())
        old = out / f".{PREFIX}{state.step}.old"
        if final.exists():  # the same step saved again (e.g. after a resume): swap, then delete
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        log.info("saved %s (LoRA: %s)", final, held)
        if keep_last > 0:
            for stale in list_checkpoints(out)[:-keep_last]:
                shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, module, ckpt: str | os.PathLike) -> TrainerState:
    """Restore optimizer, scheduler, RNG and trainable weights from ``ckpt`` (all ranks call this)."""
    ckpt = Path(ckpt)
    trainer_state = read_trainer_state(ckpt)
    if _uses_deepspeed(accelerator):
        accelerator.load_state(str(ckpt / STATE_DIR), load_module_strict=False)
    else:
        from safetensors.torch import load_file

        raw = load_file(str(ckpt / TRAINABLE_NAME))
        own = {n: p for n, p in module.trainable_named_parameters()}
        if set(raw) != set(own):
            missing, extra = sorted(set(own) - set(raw)), sorted(set(raw) - set(own))
            raise ValueError(f"--resume {ckpt}: its trainable tensors differ from this run's (missing {missing[:3]}, "
                             f"unexpected {extra[:3]}); resume with the same --lora_* / --full_finetune_modules")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(raw[n].to(device=p.device, dtype=p.dtype))
        accelerator.load_state(str(ckpt / STATE_DIR))
    log.info("resumed from %s at step %d (epoch %d, batch %d)", ckpt, trainer_state.step,
             trainer_state.position.epoch, trainer_state.position.batch)
    return trainer_state


def save_final_lora(accelerator, module, optimizer, engine, output_dir: str | os.PathLike,
                    metadata: Optional[dict] = None) -> Path:
    """``<output_dir>/lora.safetensors`` from the current weights (all ranks call this)."""
    from .optim import schedule_free_eval

    path = Path(output_dir) / LORA_NAME
    with schedule_free_eval(optimizer, engine) as held:
        lora_state = gather_trainable(module, accelerator, fp32_master=held == "trained weights")
        if accelerator.is_main_process:
            save_lora_file(path, module, lora_state, {**(metadata or {}), "weights": held})
            log.info("saved the final LoRA to %s (%s)", path, held)
    accelerator.wait_for_everyone()
    return path


def checkpoint_summary(ckpt: str | os.PathLike) -> dict[str, Any]:
    """Small JSON-able description of a checkpoint (for logs and tests)."""
    ckpt = Path(ckpt)
    return {"path": str(ckpt), **read_trainer_state(ckpt).to_json()}
