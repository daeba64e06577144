"""Benchmark the full-size Qwen-Image-2.1 LoRA training step: ours against DiffSynth's own 2.1 training path.

    python -m benchmarks.train21 [--refs 1 3] [--steps 5]       # on a GPU: random full-size 2.1 DiT, bf16
    python -m benchmarks.train21 --tiny                          # CPU smoke test (tiny 2.1, fp32; not timings)

One process builds DiffSynth's ``QwenImage21DiT`` at its own defaults (32 blocks, 32 heads × 128 = 4096 wide,
SwiGLU MLP 3×; ≈7.6 B parameters) with random weights on the GPU (``build.py``), LoRA of ``--lora_rank`` on the
2.1 targets, and times, per reference count, one step on a 1024² target with that many 1024² references and a
≈300-token prompt (the references' 2×2-merged slots inside the prompt, as the 2.1 encoder lays them out):

- ``ours``  — the training module for the ``2.1`` preset built by ``qie train``'s own builder (our SFT loss over
  ``forward21``), fp32 adapters computed as ``--compute_precision`` says (default: pure bf16), checkpointing,
  clip 1.0, AdamW (fused) — what ``qie train --model 2.1`` runs per step; at batch 1 and at ``--batch`` (equal
  shapes: one DiT call for the group);
- ``stock`` — DiffSynth's path: ``FlowMatchSFTLoss`` over a ``QwenImage21Pipeline`` holding the DiT
  (``model_fn_qwen_image_21``, batch 1), bf16 adapters, its gradient checkpointing, AdamW + ``ConstantLR``.

Rows go into the same ``<gpu>-<date>`` tables as ``train_step`` (model ``2.1``), with MFU from the FLOP count of
``step21.forward_flops21`` and the matmul rate measured in the run.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import build, common
from benchmarks.ours_step import our_module
from benchmarks.stock_step import make_stock_step
from benchmarks.step21 import forward_flops21

log = logging.getLogger("benchmarks.train21")
FULL_LATENT, TINY_LATENT = 64, 8     # 2.1 latents are 1/16 of the pixels: 1024² -> 64×64
FULL_TEXT, TINY_TEXT = 300, 12


def build_dit21(tiny: bool, device, dtype, seed: int = 0):
    from diffsynth.models.qwen_image_21_dit import QwenImage21DiT

    if tiny:
        from diffsynth_qie.tiny.qwen21 import DIT_KWARGS

        return build._build(lambda: QwenImage21DiT(**DIT_KWARGS), device, dtype, seed)
    return build._build(QwenImage21DiT, device, dtype, seed)


def make_entry(side: int, refs: int, text: int, text_dim: int, seed: int, device, dtype) -> dict:
    """One cached 2.1 sample: target [64, s, s], ``refs`` references, prompt with the references' slot mask."""
    gen = torch.Generator().manual_seed(seed)
    slots = (side // 2) * (side // 2)
    length = text + refs * slots
    pad = torch.zeros(length, dtype=torch.bool)
    for k in range(refs):  # each reference's slots after a 2-token preamble, text after them
        pad[2 + k * slots:2 + (k + 1) * slots] = True
    return {"target": torch.randn(64, side, side, generator=gen).to(device, dtype),
            "refs": [torch.randn(64, side, side, generator=gen).to(device, dtype) for _ in range(refs)],
            "prompt": torch.randn(length, text_dim, generator=gen).to(device, dtype), "pad": pad}


def ours_batch(entries: Sequence[dict]) -> dict:
    return {"target_latents": [e["target"] for e in entries], "edit_latents": [e["refs"] for e in entries],
            "prompt_emb": [e["prompt"] for e in entries], "prompt_extras": [{"pad": e["pad"]} for e in entries],
            "back_mask": [None] * len(entries)}


def make_ours_step(module, entries, seed: int) -> Callable[[], torch.Tensor]:
    from diffsynth_qie.training.optim import build_optimizer

    params = list(module.trainable_modules())
    optimizer = build_optimizer(params, module.config.optim)
    batch, gen = ours_batch(entries), torch.Generator().manual_seed(seed)

    def step() -> torch.Tensor:
        loss, _ = module(batch, gen)  # under the module's own --compute_precision
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def stock_pipeline21(dit, device, dtype):
    from diffsynth.pipelines.qwen_image_21 import QwenImage21Pipeline

    pipe = QwenImage21Pipeline(device=str(device), torch_dtype=dtype)
    pipe.dit = dit
    pipe.scheduler.set_timesteps(1000, training=True)
    return pipe


def stock_inputs21(entry: dict) -> dict:
    return {"input_latents": entry["target"][None], "edit_latents": [r[None] for r in entry["refs"]],
            "prompt_embeds": entry["prompt"][None], "prompt_embeds_mask": None,
            "edit_image_pad_mask": entry["pad"][None].to(entry["target"].device),
            "use_gradient_checkpointing": True, "use_gradient_checkpointing_offload": False}


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train21", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny 2.1 (fp32; not timings)")
    p.add_argument("--refs", type=int, nargs="+", default=[1, 3], help="reference counts to run")
    p.add_argument("--batch", type=int, default=4, help="ours also at this batch (equal shapes; 0 = skip)")
    p.add_argument("--lora_rank", type=int, default=32)
    p.add_argument("--compute_precision", choices=["auto", "pure", "autocast"], default="auto",
                   help="ours: qie train --compute_precision (auto = pure bf16 over fp32 adapters)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out_dir", default="benchmarks/results")
    p.add_argument("--log_level", default="INFO")
    p.add_argument("--device", default=None)
    cfg = p.parse_args(argv)
    device, dtype, env, date = common.start_run(cfg)
    matmul = common.measure_matmul_flops(device, dtype, n=256 if cfg.tiny else 8192, iters=3 if cfg.tiny else 30,
                                         repeats=1 if cfg.tiny else 3)
    env["matmul_tflops"] = matmul / 1e12
    t0 = time.perf_counter()
    dit = build_dit21(cfg.tiny, device, dtype, cfg.seed)
    dim, text_dim = dit.img_in.out_features, dit.txt_in.in_layer.in_features
    ffn, layers = dit.transformer_blocks[0].img_mlp.proj.out_features, len(dit.transformer_blocks)
    pipe = stock_pipeline21(dit, device, dtype)
    module = our_module(dit, cfg.lora_rank, True, 1, device, dtype, cfg.compute_precision,
                        model="tiny-2.1" if cfg.tiny else "2.1")  # qie train's builder
    params = list(module.trainable_modules())
    log.info("built %s 2.1 DiT (%d blocks, dim %d, %.2f B params) in %.1f s", "tiny" if cfg.tiny else "full", layers,
             dim, sum(q.numel() for q in dit.parameters()) / 1e9, time.perf_counter() - t0)
    side, text = (TINY_LATENT, TINY_TEXT) if cfg.tiny else (FULL_LATENT, FULL_TEXT)
    rows = []
    for refs in cfg.refs:
        entry = make_entry(side, refs, text, text_dim, cfg.seed, device, dtype)
        cases = [("ours", 1), ("stock", 1)] + ([("ours", cfg.batch)] if cfg.batch > 1 else [])
        for impl, batch in cases:
            flops = 2 * batch * forward_flops21(dim, ffn, layers, (1 + refs) * side * side,
                                                entry["prompt"].shape[0])
            prec = f"/compute_precision={cfg.compute_precision}" if impl == "ours" else ""
            row = {"id": f"train21/{impl}/b{batch}/refs={refs}/r{cfg.lora_rank}/ckpt=on{prec}",
                   "script": "train_step",
                   "model": "2.1", "case": f"2.1 {refs} ref", "impl": impl, "batch": batch, "refs": refs,
                   "shapes_label": f"{side * 16}² + {refs}×{side * 16}² ref", "lora_rank": cfg.lora_rank,
                   "checkpointing": "on", "tag": "", "tiny": cfg.tiny, "steps": cfg.steps,
                   "options": {"compute_precision": cfg.compute_precision} if impl == "ours" else {},
                   "status": "not run", "text_len": int(entry["prompt"].shape[0]), **env}
            for q in params:
                q.data = q.data.to(torch.float32 if impl == "ours" else dtype)  # stock: DiffSynth's bf16 adapters
            try:
                step = make_ours_step(module, [entry] * batch, cfg.seed) if impl == "ours" else \
                    make_stock_step(pipe, params, entry, True, inputs=stock_inputs21(entry))[0]
                common.free_memory(device)
                common.reset_peak_memory(device)
                losses: list = []
                times = common.time_calls(lambda: losses.append(step()), device, cfg.warmup, cfg.steps)
                med = common.median(times)
                row.update(status="ok", median_s=med, times_s=times, samples_per_s=batch / med,
                           **common.memory_fields(device), flops_step=flops,
                           mfu=flops / (med * matmul), loss_last=float(losses[-1]))
            except Exception as exc:  # noqa: BLE001 - a failed case is a result row
                common.record_failure(row, exc, device, log)
            finally:
                step = None
                for q in params:
                    q.grad = None
                common.free_memory(device)
            log.info("%-50s %s %s", row["id"], row["status"], "" if row["status"] != "ok" else
                     f"{row['median_s']:.3f} s/step, MFU {100 * row['mfu']:.1f} %, peak {row['peak_mem_gib'] or 0:.1f} GiB")
            rows.append(row)
            common.write_results(rows, cfg.out_dir, env["gpu"], date)
    return common.finish(rows, cfg.out_dir, env, date, log)


if __name__ == "__main__":
    main()
