"""`qie plan --verify`: the configuration run on a fake CUDA device, beside the plan's prediction."""
from __future__ import annotations

import dataclasses
import logging

log = logging.getLogger(__name__)
GiB = 1024 ** 3


def train_config(args, options):
    """The resolved :class:`RunConfig` a ``qie train`` with the plan's options would run."""
    from ..models.presets import get_preset
    from ..training.config import RunConfig

    preset = get_preset(args.model)
    cfg = RunConfig()
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, model=args.model, cache_dir="-", output_dir="-",
                                  batch_size=options.batch_size, gradient_checkpointing=options.gradient_checkpointing,
                                  fp8_base=options.fp8_base, blocks_to_swap=options.blocks_to_swap),
        lora=dataclasses.replace(cfg.lora, lora_rank=options.lora_rank),
        optim=dataclasses.replace(cfg.optim, optimizer=options.optimizer),
        loss=dataclasses.replace(cfg.loss, loss=args.loss))
    return cfg.resolved(preset), preset


def verify_and_compare(args, options, plan) -> None:
    """Run ``options`` on the fake device and log its phases beside ``plan`` (a ``memory.plan.Plan``)."""
    if options.zero_stage:
        raise ValueError("--verify runs one process without DeepSpeed; drop --zero_stage (ZeRO-2/3 divide what it "
                         "counts by --num_gpus as the plan shows)")
    predicted = plan.gpu_peak - options.overhead_bytes  # the fake device has no CUDA context
    if options.task == "train":
        from ..training.verify import batch_shapes, verify_train_step

        cfg, preset = train_config(args, options)
        shapes = batch_shapes(options.resolution, options.ref_images, options.prompt_tokens, options.batch_size,
                              mixed=args.mixed)
        r = verify_train_step(cfg, preset, shapes, num_layers=args.verify_blocks)
        rows = [("weights (DiT + LoRA, after setup)", r.weights), ("forward + backward peak", r.forward_backward_peak),
                ("optimizer state", r.optimizer_state), ("optimizer step peak", r.optimizer_peak),
                ("steady-state peak", r.peak)]
        what = f"one training step ({args.loss}, loss {r.loss_dtype})"
    else:
        from ..inference.verify import verify_edit
        from ..models.presets import get_preset

        r = verify_edit(get_preset(args.model), resolution=options.resolution, ref_images=max(1, options.ref_images),
                        prompt_tokens=options.prompt_tokens, steps=args.edit_steps, cfg=1.0 if not options.cfg else 4.0,
                        lora_rank=options.lora_rank, fp8_base=options.fp8_base, blocks_to_swap=options.blocks_to_swap,
                        num_layers=args.verify_blocks)
        rows = [("weights (text encoder + DiT + VAE + LoRA)", r.weights), ("encode peak", r.encode_peak),
                ("denoise peak", r.denoise_peak), ("decode peak", r.decode_peak), ("peak", r.peak)]
        what = f"one edit ({args.edit_steps} steps)"
    table = "\n".join(f"  {name:<48} {b / GiB:8.2f} GiB" for name, b in rows)
    blocks = f"{args.verify_blocks} blocks" if args.verify_blocks else "all blocks"
    versus = ("the plan counts every block" if args.verify_blocks
              else f"{100 * (predicted / r.peak - 1):+.1f} % vs the fake-device peak")
    log.info("fake CUDA device, %s, %s, in %.1f s:\n%s\n  %-48s %8.2f GiB (%s)", what, blocks, r.seconds, table,
             "plan's prediction without the CUDA context", predicted / GiB, versus)
