"""``qie train``'s flags checked together, and the defaults that depend on other choices filled in.

:func:`validate` refuses a bad value or combination (``ValueError`` naming the flag and the fix), the loss's own
checks included (``LossSpec.check``); :func:`resolve` (``RunConfig.resolved``) then fills what the preset and the
loss decide: the LoRA targets, ``zero_cond_t``, alpha, the optimizer and its defaults. The dataclasses themselves
(the flags and their help) are in ``config.py``; this module works on them by attribute and imports no torch.
"""
from __future__ import annotations

import dataclasses
import math

from .losses.registry import loss_names, loss_spec


def resolve(cfg, preset=None):
    """``cfg`` (a ``RunConfig``) checked, with the defaults that depend on other choices filled in.

    ``preset`` (``models.presets.Preset``) supplies the LoRA targets and
    ``zero_cond_t`` when they are not set explicitly.
    """
    validate(cfg)
    train, lora = cfg.train, cfg.lora
    train = dataclasses.replace(train, cache_dir=cache_dirs(train.cache_dir),
                                fp8_base=train.fp8_base or train.fp8_compute)  # FP8 compute multiplies FP8 weights
    sampling = dataclasses.replace(cfg.sampling, batch_size=train.batch_size, seed=train.seed)
    sampling.validate()
    if preset is not None:
        from ..models.family_ops import ops_for

        ops, spec = ops_for(preset.family), loss_spec(cfg.loss.loss)
        if spec.bridge and not ops.supports_lbm:
            flows = ", ".join(n for n in loss_names() if not loss_spec(n).bridge)
            raise ValueError(f"--loss {spec.name} is a bridge (LBM) loss; --model {preset.name} is "
                             f"{preset.family}, which has no bridge path: train it with --loss {flows}")
        if train.zero_cond_t and not ops.supports_zero_cond_t:
            raise ValueError(f"--zero_cond_t is a Qwen-Image-Edit-2511 flag; --model {preset.name} conditions its "
                             "references at t=0 by design: drop the flag")
        if train.zero_cond_t is None:
            train = dataclasses.replace(train, zero_cond_t=preset.zero_cond_t)
        if lora.lora_target_modules is None:
            from ..lora.export_targets import serving_targets

            targets = serving_targets(preset.family) if lora.lora_targets == "serving" else preset.lora_target_modules
            lora = dataclasses.replace(lora, lora_target_modules=list(targets))
        elif lora.lora_targets is not None:
            raise ValueError(f"--lora_targets {lora.lora_targets} and --lora_target_modules both name the "
                             "targets; give one of them")
    if lora.export:
        from ..lora.export_targets import export_names

        export_names(lora.export)  # an unknown format fails before training, not after
    if lora.lora_alpha is None:
        lora = dataclasses.replace(lora, lora_alpha=float(lora.lora_rank))
    optim = cfg.optim
    if loss_spec(cfg.loss.loss).resolve is not None:  # what the loss decides for the other areas (dmd: the teacher)
        lora = loss_spec(cfg.loss.loss).resolve(dataclasses.replace(cfg, lora=lora)).lora
    if optim.optimizer is None:  # the loss's own default (LBM: ProdigyPlusScheduleFree)
        optim = dataclasses.replace(optim, optimizer=loss_spec(cfg.loss.loss).default_optimizer)
    return dataclasses.replace(cfg, train=train, lora=lora, optim=optim.resolved(), sampling=sampling)


def cache_dirs(value: "str | list[str] | tuple[str, ...] | None") -> list[str]:
    """``--cache_dir`` as a list (a plain string, as Python callers pass it, is one directory)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def validate(cfg) -> None:
    """Raise ``ValueError`` naming the bad flag and the fix (``cfg``: a ``RunConfig``)."""
    t, lo, o, ts, ls = cfg.train, cfg.lora, cfg.optim, cfg.timesteps, cfg.loss
    if cfg.onthefly.on_the_fly:
        if cache_dirs(t.cache_dir):
            raise ValueError("--on_the_fly reads --dataset_metadata directly; drop --cache_dir (or drop --on_the_fly "
                             "to train from the cache)")
        if not cfg.dataset.dataset_metadata:
            raise ValueError("--on_the_fly needs --dataset_metadata FILE (the same formats `qie cache` reads)")
    elif not cache_dirs(t.cache_dir):
        raise ValueError("no cache given; pass --cache_dir DIR (made by `qie cache`), or --on_the_fly "
                         "--dataset_metadata FILE to encode during training")
    if not t.output_dir:
        raise ValueError("no output directory given; pass --output_dir DIR")
    if t.validate_with != "raw" and not t.ema_decay:
        raise ValueError(f"--validate_with {t.validate_with} renders with the EMA of the weights; pass --ema_decay D "
                         "(e.g. 0.999) too, or --validate_with raw")
    positive = {"batch_size": t.batch_size, "gradient_accumulation_steps": t.gradient_accumulation_steps,
                "log_every": t.log_every, "validation_steps": t.validation_steps}
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    non_negative = {"max_steps": t.max_steps, "num_epochs": t.num_epochs, "save_every": t.save_every,
                    "keep_last": t.keep_last, "validate_every": t.validate_every, "num_validation": t.num_validation,
                    "num_workers": t.num_workers, "blocks_to_swap": t.blocks_to_swap, "warmup_steps": o.warmup_steps, "lora_rank": lo.lora_rank}
    for name, value in non_negative.items():
        if value < 0:
            raise ValueError(f"--{name} must be >= 0, got {value}")
    if t.max_steps == 0 and t.num_epochs == 0:
        raise ValueError("nothing to train: set --max_steps N or --num_epochs N")
    if not 0.0 <= t.cfg_dropout <= 1.0:
        raise ValueError(f"--cfg_dropout is a probability in [0, 1], got {t.cfg_dropout}")
    if lo.lora_rank == 0 and not lo.full_finetune_modules:
        raise ValueError("--lora_rank 0 trains nothing; give a rank > 0 or --full_finetune_modules")
    if lo.lora_rank == 0 and lo.lora_checkpoint:
        raise ValueError("--lora_checkpoint needs a LoRA to load into; set --lora_rank to the file's rank")
    if lo.lora_alpha is not None and lo.lora_alpha <= 0:
        raise ValueError(f"--lora_alpha must be > 0, got {lo.lora_alpha}")
    if o.learning_rate is not None and not o.learning_rate > 0:
        raise ValueError(f"--learning_rate must be > 0, got {o.learning_rate}")
    if o.max_grad_norm is not None and o.max_grad_norm < 0:
        raise ValueError(f"--max_grad_norm must be >= 0 (0 = off), got {o.max_grad_norm}")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ValueError(f"--min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    if o.betas is not None and (len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas)):
        raise ValueError(f"--betas takes two values in [0, 1), got {list(o.betas)}")
    if not 0.0 <= ts.min_timestep_boundary < ts.max_timestep_boundary <= 1.0:
        raise ValueError("need 0 <= --min_timestep_boundary < --max_timestep_boundary <= 1, got "
                         f"{ts.min_timestep_boundary} and {ts.max_timestep_boundary}")
    spec = loss_spec(ls.loss)  # ValueError naming the choices
    if ts.timestep_sampling == "stratified" and not spec.stratified_sigma:
        allowed = ", ".join(n for n in loss_names() if loss_spec(n).stratified_sigma)
        raise ValueError(f"--timestep_sampling stratified applies to --loss {allowed}; --loss {spec.name} "
                         f"{spec.sigma_note or 'draws its own σs'}")
    if spec.check is not None:  # the loss's own checks (--loss nft: its --reward resolves)
        spec.check(cfg)
    if ts.logit_std <= 0 or not math.isfinite(ts.logit_mean):
        raise ValueError(f"--logit_std must be > 0 (got {ts.logit_std}) and --logit_mean finite")
    if ls.mask_loss_weights is not None:
        if len(w := tuple(ls.mask_loss_weights)) != 2 or min(w) < 0 or max(w) == 0:
            raise ValueError(f"--mask_loss_weights takes INSIDE OUTSIDE, two non-negative numbers not both 0; got {list(w)}")
