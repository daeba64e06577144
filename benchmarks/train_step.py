"""Benchmark the full-size Qwen-Image-Edit-2511 LoRA training step: ours against DiffSynth's stock step.

Run on a GPU (``python -m benchmarks.train_step``; see ``benchmarks/README.md``) or
as a CPU smoke test (``--tiny``: the tiny test DiT in fp32, a few steps, timings
meaningless). One process builds DiffSynth's real ``QwenImageDiT`` (60 blocks,
dim 3072) with random weights directly on the GPU in bf16 (``build.py``), adds LoRA
(rank 32 and 128) on the 2511 targets, makes synthetic cached inputs and times:

- ``ours``   — our step at batch 1 (``ours_step.py``): the training module built by ``qie train``'s
  own builder (our SFT loss over ``models.forward.dit_forward``) with what ``training/loop.py`` does
  around it: fp32 LoRA weights, computed as ``--compute_precision`` says (default: pure bf16, the
  adapters cast per call; ``autocast``: bf16 autocast), backward, gradient clipping at 1.0, AdamW
  step (fused), ``zero_grad``;
- ``stock``  — what a DiffSynth user's split-training step does at batch 1. The
  wheel ships no ``examples/`` (its ``QwenImageTrainingModule`` lives in
  DiffSynth-Studio's ``examples/qwen_image/model_training/train.py``), so the step is
  reconstructed from the wheel's pieces exactly as that module and
  ``diffusion/runner.py: launch_training_task`` chain them: LoRA via
  ``DiffusionTrainingModule.add_lora_to_model`` (bf16 adapters), the scheduler in
  training mode, ``FlowMatchSFTLoss(pipe, **cached_inputs)`` driving
  ``model_fn_qwen_image``, ``backward``, AdamW ``step``, ``ConstantLR.step``, ``zero_grad``;
- ``batch``  — ours at batch 2 and 4, equal shapes;
- ``mixed``  — ours at batch 4 with mixed shapes (1024², 768×1280, 1280×768, 896²,
  each with a reference image of its own size, prompts of 300/262/337/225 tokens):
  padded tokens + attention mask.

Inputs per sample: target latents ``16×h×w`` (1024² → 128×128), one reference of the
target's size, a ≈300-token prompt embedding of width 3584 — the cache's contents.
Every case runs with gradient checkpointing on and off (and every k-th block with
``--selective_checkpointing k``); an out-of-memory case is recorded as ``OOM``.

Reported per row: median step time over ``--steps`` steps after ``--warmup``
(CUDA events), samples/s, peak ``torch.cuda.max_memory_allocated``, and

    MFU = flops.lora_step_flops(samples) / (median step time × matmul FLOP/s)

with the FLOP count of ``flops.py`` (forward matmuls + attention, ×2 for a LoRA
step, no recomputation) and the bf16 matmul rate measured in the same run.

``--tiny`` additionally checks parity: our loss and DiffSynth's ``FlowMatchSFTLoss``
on the same inputs and seed must agree (same σ, same noise), and the result files
record the check (``parity`` in the JSON).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import build, common, flops, numerics
from benchmarks.ours_step import (make_ours_step, make_samples, our_module, parity_losses, set_checkpointing,
                                  set_lora_dtype)
from benchmarks.stock_step import make_stock_step, stock_inputs, stock_pipeline  # noqa: F401
from benchmarks.flops import SampleShape

log = logging.getLogger("benchmarks.train_step")

CASES = ("ours", "stock", "batch", "mixed")
# Latent sizes (h, w) = pixels / 8.
FULL_TARGET = (128, 128)                                            # 1024²
FULL_MIXED = ((128, 128), (96, 160), (160, 96), (112, 112))         # 1024², 768×1280, 1280×768, 896²
TINY_TARGET = (16, 16)
TINY_MIXED = ((16, 16), (12, 20), (20, 12), (14, 14))
FULL_TEXT_LEN, TINY_TEXT_LEN = 300, 12


@dataclass
class TrainBenchConfig:
    """Training-step benchmark: which cases, ranks, checkpointing modes and speed-ups."""

    tiny: bool = field(default=False, metadata={"help": "CPU smoke test with the tiny DiT in fp32 (not timed)"})
    out_dir: str = field(default="benchmarks/results", metadata={"help": "where <gpu>-<date>.json/.md go"})
    cases: list[str] = field(default_factory=lambda: list(CASES), metadata={
        "help": f"which cases to run: {', '.join(CASES)}", "metavar": "CASE"})
    lora_ranks: list[int] = field(default_factory=lambda: [32, 128], metadata={"help": "LoRA ranks", "metavar": "R"})
    checkpointing: list[str] = field(default_factory=lambda: ["on", "off"], metadata={
        "help": "gradient checkpointing modes to run: on, off", "metavar": "MODE"})
    batch_sizes: list[int] = field(default_factory=lambda: [2, 4], metadata={
        "help": "batch sizes of the equal-shape 'batch' case", "metavar": "B"})
    steps: int = field(default=10, metadata={"help": "timed steps per case (median reported)"})
    warmup: int = field(default=3, metadata={"help": "untimed steps first"})
    seed: int = field(default=0, metadata={"help": "seed of weights, inputs, σ and noise"})
    text_len: Optional[int] = field(default=None, metadata={"help": "prompt tokens (default 300; tiny 12)"})
    lora_fp32: bool = field(default=True, metadata={
        "help": "ours: fp32 LoRA weights, as `qie train` keeps them (--no-lora_fp32: bf16 adapters)"})
    compute_precision: Literal["auto", "pure", "autocast"] = field(default="auto", metadata={
        "help": "ours: qie train --compute_precision (auto = pure bf16 over fp32 adapters; autocast = bf16 autocast)"})
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = field(default="auto", metadata={
        "help": "restrict scaled_dot_product_attention to one backend (torch.nn.attention.sdpa_kernel)"})
    compile_blocks: bool = field(default=False, metadata={
        "help": "regional torch.compile of every transformer block"})
    compile_backend: str = field(default="inductor", metadata={"help": "torch.compile backend for --compile_blocks"})
    checkpoint_policy: Literal["", "full", "selective"] = field(default="", metadata={
        "help": "ours: prepare the blocks as `qie train --checkpoint_policy P` (with --compile_blocks: the "
                "checkpoint inside the compiled blocks, as `qie train --compile`); run with --cases ours"})
    checkpoint_blocks: str = field(default="", metadata={"help": "ours, with --checkpoint_policy: as `qie train "
                                   "--checkpoint_blocks N|auto` (default: every block)", "metavar": "N|auto"})
    fp8_base: bool = field(default=False, metadata={
        "help": "store the frozen block weights in FP8 (e4m3, per-channel scale; bf16 compute), as `qie train --fp8_base`"})
    fp8_compute: bool = field(default=False, metadata={
        "help": "and multiply them in FP8 (row-wise scaled_mm), as `qie train --fp8_compute` (implies --fp8_base)"})
    selective_checkpointing: int = field(default=0, metadata={
        "help": "also run with every k-th block checkpointed (0 = off)", "metavar": "K"})
    blocks_to_swap: list[int] = field(default_factory=list, metadata={
        "help": "also run ours at batch 1 (checkpointing on) with each of these --blocks_to_swap", "metavar": "N"})
    sdpa_rows: list[str] = field(default_factory=list, metadata={
        "help": "also run ours at batch 1 (checkpointing on) under each of these attention backends", "metavar": "B"})
    fp8_row: bool = field(default=False, metadata={
        "help": "last, quantise the base to FP8 (as --fp8_base) and run ours at batch 1 with checkpointing"})
    numerics: bool = field(default=False, metadata={
        "help": "bf16 checks at this size (benchmarks/numerics.py): loss vs stock, block-swap bit parity, "
                "unmerged LoRA vs merged fp32"})
    tag: str = field(default="", metadata={"help": "label appended to row ids (e.g. an attempt name)"})
    device: Optional[str] = field(default=None, metadata={"help": "device override (default cuda; tiny: cpu)"})
    log_level: str = field(default="INFO", metadata={"help": "logging level"})


@dataclass(frozen=True)
class CaseSpec:
    case: str
    impl: Literal["ours", "stock"]
    samples: tuple[SampleShape, ...]
    label: str

    @property
    def batch(self) -> int:
        return len(self.samples)


# --- inputs ------------------------------------------------------------------------------
def plan_cases(cfg: TrainBenchConfig) -> list[CaseSpec]:
    """The (case, impl, samples) list to run for one rank and checkpointing mode."""
    unknown = sorted(set(cfg.cases) - set(CASES))
    if unknown:
        raise ValueError(f"unknown --cases {unknown}; choose from {', '.join(CASES)}")
    target, mixed = (TINY_TARGET, TINY_MIXED) if cfg.tiny else (FULL_TARGET, FULL_MIXED)
    text_len = cfg.text_len or (TINY_TEXT_LEN if cfg.tiny else FULL_TEXT_LEN)
    one = SampleShape(target=target, refs=(target,), text_len=text_len)
    px = lambda hw: f"{hw[1] * 8}x{hw[0] * 8}"  # noqa: E731  (width x height in pixels)
    label = f"{px(target)}+ref"
    out = []
    for case in cfg.cases:
        if case == "ours":
            out.append(CaseSpec("ours", "ours", (one,), label))
        elif case == "stock":
            out.append(CaseSpec("stock", "stock", (one,), label))
        elif case == "batch":
            out += [CaseSpec("batch", "ours", (one,) * b, label) for b in cfg.batch_sizes]
        elif case == "mixed":
            # Prompts of different lengths too (padded text tokens), as real batches have.
            lens = (text_len, text_len * 7 // 8, text_len * 9 // 8, text_len * 3 // 4)
            samples = tuple(SampleShape(target=hw, refs=(hw,), text_len=n) for hw, n in zip(mixed, lens))
            out.append(CaseSpec("mixed", "ours", samples, "+".join(px(s.target) for s in samples) + " (+refs)"))
    return out


# --- one case ----------------------------------------------------------------------------
def run_case(spec: CaseSpec, ckpt: str, rank: int, module, pipe, dims: flops.DiTDims, cfg: TrainBenchConfig,
             device: torch.device, dtype: torch.dtype, matmul_rate: float, env: dict, swap: int = 0) -> dict:
    """Time one case (``swap``: blocks streamed from the host); returns its result row (status ``ok``, ``OOM``
    or ``error: ...``)."""
    entries = make_samples(spec.samples, dims.text_dim, cfg.seed, device, dtype)
    lora_params = list(module.trainable_modules())
    forward_ckpt = ckpt == "on"
    undo = build.wrap_selective_checkpointing(module.dit, int(ckpt.split("_")[1])) if ckpt.startswith("every_") \
        else (lambda: None)
    step = optimizer = swapper = None
    row = base_row(spec, ckpt, rank, cfg, env, swap)
    try:
        if spec.impl == "ours":
            set_lora_dtype(lora_params, torch.float32 if cfg.lora_fp32 else dtype)
            if swap:
                from diffsynth_qie.memory.block_swap import BlockSwapper

                swapper = BlockSwapper(module.dit, swap, device, "cpu").install()
            set_checkpointing(module, forward_ckpt)
            step, optimizer = make_ours_step(module, entries, cfg.seed)
        else:
            set_lora_dtype(lora_params, dtype)  # DiffSynth: add_lora_to_model(upcast_dtype=pipe.torch_dtype)
            step, optimizer = make_stock_step(pipe, lora_params, entries[0], forward_ckpt)
        losses: list[torch.Tensor] = []
        common.free_memory(device)
        common.reset_peak_memory(device)
        with build.sdpa_context(cfg.sdpa_backend):
            times = common.time_calls(lambda: losses.append(step()), device, cfg.warmup, cfg.steps)
        med = common.median(times)
        counted = flops.lora_step_flops(dims, spec.samples, zero_cond_t=True)
        row.update(status="ok", median_s=med, min_s=min(times), times_s=times,
                   samples_per_s=spec.batch / med, **common.memory_fields(device),
                   flops_step=counted, mfu=flops.mfu(counted, med, matmul_rate),
                   loss_last=float(losses[-1]))
    except Exception as exc:  # noqa: BLE001 - a failed case is a result row, the run goes on
        if common.is_oom(exc):
            row.update(status="OOM", **common.memory_fields(device))
        else:
            log.exception("case %s failed", row["id"])
            row.update(status=f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    finally:
        undo()
        if swapper is not None:
            swapper.remove()
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        del step, optimizer
        for p in lora_params:
            p.grad = None
        common.free_memory(device)
    log.info("%-60s %s %s", row["id"], row["status"],
             "" if row["status"] != "ok" else
             f"{row['median_s']:.3f} s/step, {row['samples_per_s']:.2f} samples/s, MFU {100 * row['mfu']:.1f} %, "
             f"peak {row['peak_mem_gib'] or 0:.1f} GiB")
    return row


def options_of(cfg: TrainBenchConfig, impl: str = "ours") -> dict:
    """A row's options (in its id); stock's step has no --compute_precision (its ids stay as they were)."""
    return {**({"checkpoint_policy": cfg.checkpoint_policy} if cfg.checkpoint_policy else {}),
            **({"checkpoint_blocks": cfg.checkpoint_blocks} if cfg.checkpoint_blocks else {}),
            "sdpa_backend": cfg.sdpa_backend, "compile_blocks": cfg.compile_blocks, "fp8_base": cfg.fp8_base,
            "lora_fp32": cfg.lora_fp32, **({"compute_precision": cfg.compute_precision} if impl == "ours" else {}),
            **({"fp8_compute": True} if cfg.fp8_compute else {})}  # (only when set: the other rows' ids stay)


def base_row(spec: CaseSpec, ckpt: str, rank: int, cfg: TrainBenchConfig, env: dict, swap: int = 0) -> dict:
    opts = {**options_of(cfg, spec.impl), **({"blocks_to_swap": swap} if swap else {})}
    opt_key = ",".join(f"{k}={v}" for k, v in sorted(opts.items()))
    tag = f"/{cfg.tag}" if cfg.tag else ""
    return {
        "id": f"train_step/{spec.case}/{spec.impl}/b{spec.batch}/r{rank}/ckpt={ckpt}/{opt_key}{tag}",
        "script": "train_step", "case": spec.case, "impl": spec.impl, "batch": spec.batch,
        "shapes": [dataclasses.asdict(s) for s in spec.samples], "shapes_label": spec.label,
        "lora_rank": rank, "lora_targets": "2511 default", "checkpointing": ckpt, "options": opts,
        "tag": cfg.tag, "tiny": cfg.tiny, "steps": cfg.steps, "warmup": cfg.warmup, "seed": cfg.seed,
        "dtype": "fp32" if cfg.tiny else "bf16", "status": "not run",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **env,
    }


# --- main ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> TrainBenchConfig:
    from diffsynth_qie.utils.config_cli import add_dataclass_args, dataclass_from_args

    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_step", description=__doc__.split("\n\n")[0])
    add_dataclass_args(parser, TrainBenchConfig, title="benchmark")
    cfg = dataclass_from_args(TrainBenchConfig, parser.parse_args(argv))
    bad = sorted(set(cfg.checkpointing) - {"on", "off"})
    if bad:
        raise ValueError(f"--checkpointing takes on/off, got {bad}; use --selective_checkpointing K for every k-th block")
    if cfg.steps < 1 or cfg.warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {cfg.steps} and {cfg.warmup}")
    return cfg


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark; returns ``{"json": path, "markdown": path, "rows": [...], "parity": ...}``."""
    cfg = parse_args(argv)
    device, dtype, env, date = common.start_run(cfg)
    specs = plan_cases(cfg)
    modes = list(cfg.checkpointing) + ([f"every_{cfg.selective_checkpointing}"] if cfg.selective_checkpointing else [])
    if cfg.selective_checkpointing < 0:
        raise ValueError(f"--selective_checkpointing must be >= 0, got {cfg.selective_checkpointing}")

    matmul_rate = common.measure_matmul_flops(device, dtype, n=256 if cfg.tiny else 8192,
                                              iters=3 if cfg.tiny else 30, repeats=1 if cfg.tiny else 3)
    env["matmul_tflops"] = matmul_rate / 1e12
    log.info("%s: matmul %.1f TFLOP/s (%s); torch %s, diffsynth %s", env["gpu"], env["matmul_tflops"],
             "fp32" if cfg.tiny else "bf16", env["torch"], env["diffsynth"])
    t0 = time.perf_counter()
    dit = build.build_dit(cfg.tiny, device, dtype, seed=cfg.seed)
    dims = flops.dims_of(dit)
    pipe = stock_pipeline(dit, device, dtype)
    log.info("built %s DiT (%d blocks, dim %d, %.2f B params) in %.1f s", "tiny" if cfg.tiny else "full",
             dims.num_layers, dims.dim, sum(p.numel() for p in dit.parameters()) / 1e9, time.perf_counter() - t0)

    rows, parity, numerics_result = [], None, None
    for rank in cfg.lora_ranks:
        # qie train's builder (after the injection, --fp8_base quantises the frozen base layers only)
        module = our_module(dit, rank, True, 1, device, dtype, cfg.compute_precision, cfg.fp8_base or cfg.fp8_compute)
        if cfg.fp8_base or cfg.fp8_compute:
            from diffsynth_qie.memory.fp8 import fp8_layers
            from diffsynth_qie.memory.fp8_compute import enable_fp8_compute

            log.info("FP8 base weights: %d linear layers", len(fp8_layers(dit)))
            if cfg.fp8_compute:  # as qie train's module does it (training/module.py)
                enable_fp8_compute(dit)
        # Start from DiffSynth's choice of adapter dtype (the pipeline dtype); each case then sets its own.
        set_lora_dtype(list(module.trainable_modules()), dtype)
        if cfg.checkpoint_policy:  # qie train's own block set-up (training/block_setup.py)
            from diffsynth_qie.training.block_setup import prepare_blocks

            n = build.checkpoint_blocks(cfg.checkpoint_blocks, rank, cfg.checkpoint_policy, cfg.compile_blocks,
                                        cfg.fp8_base or cfg.fp8_compute, cfg.tiny)
            prepare_blocks(dit, argparse.Namespace(blocks_to_swap=0, gradient_checkpointing=True, checkpoint_blocks=n,
                                                   compile=cfg.compile_blocks, checkpoint_policy=cfg.checkpoint_policy),
                           backend=cfg.compile_backend)
        elif cfg.compile_blocks:
            build.compile_blocks(dit, cfg.compile_backend)
        if cfg.tiny and parity is None:
            entry = make_samples(specs[0].samples[:1], dims.text_dim, cfg.seed, device, dtype)[0]
            ours, stock = parity_losses(module, pipe, entry, cfg.seed)
            parity = {"seed": cfg.seed, "ours": ours, "stock": stock,
                      "rel_diff": abs(ours - stock) / max(abs(stock), 1e-12)}
            log.info("parity (tiny, fp32): ours %.6g, stock %.6g, rel. diff %.2e", ours, stock, parity["rel_diff"])
        if cfg.numerics and numerics_result is None:
            entry = make_samples(specs[0].samples[:1], dims.text_dim, cfg.seed, device, dtype)[0]
            numerics_result = numerics.run_all(module, pipe, entry, cfg.seed, device,
                                               min(16, len(dit.transformer_blocks) - 1) or 1)
            log.info("numerics: %s", numerics_result)
        meta = {k: v for k, v in (("parity", parity), ("numerics", numerics_result)) if v}

        def run(spec, ckpt, run_cfg=cfg, swap=0):
            rows.append(run_case(spec, ckpt, rank, module, pipe, dims, run_cfg, device, dtype, matmul_rate, env, swap))
            common.write_results(rows, cfg.out_dir, env["gpu"], date, extra=meta or None)

        for ckpt in modes:
            for spec in specs:
                run(spec, ckpt)
        one = plan_cases(dataclasses.replace(cfg, cases=["ours"]))[0]  # ours, batch 1
        for backend in cfg.sdpa_rows:
            run(one, "on", dataclasses.replace(cfg, sdpa_backend=backend))
        for n in cfg.blocks_to_swap:
            run(one, "on", swap=n)
        if cfg.fp8_row and rank == cfg.lora_ranks[-1] and not cfg.fp8_base:
            log.info("FP8 base weights: %d linear layers", build.apply_fp8_base(dit))
            run(one, "on", dataclasses.replace(cfg, fp8_base=True))
        build.strip_lora(dit)
        if cfg.compile_blocks:
            torch._dynamo.reset()
        del module
        common.free_memory(device)
    meta = {k: v for k, v in (("parity", parity), ("numerics", numerics_result)) if v}
    json_path, md_path = common.write_results(rows, cfg.out_dir, env["gpu"], date, extra=meta or None)
    log.info("results: %s\n%s", json_path, md_path.read_text())
    return {"json": json_path, "markdown": md_path, "rows": rows, "parity": parity, "numerics": numerics_result}


if __name__ == "__main__":
    main()
