"""`qie plan --verify`: the planned configuration run on a fake CUDA device, and a memory verdict.

The run is the one ``qie train`` / ``qie edit`` would make with the plan's options (the loss's own optimizer,
``--ema_decay``, stacked LoRAs, the 2.1 family through its own fake-device run). Its peak is then judged
(``fakegpu/verdict.py``): the command fails with one line naming the phase, the largest holders by our frame and
the fix when the peak exceeds the GPU (``--gpu_memory_gb``, default: the visible GPU) or when the plan is more
than 10 % off. The plan is compared like with like: the terms of what the run does not build (say, the 2.1
edit's encoders) are left out of both and named; with ``--verify_blocks N`` the plan of an N-block DiT is.
A :class:`~..fakegpu.device.FakeRunError` is reported like the preflight's (one line, exit code 2).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
GiB = 1024 ** 3


@dataclass
class FakeRun:
    """What a fake-device run of the planned configuration measured, normalised across its kinds."""

    what: str
    rows: list  # (name, bytes) per phase
    phase: str  # the phase of the peak
    peak: int
    weights: int
    seconds: float
    holders: list = field(default_factory=list)  # (our frame, bytes) at the run's highest moment
    uncovered: tuple = ()  # plan terms the run does not build
    notes: list = field(default_factory=list)
    profile: object = None  # the whole DiT's counted kernels (fakegpu.costs.Profile; None with --verify_blocks)
    steps_run: int = 0      # an edit's denoising steps run
    deep_costs: object = None  # an edit's counted kernels at the time prediction's deeper depth (--verify_blocks 2)


def train_config(args, options):
    """The resolved :class:`RunConfig` a ``qie train`` with the plan's options would run."""
    from ..models.presets import get_preset
    from ..training.config import RunConfig
    from ..training.losses.registry import loss_spec

    preset = get_preset(args.model)
    cfg = RunConfig()
    ema_decay = (getattr(args, "ema_decay", 0.0) or 0.999) if options.ema else 0.0
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, model=args.model, cache_dir="-", output_dir="-",
                                  batch_size=options.batch_size, gradient_checkpointing=options.gradient_checkpointing,
                                  fp8_base=options.fp8_base, fp8_compute=options.fp8_compute,
                                  blocks_to_swap=options.blocks_to_swap, ema_decay=ema_decay,
                                  validate_with=options.validate_with, compute_precision=options.compute_precision,
                                  checkpoint_policy=options.checkpoint_policy, compile=options.compile,
                                  checkpoint_blocks=options.checkpoint_blocks),
        lora=dataclasses.replace(cfg.lora, lora_rank=options.lora_rank),
        optim=dataclasses.replace(cfg.optim, optimizer=options.optimizer),
        loss=dataclasses.replace(cfg.loss, loss=args.loss))
    if options.rollouts:  # --loss nft: K rollouts; the fake run's reward is a stand-in (preflight/train_extras.py)
        cfg = dataclasses.replace(cfg, nft=dataclasses.replace(cfg.nft, reward="preserve",
                                                               nft_group_size=options.rollouts))
    spec = loss_spec(args.loss)
    if spec.stand_in is not None:  # --loss dmd: a teacher LoRA of the run's rank, in a folder removed at exit
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="qie-plan-")
        atexit.register(shutil.rmtree, folder, True)
        cfg = spec.stand_in(cfg, preset, args.verify_blocks, folder)
    if options.on_the_fly:
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, cache_dir=None),
            dataset=dataclasses.replace(cfg.dataset, dataset_metadata="-"),
            onthefly=dataclasses.replace(cfg.onthefly, on_the_fly=True))
    return cfg.resolved(preset), preset


def verify_and_compare(args, options, plan) -> FakeRun:
    """Run ``options`` on the fake device, log its phases beside ``plan`` and the verdict's line; returns the run
    (its counted kernels time it). ``ValueError`` (one line) on a fake-device error or a failed verdict."""
    from ..fakegpu.verdict import gpu_bytes_of

    gpu = gpu_bytes_of(args.gpu_memory_gb)  # the visible GPU is asked before the fake device patches CUDA
    run = fake_run(args, options)
    judge(args, options, plan, run, gpu)
    return run


def fake_run(args, options) -> FakeRun:
    """The planned configuration run on the fake device, with the largest holders at its highest moment."""
    from ..fakegpu.device import FakeRunError
    from ..fakegpu.accounting import recorded_sessions
    from ..models.presets import family_of

    if options.zero_stage:
        raise ValueError("--verify runs one process without DeepSpeed; drop --zero_stage (ZeRO-2/3 divide what it "
                         "counts by --num_gpus as the plan shows)")
    family = family_of(args.model)
    with recorded_sessions() as sessions:
        try:
            run = _run_train(args, options, family) if options.task == "train" else _run_edit(args, options, family)
        except FakeRunError as e:
            raise ValueError(f"qie plan --verify ({options.task} on a fake CUDA device): {e}") from None
    if sessions:
        top = max(sessions, key=lambda m: m.top)
        run.holders = top.top_holders(5)
        if options.task == "train" and options.ema and not top.bytes_from("training/ema.py"):
            run.uncovered += ("EMA shadow (fp32)",)
            run.notes.append("the EMA shadow is not built by this fake-device step: counted by the plan only")
    return run


def planned_like(args, options, plan, run: FakeRun) -> tuple[int, int]:
    """(the plan of what ``run`` holds, at its depth; the same at full depth): both without the CUDA context and
    the terms ``run`` does not build."""
    from ..memory.plan import predict

    run.uncovered = tuple(name for name in plan.gpu if name in run.uncovered)  # the terms this plan has
    full = _covered(plan, run.uncovered)
    blocks = args.verify_blocks
    like = full if not blocks else _covered(predict(_census_of(args, blocks), _shallow(options, blocks)),
                                            run.uncovered)
    return like, full


def judge(args, options, plan, run: FakeRun, gpu) -> str:
    """Log the run beside the plan and check its memory verdicts (the GPU's, then the plan's)."""
    from ..fakegpu.verdict import MemoryVerdict, check_memory

    blocks = args.verify_blocks
    like, full = planned_like(args, options, plan, run)
    rest = plan.gpu_peak - full  # what the run leaves out: the other blocks, uncovered terms, the CUDA context
    on_gpu = run.peak + (full - like) + rest
    added = [f"{blocks} blocks run, the others as the plan counts them"] if blocks else []
    added += [", ".join(run.uncovered) + " as the plan counts them"] if run.uncovered else []
    added.append(f"{options.overhead_bytes / GiB:.0f} GiB CUDA context")
    table = "\n".join(f"  {name:<48} {b / GiB:8.2f} GiB" for name, b in run.rows)
    versus = ("the plan counts every block; compared with its plan of the same depth" if blocks else "the plan")
    log.info("fake CUDA device, %s, %s, in %.1f s:\n%s\n  %-48s %8.2f GiB (%s, %+.1f %%)%s", run.what,
             f"{blocks} blocks" if blocks else "all blocks", run.seconds, table,
             "plan's prediction of the same" + (" (DiT part)" if run.uncovered else ""), like / GiB, versus,
             100 * (like / run.peak - 1), "".join(f"\n  note: {n}" for n in run.notes))
    holders = list(run.holders)
    lines = []
    if gpu is not None:
        lines.append(check_memory(MemoryVerdict(run.phase + " on the GPU", on_gpu, gpu_bytes=gpu, holders=holders,
                                                scaled="fake-device peak + " + "; ".join(added))))
    like_phase = run.phase + (" (without " + ", ".join(run.uncovered) + ")" if run.uncovered else "")
    from ..models.presets import get_preset

    # the plan's constants (activations per token, the VAE's bytes per pixel) are the real models': a tiny
    # model's run is checked for what a GPU would refuse, not held to them
    tiny = get_preset(args.model).is_tiny
    if tiny:
        log.info("memory verdict: a tiny model is not compared with the plan (its constants are the real models')")
    lines.append(check_memory(MemoryVerdict(like_phase, run.peak, planned_bytes=None if tiny else like,
                                            holders=holders, scaled=f"{blocks} blocks" if blocks else "")))
    for line in lines:
        log.info("memory verdict: %s", line)
    return "; ".join(lines)


def _covered(plan, uncovered) -> int:
    """The plan's GPU bytes of what a fake-device run holds: without the CUDA context and ``uncovered`` terms."""
    return sum(b for name, b in plan.gpu.items() if name not in uncovered) - plan.options.overhead_bytes


def _census_of(args, blocks: int):
    from ..memory.census import preset_census

    return preset_census(args.model, with_encoders=args.task == "edit" or args.on_the_fly, num_layers=blocks)


def _shallow(options, blocks: int):
    cb = options.checkpoint_blocks
    return dataclasses.replace(options, blocks_to_swap=min(options.blocks_to_swap, blocks),
                               checkpoint_blocks=None if cb is None else min(cb, blocks))


def _run_train(args, options, family) -> FakeRun:
    from ..memory.plan import ENCODER_TERMS
    from ..preflight.train_step import batch_shapes, verify_train_step

    cfg, preset = train_config(args, options)
    shapes = batch_shapes(options.resolution, options.ref_images, options.prompt_tokens, options.batch_size,
                          mixed=args.mixed)
    r = verify_train_step(cfg, preset, shapes, num_layers=args.verify_blocks, costs=_counts(args))
    rows = [("weights (DiT + LoRA" + (" + encoders" if r.encoder_weights else "") + ", after setup)", r.weights)]
    if r.encoder_weights:  # --on_the_fly: the encoders built on the fake device and one sample encoded
        rows += [("  of which the on-the-fly encoders", r.encoder_weights),
                 ("on-the-fly encode transient (beside the step)", r.encode_transient)]
    rows += [("forward + backward peak", r.forward_backward_peak), ("optimizer state", r.optimizer_state),
             ("optimizer step peak", r.optimizer_peak), ("steady-state peak", r.peak)]
    run = FakeRun(f"one training step ({args.loss}, loss {r.loss_dtype})", rows,
                  "training step (steady state)", r.peak, r.weights, r.seconds,
                  notes=[f"optimizer {cfg.optim.optimizer}, as qie train runs --loss {args.loss}", *r.notes])
    run.profile = r.costs
    run.uncovered = tuple(t for t in ("EMA validation copy of the LoRA (fp32)",) if options.validate_with != "raw")
    if options.on_the_fly and not r.encoder_weights:
        run.uncovered += ENCODER_TERMS
        run.notes.append("--on_the_fly: the encoders are not on the training GPU here; their weights and encode "
                         "working set are the plan's, left out of the comparison")
    elif options.on_the_fly:
        run.notes.append("--on_the_fly: text encoder and VAE encoder built on the fake device, one sample encoded "
                         "through the real on-the-fly path; compared with the plan's encoder terms")
    if run.uncovered and options.validate_with != "raw":
        run.notes.append("validation is not run by the step: the EMA validation copy is the plan's")
    return run


def _run_edit(args, options, family) -> FakeRun:
    from ..preflight.edit_step import EditLoad, verify_edit
    from ..models.presets import get_preset

    preset = get_preset(args.model)
    cfg = 4.0 if options.cfg else 1.0
    load = EditLoad(fp8_base=options.fp8_base, fp8_compute=options.fp8_compute,
                    blocks_to_swap=options.blocks_to_swap,
                    lora_ranks=tuple(r for r in options.lora_ranks if r))  # each stacked LoRA its own branches
    r = verify_edit(preset, resolution=options.resolution, ref_images=max(1, options.ref_images),
                    prompt_tokens=options.prompt_tokens, steps=args.edit_steps, cfg=cfg, num_layers=args.verify_blocks,
                    kv_cache=options.kv_cache == "on", load=load, costs=_counts(args) or _timing_depth(args, family),
                    cache=args.cache, cache_method=args.cache_method, cache_threshold=args.cache_threshold)
    rows = [("weights", r.weights)] + [(f"{k} peak", getattr(r, f"{k}_peak")) for k in ("encode", "denoise", "decode")]
    if r.kv_cache:
        rows.append(("prefix KV caches", r.kv_cache))
    phase = max(rows[1:4], key=lambda kv: kv[1])[0].replace(" peak", "")
    peak = max(b for name, b in rows if name.endswith("peak"))
    cached = f", step cache {args.cache}: {r.cache_skipped} of {r.cache_calls} calls reused" if r.cache_calls else ""
    whole = _counts(args)
    return FakeRun(f"one edit ({args.edit_steps} steps, CFG {cfg:g}{cached})", rows, f"edit: {phase}", peak,
                   r.weights, r.seconds, profile=r.costs if whole else None, steps_run=args.edit_steps,
                   deep_costs=None if whole else r.costs)


def _counts(args) -> bool:
    """Whether the run counts its kernels for the time prediction (the whole DiT, and time asked for)."""
    return not (args.verify_blocks or getattr(args, "no_time", False))


def _timing_depth(args, family) -> bool:
    """Whether the edit run is the time prediction's deeper run as it stands (its depth, its steps, no step
    cache): its counted kernels are then that run's (``preflight/timing.predict_edit``)."""
    from ..preflight.timing import DEPTHS, EDIT_STEPS_RUN

    steps = getattr(args, "steps", None) or family.default_steps
    return (args.verify_blocks == DEPTHS[-1] and args.edit_steps == min(steps, EDIT_STEPS_RUN)
            and args.cache == "off" and not getattr(args, "no_time", False))
