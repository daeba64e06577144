"""`qie train`: phase 2 of split training — a LoRA on the DiT alone, from the `qie cache` output.

Works as a single process (``qie train ...``) and under ``accelerate launch`` (DDP or
DeepSpeed ZeRO-2/3, configs in ``deepspeed_configs/``)::

    accelerate launch --config_file deepspeed_configs/zero2.yaml -m diffsynth_qie.cli train \\
        --cache_dir cache --output_dir out --model 2511 --batch_size 2 --gradient_accumulation_steps 8

Every flag comes from the dataclasses in ``diffsynth_qie/training/config.py`` (the
batching/sampling group from ``diffsynth_qie/data/sampling.py``); each registered loss with knobs
adds its own config's group (``training/losses/registry.py``). Several datasets:
cache each metadata file into its own directory and pass them all::

    qie train --cache_dir caches/a caches/b --dataset_weights "a=0.5,b=1.2" --batch_size 4 ...
"""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)
# no output may be an input (cli.py): --output_dir is not the cache or the model, and none of its files is an input
INPUTS = ("cache_dir", "dataset_metadata", "model_dir", "lora_checkpoint", "frozen_lora")
WRITES = {"output_dir": ("lora.safetensors", "lora_ema.safetensors", "loss.jsonl", "skipped.jsonl")}

# (dataclass name in training.config, RunConfig attribute, flag-group title); the losses' groups follow "loss"
GROUPS = (
    ("TrainConfig", "train", "run"),
    ("LoRAConfig", "lora", "LoRA"),
    ("OptimConfig", "optim", "optimizer and learning rate"),
    ("TimestepConfig", "timesteps", "timestep sampling"),
    ("LossConfig", "loss", "loss"),
    ("JudgeConfig", "judge", "judges (--val_judge, --reward_judge): how they are asked"),
    ("SamplingConfig", "sampling", "batching and sampling (buckets, token budget, weighted datasets)"),
    ("OnTheFlyConfig", "onthefly", "training without a cache (--on_the_fly)"),
    ("DatasetConfig", "dataset", "--on_the_fly: the dataset (as `qie cache`)"),
    ("FieldNames", "fields", "--on_the_fly: metadata field names (as `qie cache`)"),
)


def groups() -> list[tuple[type, str, str]]:
    """(config dataclass, RunConfig attribute, flag-group title): :data:`GROUPS`, with each registered loss
    that has knobs after "loss" (its own config, held by ``RunConfig.<name>``; torch-free)."""
    from ..data import formats
    from ..training import config as tc
    from ..training.losses.registry import LOSSES

    out = []
    for cls_name, attr, title in GROUPS:
        out.append((getattr(tc, cls_name, None) or getattr(formats, cls_name), attr, title))
        if attr == "loss":
            out += [(s.config, s.name, f"--loss {s.name}: {s.summary}") for s in LOSSES.values() if s.has_flags]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..utils.config_cli import add_dataclass_args

    for cls, _, title in groups():
        add_dataclass_args(parser, cls, title=title)


def config_from_args(args: argparse.Namespace):
    """The :class:`RunConfig` the flags describe."""
    from ..training import config as tc
    from ..utils.config_cli import dataclass_from_args

    parts = {attr: dataclass_from_args(cls, args) for cls, attr, _ in groups()}
    return tc.RunConfig(**parts)


def preflight(cfg, preset):
    """The fake-device preflight of a real preset (imported only when a run reaches it); its predicted step time
    goes beside the run's log (``predicted_step.json``), where ``qie report`` shows it next to the measured one."""
    from ..preflight.train import preflight as train_preflight
    from ..training.report import write_prediction

    report = train_preflight(cfg, preset)
    write_prediction(cfg.train.output_dir, report.prediction)
    return report


def run(args: argparse.Namespace) -> int:
    from ..metrics.judge import JudgeDown
    from ..metrics.rewards import RewardFailed
    from ..training.loop import Hooks, train

    try:
        result = train(config_from_args(args), Hooks(before_load=preflight))
    except (RewardFailed, JudgeDown) as e:  # a reward or a judge that stopped the run: one line, and what is safe
        raise type(e)(f"{e}. {interrupted(args)}") from None
    log.info("LoRA written to %s (%d steps, %.2f steps/s); load it with `qie edit --lora %s`",
             result.lora_path, result.steps, result.steps_per_second, result.lora_path)
    return 0


def interrupted(args: argparse.Namespace) -> str:
    """What Ctrl-C left: the newest complete checkpoint and how to go on from it."""
    from ..training.checkpoint import list_checkpoints

    found = list_checkpoints(args.output_dir) if getattr(args, "output_dir", None) else []
    if not found:
        return f"no checkpoint in {args.output_dir} was complete yet; run the command again to start over"
    return f"{found[-1]} is complete; resume with --resume latest (same --output_dir)"
