"""``--resume``: what may change between the checkpoint's run and this one.

Checked against the settings the checkpoint recorded, before anything of it is loaded:

- **Refused** (one ``ValueError`` naming each setting, old -> new): what the saved tensors or the data
  order depend on: the model, the cache (its manifest's hash), the LoRA's shape (rank, alpha, targets, full
  fine-tuned modules), the optimizer (its state has another layout), the loss, the frozen LoRA it trains on
  top of (``--frozen_lora``: the file's content and scale).
- **Applied and logged**: the learning-rate schedule and the optimizer's hyper-parameters (learning rate,
  schedule, warmup, final ratio, weight decay, betas, clipping). A checkpoint's optimizer and scheduler
  state hold the old values; :func:`apply_schedule` puts the new ones in, so the next step runs at the new
  schedule's learning rate for its step. With ``--loss nft``, its reward and rollout settings (``--reward``,
  ``--reward_judge``, ``--nft_group_size``, ``--nft_rollout_steps``, ``--nft_beta``, ...): the next rollouts use them.
- **The EMA** (``--ema_decay``, ``training/ema.py``: ``EMAResume``): continued; a changed decay applied from
  the restored average on and logged; an EMA added (it starts from the resumed weights) or dropped, logged.
- **Warned** (as before): seed, world size, batch size, accumulation and sampling flags change the data order.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

REFUSED = {
    ("train", "model"): "the checkpoint's weights belong to another model",
    ("lora", "lora_rank"): "the saved LoRA tensors have the old rank",
    ("lora", "lora_alpha"): "the saved LoRA was trained at the old scale",
    ("lora", "lora_target_modules"): "the saved LoRA adapts other modules",
    ("lora", "full_finetune_modules"): "the saved trainable tensors are other modules",
    ("optim", "optimizer"): "the saved optimizer state belongs to the old optimizer",
    ("loss", "loss"): "the run would change its objective halfway",
}
APPLIED = [("optim", name) for name in ("learning_rate", "lr_schedule", "warmup_steps", "min_lr_ratio",
                                        "weight_decay", "betas", "max_grad_norm")]
# a loss's own settings that a resume applies, checked when the run trains that loss
LOSS_APPLIED = {"nft": [("nft", name) for name in ("reward", "reward_judge", "nft_group_size", "nft_rollout_steps",
                                                   "nft_beta", "nft_old_decay", "nft_adv_clip")]}


def cache_identity(cache_dirs) -> list[str]:
    """What identifies the training data: each cache's manifest hash (its path where it has none)."""
    from ..cache.store import MANIFEST_NAME

    out = []
    for d in cache_dirs:
        manifest = Path(d) / MANIFEST_NAME
        out.append(hashlib.sha256(manifest.read_bytes()).hexdigest()[:16] if manifest.is_file() else str(d))
    return out


def frozen_identity(frozen) -> Optional[dict]:
    """What a run trains on top of (``--frozen_lora``): the file's content hash and its scale, or None."""
    return None if frozen is None else {"sha256": frozen.sha256, "scale": frozen.scale}


def _get(config: dict, area: str, name: str) -> Any:
    value = (config.get(area) or {}).get(name)
    return list(value) if isinstance(value, tuple) else value


def check_resume(saved_extra: dict, extra: dict, ckpt) -> list[tuple[str, Any, Any]]:
    """Raise ValueError for every change a resume cannot honour; return the applied ones as
    ``(flag, old, new)``. ``saved_extra``/``extra``: the checkpoint's and this run's ``TrainerState.extra``."""
    saved, new = saved_extra.get("config") or {}, extra.get("config") or {}
    refused = []
    for (area, name), why in REFUSED.items():
        old, now = _get(saved, area, name), _get(new, area, name)
        if area in saved and old != now:
            refused.append(f"--{name} {old} -> {now} ({why})")
    if "cache" in saved_extra and saved_extra["cache"] != extra.get("cache"):
        refused.append(f"--cache_dir: the cache changed ({', '.join(saved_extra['cache'])} -> "
                       f"{', '.join(extra.get('cache') or [])}; the data order and the step's position belong to "
                       "the old one)")
    if "frozen_lora" in saved_extra and saved_extra["frozen_lora"] != extra.get("frozen_lora"):
        old, now = (f"{f['sha256'][:12]}… at scale {f['scale']}" if f else "none"
                    for f in (saved_extra.get("frozen_lora"), extra.get("frozen_lora")))
        refused.append(f"--frozen_lora: {old} -> {now} (the saved LoRA was trained on top of the old one; the "
                       "same file, by content, and scale resume)")
    if refused:
        raise ValueError(f"--resume {ckpt}: {'; '.join(refused)}. Resume with the checkpoint's settings, or start "
                         "a new run in another --output_dir")
    checked = APPLIED + LOSS_APPLIED.get(_get(new, "loss", "loss"), [])
    applied = [(f"--{name}", _get(saved, area, name), _get(new, area, name)) for area, name in checked
               if area in saved and _get(saved, area, name) != _get(new, area, name)]
    for flag, old, now in applied:
        log.info("resuming with %s %s (the checkpoint had %s): applied from this step on", flag, now, old)
    return applied


def apply_schedule(optimizer, scheduler, optim_config, step: int) -> None:
    """Put this run's learning rate, weight decay and betas into the restored optimizer, and the schedule's
    learning rate for ``step`` into every parameter group (the restored scheduler kept the old base rates)."""
    sched = getattr(scheduler, "scheduler", scheduler)  # accelerate wraps it
    for group in optimizer.param_groups:
        group["initial_lr"] = optim_config.learning_rate
        if "weight_decay" in group and optim_config.weight_decay is not None:
            group["weight_decay"] = optim_config.weight_decay
        if "betas" in group and optim_config.betas is not None:
            group["betas"] = tuple(optim_config.betas)
    sched.base_lrs = [optim_config.learning_rate for _ in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * factor(step)
    sched._last_lr = [group["lr"] for group in optimizer.param_groups]


def warn_data_order(saved, state, saved_config: Optional[dict], config: dict) -> None:
    for name in ("seed", "world_size", "batch_size", "gradient_accumulation_steps"):
        if getattr(saved, name) != getattr(state, name):
            log.warning("resuming with %s=%s (checkpoint: %s): the data order will differ from the original run",
                        name, getattr(state, name), getattr(saved, name))
    if (saved_config or {}).get("sampling", config["sampling"]) != config["sampling"]:
        log.warning("resuming with other sampling flags than the checkpoint's (%s): the data order will differ",
                    saved_config["sampling"])
