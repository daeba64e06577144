"""Benchmark 1024² Qwen-Image-Edit-2511 edit inference: our ``Editor`` against DiffSynth's pipeline call.

One process builds the full-size random-weight components on the GPU (``build.py``:
DiffSynth's ``QwenImageDiT``, ``QwenImageTextEncoder`` = Qwen2.5-VL-7B and
``QwenImageVAE``, bf16), one ``QwenImagePipeline`` holding them, and times on the same
pipeline, inputs and seed:

- ``stock`` — ``QwenImagePipeline.__call__`` (prompt + empty negative prompt, true CFG
  4, 40 steps, one 1024² reference image, ``zero_cond_t=True``,
  ``edit_image_auto_resize=False`` — the reference already has the output size):
  two batch-1 DiT passes per step;
- ``ours``  — ``diffsynth_qie.inference.Editor.edit`` with the same request: the
  positive and negative passes as one batch of 2 through ``dit_forward``;
- ``lbm``   — ``Editor.edit`` with LBM bridge sampling at 1, 2 and 4 steps (main and
  white-prior sub-stream as one batch of 2, no CFG).

s/image covers the whole call (prompt encoding with the vision tower, VAE encode,
sampling, VAE decode to a PIL image): the median of ``--repeats`` calls after one
warm-up call at 2 steps (kernels loaded, caches built).

Substitutes, because nothing can be downloaded on the GPU machine: the tokenizer
and processor are the tiny test model's byte-level BPE (``tiny/build.py``) with the
real processor's image-size limits, and the 7B text encoder's special-token ids are
remapped to that tokenizer's. The prompt therefore tokenises into a different (but
reported) number of tokens than with Qwen's tokenizer; every DiT and text-encoder
shape is otherwise the real one.

``--tiny`` runs the tiny components on the CPU in fp32 (128² images, 3 steps, LBM 1
and 2 steps) and checks parity: our final latents must equal DiffSynth's.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional, Sequence

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from PIL import Image

from benchmarks import build, common

log = logging.getLogger("benchmarks.inference")

CASES = ("ours", "stock", "lbm", "lightning")
PROMPT = "change the color of the red dress to deep blue and make the background a sunny beach"


@dataclass
class InferBenchConfig:
    """Edit-inference benchmark: sizes, steps, which cases and speed-ups."""

    tiny: bool = field(default=False, metadata={"help": "CPU smoke test with the tiny model in fp32 (not timed)"})
    out_dir: str = field(default="benchmarks/results", metadata={"help": "where <gpu>-<date>.json/.md go"})
    cases: list[str] = field(default_factory=lambda: list(CASES), metadata={
        "help": f"which cases to run: {', '.join(CASES)}", "metavar": "CASE"})
    size: Optional[int] = field(default=None, metadata={"help": "output and reference side in pixels (default 1024; tiny 128)"})
    steps: Optional[int] = field(default=None, metadata={"help": "flow-matching steps (default 40; tiny 3)"})
    cfg_scale: float = field(default=4.0, metadata={"help": "true CFG scale"})
    lbm_steps: Optional[list[int]] = field(default=None, metadata={
        "help": "LBM step counts (default 1 2 4; tiny 1 2)", "metavar": "N"})
    lightning_steps: list[int] = field(default_factory=lambda: [4, 8], metadata={
        "help": "'lightning' case: ours with the Lightning schedule at CFG 1, at each of these step counts",
        "metavar": "N"})
    parity_steps: Optional[int] = field(default=None, metadata={
        "help": "compare ours with stock's final latents at this many steps first (default: tiny only, at --steps)"})
    repeats: Optional[int] = field(default=None, metadata={"help": "timed images per case (default 3; tiny 1)"})
    seed: int = field(default=0, metadata={"help": "seed of weights, image and noise"})
    prompt: str = field(default=PROMPT, metadata={"help": "edit instruction"})
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = field(default="auto", metadata={
        "help": "restrict scaled_dot_product_attention to one backend"})
    compile_blocks: bool = field(default=False, metadata={"help": "regional torch.compile of every DiT block"})
    compile_backend: str = field(default="inductor", metadata={"help": "torch.compile backend for --compile_blocks"})
    fp8_base: bool = field(default=False, metadata={"help": "FP8 storage of the DiT block weights (bf16 compute)"})
    tag: str = field(default="", metadata={"help": "label appended to row ids"})
    device: Optional[str] = field(default=None, metadata={"help": "device override (default cuda; tiny: cpu)"})
    log_level: str = field(default="INFO", metadata={"help": "logging level"})

    def resolved(self) -> "InferBenchConfig":
        import dataclasses

        tiny = self.tiny
        return dataclasses.replace(
            self, size=self.size or (128 if tiny else 1024), steps=self.steps or (3 if tiny else 40),
            lbm_steps=list(self.lbm_steps or ([1, 2] if tiny else [1, 2, 4])),
            repeats=self.repeats or (1 if tiny else 3))


# --- setup -------------------------------------------------------------------------------
def build_pipeline(cfg: InferBenchConfig, device: torch.device, dtype: torch.dtype):
    """A ``QwenImagePipeline`` with random-weight DiT, text encoder and VAE (no files, no hub)."""
    from diffsynth.pipelines.qwen_image import QwenImageBlockwiseMultiControlNet, QwenImagePipeline

    pipe = QwenImagePipeline(device=str(device), torch_dtype=dtype)
    pipe.dit = build.build_dit(cfg.tiny, device, dtype, seed=cfg.seed)
    if cfg.fp8_base:
        log.info("FP8 base weights: %d linear layers converted", build.apply_fp8_base(pipe.dit.requires_grad_(False)))
    pipe.text_encoder = build.build_text_encoder(cfg.tiny, device, dtype, seed=cfg.seed + 1)
    pipe.vae = build.build_vae(cfg.tiny, device, dtype, seed=cfg.seed + 2)
    pipe.tokenizer, pipe.processor = build.build_tokenizer_and_processor(cfg.tiny)
    pipe.blockwise_controlnet = QwenImageBlockwiseMultiControlNet([])
    if cfg.compile_blocks:
        build.compile_blocks(pipe.dit, cfg.compile_backend)
    return pipe


def reference_image(size: int, seed: int) -> Image.Image:
    """A random RGB image (content does not change the cost)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


def stock_call(pipe, image: Image.Image, cfg: InferBenchConfig, steps: int, record: dict | None = None):
    """``QwenImagePipeline.__call__`` as a 2511 user calls it; ``record`` receives the final latents."""
    original = pipe.vae.decode
    if record is not None:
        def decode(latents, *args, **kwargs):
            record["latents"] = latents.detach().float().cpu()
            return original(latents, *args, **kwargs)
        pipe.vae.decode = decode  # instance attribute shadows the method for this call only
    try:
        return pipe(prompt=cfg.prompt, negative_prompt="", cfg_scale=cfg.cfg_scale, edit_image=[image],
                    edit_image_auto_resize=False, zero_cond_t=True, height=cfg.size, width=cfg.size,
                    num_inference_steps=steps, seed=cfg.seed, rand_device="cpu", progress_bar_cmd=lambda x: x)
    finally:
        if record is not None:
            del pipe.vae.decode


def ours_call(editor, image: Image.Image, cfg: InferBenchConfig, steps: int, lbm_steps: int | None = None,
              scheduler: str = "default"):
    """``Editor.edit`` with the same request (flow matching, LBM with ``lbm_steps``, or the Lightning schedule
    at CFG 1 with ``scheduler="lightning"``)."""
    from diffsynth_qie.inference import EditRequest

    request = EditRequest(images=[image], prompt=cfg.prompt, negative_prompt="", steps=steps,
                          cfg=1.0 if scheduler == "lightning" else cfg.cfg_scale, scheduler=scheduler,
                          seed=cfg.seed, height=cfg.size, width=cfg.size, ref_max_pixels=None, lbm_steps=lbm_steps)
    return editor.edit(request)


def parity(pipe, editor, image, cfg: InferBenchConfig, steps: int) -> dict:
    """Final latents of ours vs stock at the same seed after ``steps`` (tiny fp32: equal up to rounding)."""
    record: dict = {}
    stock_call(pipe, image, cfg, steps, record)
    ours = ours_call(editor, image, cfg, steps).latents
    ref = record["latents"]
    rel = float((ours - ref).norm() / ref.norm().clamp_min(1e-12))
    return {"seed": cfg.seed, "steps": steps, "dtype": str(pipe.torch_dtype).replace("torch.", ""), "rel_diff_latents": rel,
            "stock_latents_norm": float(ref.norm()), "ours_latents_norm": float(ours.norm())}


# --- one case -----------------------------------------------------------------------------
def run_case(case: str, impl: str, fn: Callable[[], object], warm: Callable[[], object], steps: int,
             dit_forwards: int, cfg: InferBenchConfig, device: torch.device, env: dict, extra: dict) -> dict:
    opts = {"sdpa_backend": cfg.sdpa_backend, "compile_blocks": cfg.compile_blocks, "fp8_base": cfg.fp8_base}
    opt_key = ",".join(f"{k}={v}" for k, v in sorted(opts.items()))
    row = {
        "id": f"inference/{case}/{impl}/steps={steps}/{cfg.size}px/{opt_key}" + (f"/{cfg.tag}" if cfg.tag else ""),
        "script": "inference", "case": case, "impl": impl, "num_inference_steps": steps,
        "cfg_scale": cfg.cfg_scale if case in ("edit",) else 1.0, "size": cfg.size, "reference_images": 1,
        "dit_forwards": dit_forwards, "options": opts, "tag": cfg.tag, "tiny": cfg.tiny, "repeats": cfg.repeats,
        "seed": cfg.seed, "dtype": "fp32" if cfg.tiny else "bf16", "status": "not run",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **extra, **env,
    }
    # tiny rows are not timings: no warm-up call
    common.time_image_row(row, fn, None if cfg.tiny else warm, device, cfg.repeats, log,
                          context=lambda: build.sdpa_context(cfg.sdpa_backend))
    return row


# --- main ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> InferBenchConfig:
    from diffsynth_qie.utils.config_cli import add_dataclass_args, dataclass_from_args

    parser = argparse.ArgumentParser(prog="python -m benchmarks.inference", description=__doc__.split("\n\n")[0])
    add_dataclass_args(parser, InferBenchConfig, title="benchmark")
    cfg = dataclass_from_args(InferBenchConfig, parser.parse_args(argv)).resolved()
    unknown = sorted(set(cfg.cases) - set(CASES))
    if unknown:
        raise ValueError(f"unknown --cases {unknown}; choose from {', '.join(CASES)}")
    if cfg.size % 16:
        raise ValueError(f"--size must be a multiple of 16, got {cfg.size}")
    if cfg.steps < 2 or cfg.repeats < 1 or any(n < 1 for n in cfg.lbm_steps):
        raise ValueError("need --steps >= 2, --repeats >= 1 and --lbm_steps >= 1")
    return cfg


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark; returns ``{"json", "markdown", "rows", "parity"}``."""
    from diffsynth_qie.inference import Editor
    from diffsynth_qie.models.qwen_image_edit.encoding import encode_prompt

    cfg = parse_args(argv)
    device, dtype, env, date = common.start_run(cfg)
    t0 = time.perf_counter()
    pipe = build_pipeline(cfg, device, dtype)
    editor = Editor(pipe, zero_cond_t=True)
    image = reference_image(cfg.size, cfg.seed)
    text_len = int(encode_prompt(pipe, cfg.prompt, [image], multi_image=True).shape[0])
    log.info("built %s pipeline in %.1f s on %s; prompt embedding %d tokens", "tiny" if cfg.tiny else "full-size",
             time.perf_counter() - t0, env["gpu"], text_len)
    extra = {"text_len": text_len}

    parity_result = None
    parity_steps = cfg.parity_steps or (cfg.steps if cfg.tiny else 0)
    if parity_steps:
        parity_result = parity(pipe, editor, image, cfg, parity_steps)
        log.info("parity (%d steps): rel. diff of final latents %.2e", parity_steps, parity_result["rel_diff_latents"])

    plan: list[tuple[str, str, Callable, Callable, int, int]] = []
    warm_steps = 2
    if "stock" in cfg.cases:
        plan.append(("edit", "stock", lambda: stock_call(pipe, image, cfg, cfg.steps),
                     lambda: stock_call(pipe, image, cfg, warm_steps), cfg.steps, 2 * cfg.steps))
    if "ours" in cfg.cases:
        plan.append(("edit", "ours", lambda: ours_call(editor, image, cfg, cfg.steps),
                     lambda: ours_call(editor, image, cfg, warm_steps), cfg.steps, cfg.steps))
    if "lbm" in cfg.cases:
        for n in cfg.lbm_steps:
            plan.append(("lbm", "ours", (lambda n=n: ours_call(editor, image, cfg, cfg.steps, lbm_steps=n)),
                         (lambda n=n: ours_call(editor, image, cfg, cfg.steps, lbm_steps=n)), n, n))
    if "lightning" in cfg.cases:
        for n in cfg.lightning_steps:
            plan.append(("lightning", "ours", (lambda n=n: ours_call(editor, image, cfg, n, scheduler="lightning")),
                         (lambda n=n: ours_call(editor, image, cfg, n, scheduler="lightning")), n, n))
    rows = []
    meta = {"inference_parity": parity_result} if parity_result else None
    for case, impl, fn, warm, steps, forwards in plan:
        rows.append(run_case(case, impl, fn, warm, steps, forwards, cfg, device, env, extra))
        json_path, md_path = common.write_results(rows, cfg.out_dir, env["gpu"], date, extra=meta)
    json_path, md_path = common.write_results(rows, cfg.out_dir, env["gpu"], date, extra=meta)
    log.info("results: %s\n%s", json_path, md_path.read_text())
    return {"json": json_path, "markdown": md_path, "rows": rows, "parity": parity_result}


if __name__ == "__main__":
    main()
