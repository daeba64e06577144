"""`qie plan`'s time: the predicted step time (or seconds per image) on ``--gpu``, beside the memory plan.

The configuration runs at full width on the fake device at 1 and 2 blocks with its kernels counted, scaled to
the whole DiT, and costed on the GPU's table (``preflight/timing.py``, ``fakegpu/timemodel.py``,
``docs/SPEED.md``). ``--no_time`` skips it.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

log = logging.getLogger(__name__)


def gpu_choice(value):
    """``--gpu``: a GPU's name (a time table's key or alias) or its memory in GiB (a number)."""
    try:
        return float(value)
    except ValueError:
        from ..fakegpu.timemodel import gpu_table

        return gpu_table(value).key


def table_for(gpu):
    """The time table of ``--gpu`` (None: the visible GPU, else the H100; a number of GiB: the known GPU whose
    memory is nearest)."""
    from ..fakegpu.timemodel import gpu_table, tables

    if isinstance(gpu, float):
        return min(tables().values(), key=lambda t: abs(t.memory_gib - gpu))
    return gpu_table(gpu)


def memory_of(gpu, gpu_memory_gb):
    """``--gpu_memory_gb``, else what ``--gpu`` says (its number, or its table's memory)."""
    if gpu_memory_gb is not None or gpu is None:
        return gpu_memory_gb
    return gpu if isinstance(gpu, float) else table_for(gpu).memory_gib


def log_time(args, options, verified=None) -> None:
    """Log the predicted time of the planned training step or edit on ``args.gpu``; ``verified``: the
    ``--verify`` run of the whole DiT (``plan_verify.FakeRun``), whose counted kernels are used as they are."""
    from ..models.presets import family_of, get_preset

    family = family_of(args.model)
    if not family.fullsize_verify or options.zero_stage or get_preset(args.model).is_tiny:
        why = ("a tiny model" if get_preset(args.model).is_tiny else "--zero_stage (one process is counted)"
               if options.zero_stage else f"{family.label} has no full-size fake-device run")
        log.info("time: not predicted for %s", why)
        return
    table = table_for(args.gpu)
    if options.task == "train":
        from ..preflight.timing import predict_train
        from ..preflight.train_step import batch_shapes
        from .plan_verify import train_config

        cfg, preset = train_config(args, options)
        shapes = batch_shapes(options.resolution, options.ref_images, options.prompt_tokens, options.batch_size,
                              mixed=getattr(args, "mixed", False))
        profile = verified.profile if verified is not None else None
        prediction = predict_train(cfg, preset, shapes, table.key, profile=profile)
        log.info("%s", prediction.line(max_steps=args.max_steps))
        return
    from ..preflight.timing import predict_edit

    from ..preflight.edit_step import EditLoad

    steps = args.steps or family.default_steps
    cfg = 4.0 if options.cfg else 1.0
    load = EditLoad(fp8_base=options.fp8_base, blocks_to_swap=options.blocks_to_swap,
                    lora_ranks=tuple(r for r in options.lora_ranks if r))
    if verified is not None and verified.profile is not None:
        from ..preflight.timing import TimePrediction, edit_estimate

        prediction = TimePrediction(edit_estimate(verified.profile, table, steps, verified.steps_run), table,
                                    what=f"edit ({steps} steps, CFG {cfg:g}), per image")
    else:
        prediction = predict_edit(get_preset(args.model), steps, cfg, table.key, resolution=options.resolution,
                                  ref_images=max(1, options.ref_images), prompt_tokens=options.prompt_tokens,
                                  kv_cache=options.kv_cache == "on", load=load)
    log.info("%s", prediction.line())


def fastest_fit(args, census, base) -> Optional[object]:
    """Every option set that fits ``--gpu`` (each kernel-distinct one with its fewest swapped blocks), with its
    predicted step time on ``--gpu``'s table, fastest first, logged as a table; returns the fastest's plan (None:
    nothing fits). The kernels differ only with checkpointing and the FP8 base: one counted pass each."""
    from ..memory.plan import GiB, candidates, describe, predict
    from ..preflight.timing import predict_train
    from ..preflight.train_step import batch_shapes
    from .plan_verify import train_config

    budget, table = args.gpu_memory_gb * GiB, table_for(args.gpu)
    fits = {}
    for opts in candidates(census, base):
        plan = predict(census, opts)
        key = (opts.gradient_checkpointing, opts.fp8_base, opts.zero_stage)
        if plan.gpu_peak <= budget and key not in fits:  # candidates come with the fewest swapped blocks first
            fits[key] = plan
    shapes = batch_shapes(base.resolution, base.ref_images, base.prompt_tokens, base.batch_size)
    rows = []
    for plan in fits.values():
        # swapped blocks' copies run beside the compute on a GPU (docs/SPEED.md): counted without them
        cfg, preset = train_config(args, dataclasses.replace(plan.options, blocks_to_swap=0))
        compute = predict_train(cfg, preset, shapes, table.key).seconds
        o = plan.options  # each swapped block crosses the host link once per forward (and recompute) and backward
        copies = o.blocks_to_swap * census.block_params * (1 if o.fp8_base else 2) * (3 if o.gradient_checkpointing
                                                                                         else 2)
        rows.append((max(compute, copies / (table.h2d_gbps * 1e9)), plan))
    rows.sort(key=lambda r: r[0])
    if not rows:
        return None
    lines = [f"  {s:6.3f} s/step  {base.batch_size / s:5.2f} samples/s  {p.gpu_peak / GiB:6.1f} GiB  "
             f"{describe(p.options)}" for s, p in rows]
    log.info("options that fit %.1f GiB, fastest first on %s (the time model, docs/SPEED.md):\n%s\nfastest: %s",
             args.gpu_memory_gb, table.name, "\n".join(lines), describe(rows[0][1].options))
    return rows[0][1]
