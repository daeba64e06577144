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


def check_fp8_table(gpu: str) -> None:
    """``--fp8_compute`` for a ``--gpu`` whose table has no FP8 GEMM rate (no FP8 tensor cores): refused."""
    from ..memory.fp8_compute import fp8_refusal

    table = table_for(gpu)
    if not table.has_fp8:
        raise fp8_refusal(table.name, f"--gpu {gpu}")


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
        profile = train_profile(args, options, shapes, verified.profile if verified is not None else None)
        prediction = predict_train(cfg, preset, shapes, table.key, profile=profile)
        log.info("%s", prediction.line(max_steps=args.max_steps))
        return
    from ..preflight.timing import predict_edit

    from ..preflight.edit_step import EditLoad

    steps = args.steps or family.default_steps
    cfg = 4.0 if options.cfg else 1.0
    load = EditLoad(fp8_base=options.fp8_base, fp8_compute=options.fp8_compute,
                    blocks_to_swap=options.blocks_to_swap,
                    lora_ranks=tuple(r for r in options.lora_ranks if r))
    if verified is not None and verified.profile is not None:
        from ..preflight.timing import TimePrediction, edit_estimate

        prediction = TimePrediction(edit_estimate(verified.profile, table, steps, verified.steps_run), table,
                                    what=f"edit ({steps} steps, CFG {cfg:g}), per image")
    else:
        prediction = predict_edit(get_preset(args.model), steps, cfg, table.key, resolution=options.resolution,
                                  ref_images=max(1, options.ref_images), prompt_tokens=options.prompt_tokens,
                                  kv_cache=options.kv_cache == "on", load=load,
                                  deep=verified.deep_costs if verified is not None else None)
    log.info("%s", prediction.line())


def train_profile(args, options, shapes, counted=None):
    """The whole DiT's counted kernels of ``options``' training step (``counted``: a ``--verify`` run's), made once
    per ``qie plan`` for each kernel-distinct option set (``args`` keeps them)."""
    from ..preflight.timing import full_depth, interpolated_profile, step_profile, timing_runs
    from .plan_verify import train_config

    n = options.checkpoint_blocks
    if options.gradient_checkpointing and n is not None:  # N of L: between every block plain and every one not
        blocks = full_depth(train_config(args, options)[1])
        if n < blocks:
            every = dataclasses.replace(options, checkpoint_blocks=None)
            plain = dataclasses.replace(every, gradient_checkpointing=False)
            return interpolated_profile(train_profile(args, plain, shapes), train_profile(args, every, shapes),
                                        blocks, n)
        options = dataclasses.replace(options, checkpoint_blocks=None)
    known = vars(args).setdefault("counted_profiles", {})
    key = (dataclasses.replace(options, blocks_to_swap=0), tuple(map(repr, shapes)))
    if counted is not None:
        known[key] = counted
    if key not in known:
        cfg, preset = train_config(args, key[0])
        known[key] = step_profile(timing_runs(cfg, preset, shapes), full_depth(preset))
    return known[key]


def speed_variants(opts) -> list:
    """``opts`` and, unless it already compiles, the same with ``--compile`` and (with checkpointing and no swapped
    blocks, which ``--checkpoint_policy selective`` refuses) ``--compile --checkpoint_policy selective``."""
    if opts.compile:
        return [opts]
    out = [opts, dataclasses.replace(opts, compile=True)]
    if opts.gradient_checkpointing and opts.checkpoint_policy == "full" and not opts.blocks_to_swap:
        out.append(dataclasses.replace(opts, compile=True, checkpoint_policy="selective"))
    return out


def _kernels_key(o) -> tuple:
    """What changes the counted kernels (swapped blocks are counted without their copies)."""
    return (o.gradient_checkpointing, o.checkpoint_policy, o.compile, o.fp8_base, o.fp8_compute, o.zero_stage,
            o.checkpoint_blocks)


def partial_variant(census, o, budget: float):
    """``o`` (every block checkpointed, none swapped) with the fewest checkpointed blocks that fit ``budget``
    (``--checkpoint_blocks N``, as ``--checkpoint_blocks auto`` picks it), or None where only all fit."""
    from ..training.checkpoint_auto import fewest_fitting

    if not o.gradient_checkpointing or o.checkpoint_blocks is not None or o.blocks_to_swap:
        return None
    n, _ = fewest_fitting(census, o, budget)
    if n is None or n >= census.num_layers:
        return None  # (no block checkpointed: no policy, so one set for both)
    return dataclasses.replace(o, checkpoint_blocks=n, checkpoint_policy=o.checkpoint_policy if n else "full")


def fitting_options(census, base, budget: float) -> list:
    """Each kernel-distinct option set that fits ``budget`` bytes, with its fewest swapped blocks, and each
    checkpointed one without swapped blocks again with the fewest checkpointed blocks that fit. A compiled one
    on the FP8 base is left out where the same without FP8 fits with no more swapped blocks (it is slower and
    saves memory that is not needed)."""
    from ..memory.plan import candidates, predict

    fits = {}
    for opts in candidates(census, base):  # candidates come with the fewest swapped blocks first
        variants = speed_variants(opts)
        variants += [p for p in (partial_variant(census, o, budget) for o in variants) if p is not None]
        for o in variants:
            key = _kernels_key(o)
            if key in fits:
                continue
            plan = predict(census, o)
            if plan.gpu_peak > budget:
                continue
            bf16 = fits.get(_kernels_key(dataclasses.replace(o, fp8_base=False)))
            if o.compile and not base.compile and o.fp8_base and not base.fp8_base and bf16 is not None \
                    and bf16.options.blocks_to_swap <= o.blocks_to_swap:
                continue
            fits[key] = plan
    return list(fits.values())


def step_seconds(args, census, table, shapes, options) -> float:
    """The predicted step time of ``options`` on ``table``: its counted kernels (as ``qie plan``'s time and the
    ladder count them: compiled steps fused) or, with swapped blocks, their host copies where those take longer."""
    from ..preflight.timing import predict_train
    from .plan_verify import train_config

    # swapped blocks' copies run beside the compute on a GPU (docs/SPEED.md): counted without them
    cfg, preset = train_config(args, dataclasses.replace(options, blocks_to_swap=0))
    compute = predict_train(cfg, preset, shapes, table.key, profile=train_profile(args, options, shapes)).seconds
    o = options  # each swapped block crosses the host link once per forward (and recompute) and backward
    copies = o.blocks_to_swap * census.block_params * (1 if o.fp8_base else 2) * (3 if o.gradient_checkpointing
                                                                                     else 2)
    return max(compute, copies / (table.h2d_gbps * 1e9))


def fastest_fit(args, census, base, bf16_base: bool = False) -> Optional[object]:
    """Every option set that fits ``--gpu`` (``fitting_options``: with ``--compile`` and ``--compile
    --checkpoint_policy selective`` beside the eager ones), with its predicted step time on ``--gpu``'s table,
    fastest first, logged as a table, and ``--fp8_compute`` named where it fits on top of the fastest (not
    chosen: it changes the numerics); returns the fastest's plan (None: nothing fits). One counted pass per
    kernel-distinct option set. ``bf16_base``: the fastest that keeps the bf16 base, where one fits (the
    launchers' choice, ``--launch_flags``: an FP8 base changes the numerics too)."""
    from ..memory.plan import GiB, describe, predict
    from ..preflight.train_step import batch_shapes

    budget, table = args.gpu_memory_gb * GiB, table_for(args.gpu)
    shapes = batch_shapes(base.resolution, base.ref_images, base.prompt_tokens, base.batch_size)
    rows = sorted(((step_seconds(args, census, table, shapes, p.options), p)
                   for p in fitting_options(census, base, budget)), key=lambda r: r[0])
    if not rows:
        return None
    lines = [f"  {s:6.3f} s/step  {base.batch_size / s:5.2f} samples/s  {p.gpu_peak / GiB:6.1f} GiB  "
             f"{describe(p.options)}" for s, p in rows]
    best = rows[0][1]
    if bf16_base:
        best = next((p for _, p in rows if not p.options.fp8_base), best)
    log.info("options that fit %.1f GiB, fastest first on %s (the time model, docs/SPEED.md):\n%s\n%s: %s",
             args.gpu_memory_gb, table.name, "\n".join(lines), "chosen (the bf16 base kept where it fits)"
             if bf16_base else "fastest", describe(best.options))
    if table.has_fp8 and not best.options.fp8_compute and not best.options.zero_stage:
        fp8 = (predict(census, dataclasses.replace(best.options, fp8_base=True, fp8_compute=True, blocks_to_swap=n))
               for n in range(best.options.blocks_to_swap + 1))  # (FP8 halves the base: maybe fewer swapped)
        plan = next((p for p in fp8 if p.gpu_peak <= budget), None)
        if plan is not None:  # (its time is one more counted pass: `qie plan` with its flags predicts it)
            log.info("you may add --fp8_compute (FP8 GEMMs on the frozen base: it changes the numerics, so it is "
                     "not chosen for you): %s, %.1f GiB; `qie plan --gpu %s` with these flags predicts its time",
                     describe(plan.options), plan.gpu_peak / GiB, args.gpu)
    return best
