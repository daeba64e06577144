"""`qie plan`: predicted peak GPU memory and host RAM, and the cheapest options that fit a GPU.

Counts come from the real model classes built on the ``meta`` device (or a ``--model_dir``
checkpoint's safetensors headers); activations from constants fitted on full-size steps on a fake CUDA
device (``benchmarks/fit_plan.py``). ``--verify`` runs the configuration itself there — our training step
or ``Editor.edit`` on the real full-size model, no memory, no arithmetic — prints its peak of live device
bytes per phase beside the prediction, and fails (exit 2, one line) when the peak exceeds the GPU or the plan
is more than 10 % off (``commands/plan_verify.py``, ``fakegpu/verdict.py``, ``docs/MEMORY.md``).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging

from ..models.preset_flags import preset_help, preset_type
from ..training.block_setup import checkpoint_blocks_type
from ..training.losses.registry import loss_names, loss_spec
from ..utils.cli_checks import checked
from .plan_time import gpu_choice

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="2511", type=preset_type(), metavar="PRESET", help=preset_help())
    parser.add_argument("--model_dir", default=None,
                        help="count parameters from this checkpoint's DiT safetensors headers instead")
    parser.add_argument("--task", default="train", choices=("train", "edit"), help="a training step or an edit")
    parser.add_argument("--resolution", type=checked(int, 16, 1 << 16), default=1024, help="side of a square image (multiple of 16)")
    parser.add_argument("--ref_images", type=checked(int, 0, 64), default=1, help="reference images per sample")
    parser.add_argument("--prompt_tokens", type=checked(int, 1, 1 << 20), default=300, help="prompt tokens per sample")
    parser.add_argument("--batch_size", type=checked(int, 1, 1 << 16), default=1)
    parser.add_argument("--lora_rank", type=checked(int, 0, 1 << 16), default=32)
    parser.add_argument("--optimizer", default=None, choices=("adamw", "prodigy_sf"),
                        help="default: the --loss's own, as in qie train (adamw for sft, prodigy_sf for lbm)")
    parser.add_argument("--loss", default="sft", choices=loss_names(),
                        help="train: the training loss (it picks the default --optimizer; --verify runs its step)")
    parser.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="recompute DiT blocks in backward (on by default, as in qie train)")
    parser.add_argument("--checkpoint_policy", default="full", choices=("full", "selective"),
                        help="train: qie train --checkpoint_policy (selective keeps the GEMM and attention outputs: "
                             "more memory, less recompute)")
    parser.add_argument("--checkpoint_blocks", type=checkpoint_blocks_type, default=None, metavar="N|auto",
                        help="train: qie train --checkpoint_blocks (the first N blocks recompute, the others keep "
                             "everything; auto: the fewest that fit --gpu_memory_gb / --gpu); default: all")
    parser.add_argument("--compile", action="store_true",
                        help="train: qie train --compile (the time model fuses the blocks' elementwise kernels; "
                             "--verify compiles them with the eager backend)")
    parser.add_argument("--fp8_base", action="store_true", help="frozen DiT linears in FP8 (e4m3 + scales)")
    parser.add_argument("--fp8_compute", action="store_true",
                        help="those linears multiplied in FP8 (qie train / qie edit --fp8_compute; implies --fp8_base); "
                             "refused for a --gpu without FP8 tensor cores (A100)")
    parser.add_argument("--blocks_to_swap", type=checked(int, 0, 1 << 10), default=0, help="DiT blocks kept in host RAM")
    parser.add_argument("--zero_stage", type=int, default=0, choices=(0, 2, 3))
    parser.add_argument("--num_gpus", type=checked(int, 1, 1 << 16), default=1)
    parser.add_argument("--no_cfg", action="store_true", help="edit: --cfg 1 (no negative pass)")
    parser.add_argument("--on_the_fly", action="store_true",
                        help="train: the text encoder and VAE run beside the DiT (qie train --on_the_fly)")
    parser.add_argument("--nft_group_size", type=checked(int, 2, 256), default=4,
                        help="train, --loss nft: rollouts per source (qie train --nft_group_size)")
    parser.add_argument("--compute_precision", default="auto", choices=("auto", "pure", "autocast"),
                        help="train: qie train --compute_precision (auto = pure bf16 over fp32 LoRA weights; "
                             "autocast = bf16 autocast); --verify runs it")
    parser.add_argument("--ema_decay", type=checked(float, 0.0, 1.0), default=0.0,
                        help="train: keep an fp32 EMA of the LoRA (qie train --ema_decay; 0 = none)")
    parser.add_argument("--validate_with", default="raw", choices=("raw", "ema", "both"),
                        help="train: ema/both copy the live LoRA while the average is swapped in for validation")
    parser.add_argument("--loras", type=checked(int, 1, 1 << 16), nargs="+", default=None, metavar="RANK",
                        help="edit: the ranks of stacked LoRAs attached unmerged (default: one of --lora_rank)")
    parser.add_argument("--kv_cache", default="on", choices=("on", "off"),
                        help="edit, Qwen-Image-2.1: its prefix KV cache on the GPU, or off (each step recomputes "
                             "the prefix; --gpu_memory_gb turns it off when nothing else fits)")
    from .edit import add_cache_arguments

    add_cache_arguments(parser.add_argument_group("edit: the step cache (--verify runs it: it reuses wherever allowed)"))
    for name in ("text_encoder", "vae"):
        parser.add_argument(f"--{name}_device", default="gpu", choices=("gpu", "cpu"),
                            help=f"edit / --on_the_fly: where the {name.replace('_', ' ')} runs (cpu: host RAM, fp32)")
    parser.add_argument("--gpu_memory_gb", type=checked(float, 0.5, 1 << 20), default=None,
                        help="also print the cheapest options (least slowdown) predicted to fit this many GiB")
    parser.add_argument("--launch_flags", action="store_true",
                        help="print the chosen training options as `qie train` flags on the last line of stdout (the "
                             "launchers read it on a GPU: scripts/launch_lib.sh); with --gpu the fastest that keeps "
                             "the bf16 base, where one fits")
    parser.add_argument("--distribution", action="store_true",
                        help="print the DeepSpeed config the launchers use for --num_gpus processes on GPUs of "
                             "--gpu_memory_gb (zero2.yaml when the unsharded run fits, else zero3.yaml)")
    t = parser.add_argument_group("time on a GPU, predicted from the fake device's kernel counts (docs/SPEED.md)")
    t.add_argument("--gpu", type=gpu_choice, default=None, metavar="NAME|GiB",
                   help="the GPU to predict time (and fit) for: h200, h100, a100, l40s, rtx4090, rtx5090, or its "
                        "memory in GiB (default: the visible GPU, else h100); also sets --gpu_memory_gb")
    t.add_argument("--no_time", action="store_true", help="skip the time prediction (it runs the step on the fake "
                                                          "device at 1 and 2 blocks: seconds of CPU)")
    t.add_argument("--max_steps", type=checked(int, 0, 1 << 30), default=1000,
                   help="train: optimizer steps to give the run's predicted duration for")
    t.add_argument("--steps", type=checked(int, 0, 10000), default=0,
                   help="edit: denoising steps to predict seconds per image at (0: the family's default)")
    v = parser.add_argument_group("verify on a fake CUDA device (no GPU needed)")
    v.add_argument("--verify", action="store_true",
                   help="run the configuration with the real full-size model on a fake CUDA device (a training "
                        "step, or an edit with --task edit) and print its peak device memory beside the "
                        "prediction; fails (one line) naming the operator and line on a device/dtype mismatch or "
                        "host sync, or naming the largest holders when the peak exceeds the GPU "
                        "(--gpu_memory_gb, default: the visible GPU) or the plan is more than 10%% off")
    v.add_argument("--mixed", action="store_true",
                   help="--verify: every other sample of the batch is 4:3 with a prompt 30%% shorter")
    v.add_argument("--verify_blocks", type=checked(int, 1, 1 << 10), default=None, metavar="N",
                   help="--verify: build only N DiT blocks (default: all; the peak then covers N blocks)")
    v.add_argument("--edit_steps", type=checked(int, 1, 10000), default=2, help="--verify --task edit: denoising steps to run")


def run(args) -> int:
    from ..memory.plan import describe, format_plan, predict, recommend
    from ..models.presets import family_of, get_preset
    from .plan_time import memory_of

    family = family_of(args.model)
    args.gpu_memory_gb = memory_of(getattr(args, "gpu", None), args.gpu_memory_gb)
    if args.launch_flags and (args.task != "train" or args.gpu_memory_gb is None):
        raise ValueError("--launch_flags prints the training options that fit a GPU: use it with --task train (the "
                         "default) and --gpu NAME|GiB or --gpu_memory_gb")
    if getattr(args, "mixed", False) and not args.verify:
        raise ValueError("--mixed shapes the batch of the --verify run; add --verify, or drop --mixed")
    from ..models.samplers.step_cache import cache_settings

    if cache_settings(args.cache, args.cache_method, args.cache_threshold) is not None and args.task != "edit":
        raise ValueError(f"--cache {args.cache} is an edit's step cache; add --task edit, or drop --cache")
    if args.fp8_compute and isinstance(getattr(args, "gpu", None), str):
        from .plan_time import check_fp8_table

        check_fp8_table(args.gpu)
    census = _census(args)
    if not family.fullsize_verify:
        log.warning("%s: weights, LoRA and optimizer state are counted exactly; activations use the constants "
                    "fitted on Qwen-Image-Edit's blocks, an estimate for this family", family.label)
    base = auto_blocks(census, options_of(args), args)
    log.info("DiT: %.3f B parameters, %d blocks of %.3f B, width %d; LoRA rank %d: %.1f M parameters",
             census.params / 1e9, census.num_layers, census.block_params / 1e9, census.dim,
             base.lora_rank, census.lora_params(base.lora_rank) / 1e6)
    if args.distribution:
        return _distribution(census, base, args.gpu_memory_gb)
    plan = predict(census, base)
    log.info("%s (%d tokens per sample):\n%s", describe(base), base.tokens, format_plan(plan))
    verified = None
    if args.verify:
        from .plan_verify import verify_and_compare

        verified = verify_and_compare(args, base, plan)
    if not args.no_time:
        from .plan_time import log_time

        log_time(args, base, verified)
    if args.gpu_memory_gb is None:
        return 0
    if args.gpu is not None and base.task == "train" and not args.no_time and family.fullsize_verify \
            and not base.zero_stage and not get_preset(args.model).is_tiny:
        from .plan_time import fastest_fit

        fit = fastest_fit(args, census, base, bf16_base=args.launch_flags)
    else:
        fit = recommend(census, base, args.gpu_memory_gb)
    if fit is None:
        log.error("nothing fits %.1f GiB even with every option; lower --resolution or --batch_size, "
                  "or use more GPUs with --zero_stage 3", args.gpu_memory_gb)
        return 1
    log.info("%s options that fit %.1f GiB: %s\n%s", "cheapest" if args.gpu is None else "chosen",
             args.gpu_memory_gb, describe(fit.options), format_plan(fit))
    if args.launch_flags:
        import sys

        sys.stdout.write(" ".join(train_flags(fit.options)) + "\n")  # read by scripts/launch_lib.sh
    return 0


def train_flags(o) -> list[str]:
    """The options ``qie plan`` chooses for a training run (checkpointing, compile, FP8 base, swapped blocks) as
    ``qie train`` flags: ``--launch_flags``."""
    if not o.gradient_checkpointing:
        flags = ["--no-gradient_checkpointing"]
    else:
        flags = ["--gradient_checkpointing", "--checkpoint_policy", o.checkpoint_policy]
        flags += ["--checkpoint_blocks", str(o.checkpoint_blocks)] if o.checkpoint_blocks is not None else []
    flags += ["--compile"] if o.compile else []
    flags += ["--fp8_base"] if o.fp8_base else []
    flags += ["--blocks_to_swap", str(o.blocks_to_swap)] if o.blocks_to_swap else []
    return flags


def options_of(args):
    """The :class:`~..memory.plan.PlanOptions` of parsed ``qie plan`` arguments."""
    from ..memory.plan import PlanOptions

    return PlanOptions(task=args.task, resolution=args.resolution, ref_images=args.ref_images,
                       prompt_tokens=args.prompt_tokens, batch_size=args.batch_size, lora_rank=args.lora_rank,
                       optimizer=args.optimizer or loss_spec(args.loss).default_optimizer, gradient_checkpointing=args.gradient_checkpointing,
                       checkpoint_policy=args.checkpoint_policy, compile=args.compile,
                       checkpoint_blocks=None if args.checkpoint_blocks in (None, "auto") else args.checkpoint_blocks,
                       fp8_base=args.fp8_base or args.fp8_compute, fp8_compute=args.fp8_compute,
                       blocks_to_swap=args.blocks_to_swap, zero_stage=args.zero_stage,
                       num_gpus=args.num_gpus, cfg=not args.no_cfg, on_the_fly=args.on_the_fly,
                       text_encoder_on_gpu=args.text_encoder_device == "gpu", vae_on_gpu=args.vae_device == "gpu",
                       ema=args.ema_decay > 0, validate_with=args.validate_with, loras=tuple(args.loras or ()),
                       compute_precision=args.compute_precision,
                       kv_cache=args.kv_cache, pairs=args.task == "train" and loss_spec(args.loss).preference,
                       rollouts=args.nft_group_size if args.task == "train" and loss_spec(args.loss).needs_rollouts else 0,
                       distill=args.task == "train" and loss_spec(args.loss).distills)


def auto_blocks(census, base, args):
    """``--checkpoint_blocks auto``: ``base`` with the fewest checkpointed blocks that fit ``--gpu_memory_gb``
    (as ``qie train`` chooses them; every block without a budget or when none fits)."""
    from ..memory.plan import GiB
    from ..training.checkpoint_auto import fewest_fitting

    if args.checkpoint_blocks != "auto" or base.task != "train":
        return base
    if not base.gradient_checkpointing:
        raise ValueError("--checkpoint_blocks auto counts checkpointed blocks; drop --no-gradient_checkpointing")
    if args.gpu_memory_gb is None:
        log.info("--checkpoint_blocks auto: no --gpu_memory_gb / --gpu: every block checkpoints")
        return base
    n, plan = fewest_fitting(census, base, args.gpu_memory_gb * GiB)
    log.info("--checkpoint_blocks auto: %s of %d blocks checkpointed, planned peak %.1f GiB of %.1f GiB",
             "none fits; all" if n is None else n, census.num_layers, plan.gpu_peak / GiB, args.gpu_memory_gb)
    return dataclasses.replace(base, checkpoint_blocks=n)


def _census(args):
    from ..memory.census import census_from_files, dit_files, preset_census
    from ..models.presets import family_of, get_preset

    encoders = args.task == "edit" or args.on_the_fly or (args.task == "train" and loss_spec(args.loss).needs_rollouts)
    if args.model_dir is None:
        return preset_census(args.model, with_encoders=encoders)
    preset = get_preset(args.model)
    files = dit_files(args.model_dir, preset.dit.pattern)
    if not files:
        raise ValueError(f"--model_dir {args.model_dir} has no {preset.dit.pattern}; "
                         f"pass the model repository's folder (it contains transformer/)")
    census = census_from_files(files, preset.lora_target_modules, family_of(preset).streams)
    expected = preset_census(args.model, with_encoders=False)
    if (census.dim, census.num_layers) != (expected.dim, expected.num_layers):
        log.warning("--model_dir %s holds a DiT of width %d with %d blocks, but %s has width %d with %d blocks: "
                    "the plan below is for the files, not for %s; check --model", args.model_dir, census.dim,
                    census.num_layers, args.model, expected.dim, expected.num_layers, args.model)
    # the prefix cache is the DiT class's; encoders' sizes are the preset's own (identical in every repo)
    census = dataclasses.replace(census, prefix_kv_width=expected.prefix_kv_width)
    if encoders:
        enc = preset_census(args.model, with_encoders=True)
        census = dataclasses.replace(census, text_encoder_params=enc.text_encoder_params, vae_params=enc.vae_params)
    return census


def _distribution(census, base, gpu_memory_gb) -> int:
    import sys

    from ..memory.plan import choose_distribution

    if gpu_memory_gb is None or not gpu_memory_gb > 0:
        raise ValueError("--distribution needs --gpu_memory_gb (the memory of one GPU, in GiB)")
    stage, reason = choose_distribution(census, base, gpu_memory_gb)
    log.warning("multi-GPU default for %d processes: %s", base.num_gpus, reason)
    sys.stdout.write(f"zero{stage}.yaml\n")  # read by scripts/launch_lib.sh
    return 0
