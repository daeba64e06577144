"""Measure a GPU's time-model table: GEMM rates by dtype and size, thin (LoRA) GEMMs, attention per backend,
elementwise bandwidth, the launch floor and the host link (about 2-3 minutes on an H100/H200).

    python -m benchmarks.calibrate_gpu [--out diffsynth_qie/fakegpu/gpus/NAME.json] [--name h100]
    python -m benchmarks.calibrate_gpu --cpu    # the same sweep at tiny sizes on the CPU (checks the script)

The table it writes is the one ``qie plan --gpu NAME`` reads (``fakegpu/timemodel.py``, ``docs/SPEED.md``).
Measured rates are what kernels achieve in isolation; the fitted H200 table (``benchmarks/timemodel_fit.py``)
also absorbs what isolation misses (overlap, cache effects), so a measured table is marked "measured" and a
fitted one "fitted".
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("calibrate_gpu")
TABLES = Path(__file__).resolve().parents[1] / "diffsynth_qie" / "fakegpu" / "gpus"


def timed(fn, device, repeats: int = 10) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_rates(device, scale: int) -> tuple[dict, list]:
    """(rate per dtype at the DiT's shapes, [[FLOPs, efficiency], ...] over sizes) in TFLOP/s."""
    rates = {}
    m, n, k = 8192 // scale, 3072 // scale, 3072 // scale
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)):
        if device.type == "cpu" and dtype != torch.float32:
            continue
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        rates[name] = 2 * m * n * k / timed(lambda: a @ b, device) / 1e12
    if device.type == "cuda" and hasattr(torch, "float8_e4m3fn") and torch.cuda.get_device_capability() >= (8, 9):
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        sa, sb = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
        run = lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
        rates["float8_e4m3fn"] = 2 * m * n * k / timed(run, device) / 1e12
    top = rates.get("bfloat16", rates["float32"])
    curve = []
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for side in (256, 512, 1024, 2048, 4096):
        s = max(16, side // scale)
        a, b = torch.randn(s, s, device=device, dtype=dtype), torch.randn(s, s, device=device, dtype=dtype)
        flops = 2 * s ** 3
        curve.append([float(flops), round(min(1.0, flops / timed(lambda: a @ b, device) / 1e12 / top), 3)])
    return rates, curve


def bandwidths(device, scale: int) -> dict:
    """TB/s of an elementwise add, a copy, thin GEMMs (a rank-32 LoRA's A and B at 8k tokens), and GB/s host->device."""
    n = (256 << 20) // scale
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, y = torch.randn(n, device=device, dtype=dtype), torch.randn(n, device=device, dtype=dtype)
    elementwise = 3 * n * x.element_size() / timed(lambda: x + y, device) / 1e12
    tokens, width, rank = 8192 // scale, 3072 // scale, 32
    act = torch.randn(tokens, width, device=device, dtype=dtype)
    a, b = torch.randn(width, rank, device=device, dtype=dtype), torch.randn(rank, width, device=device, dtype=dtype)
    down = act @ a
    moved = (2 * tokens * width + 2 * tokens * rank + 2 * width * rank) * act.element_size()
    thin = moved / timed(lambda: (act @ a, down @ b), device) / 1e12  # a LoRA's down and up GEMMs
    copy = 2 * n * x.element_size() / timed(lambda: x.copy_(y), device) / 1e12
    host = torch.randn(n // 4, dtype=dtype, pin_memory=device.type == "cuda")
    h2d = host.numel() * host.element_size() / timed(lambda: host.to(device, non_blocking=True), device) / 1e9
    return {"elementwise_tbps": elementwise, "thin_gemm_tbps": thin, "hbm_tbps": copy, "h2d_gbps": h2d}


def attention_rates(device, scale: int) -> dict:
    """(forward, backward) TFLOP/s per SDPA backend at the DiT's shape (24 heads x 128, 8k tokens)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seq, heads = 8192 // scale, max(1, 24 // scale)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    flops = 4 * heads * seq * seq * 128
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION} if device.type == "cuda" else {"math": SDPBackend.MATH}
    out = {}
    for name, backend in backends.items():
        q, k, v = (torch.randn(1, heads, seq, 128, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        try:
            with sdpa_kernel([backend]):
                fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v), device)
                o = F.scaled_dot_product_attention(q, k, v)
                grad = torch.ones_like(o)
                both = timed(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad),
                             device)
        except RuntimeError as e:  # a backend this GPU or build lacks
            log.warning("attention backend %s unavailable: %s", name, str(e).splitlines()[0])
            continue
        out[name] = [round(flops / fwd / 1e12, 1), round(2.5 * flops / max(both - fwd, 1e-9) / 1e12, 1)]
    return out


def launch_floor(device) -> float:
    """Microseconds per tiny kernel, queued back to back."""
    x = torch.zeros(1, device=device)

    def many():
        for _ in range(200):
            x.add_(1)
    return timed(many, device) / 200 * 1e6


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default=None, help="table key (default: from the GPU's name)")
    p.add_argument("--out", default=None, help="default: diffsynth_qie/fakegpu/gpus/<name>.json")
    p.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (a check of the script, not a table)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    scale = 16 if device.type == "cpu" else 1
    from benchmarks.common import measure_matmul_flops

    full = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    key = args.name or full.lower().replace("nvidia", "").replace("geforce", "").replace(" ", "")[:16] or "gpu"
    gemm, curve = gemm_rates(device, scale)
    attention = attention_rates(device, scale)
    bw = bandwidths(device, scale)
    table = {"name": full, "aliases": [full], "source": "measured by benchmarks/calibrate_gpu.py on "
             + time.strftime("%Y-%m-%d"), "accuracy": "measured kernels; step accuracy not yet checked",
             "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 1024 ** 3, 1)
             if device.type == "cuda" else 0.0,
             "matmul_tflops": measure_matmul_flops(device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                                   n=8192 // scale) / 1e12,
             "gemm_tflops": {k: round(v, 1) for k, v in gemm.items()}, "gemm_size_efficiency": curve,
             "hbm_tbps": round(bw["hbm_tbps"], 3), "thin_gemm_tbps": round(bw["thin_gemm_tbps"], 3),
             "elementwise_tbps": round(bw["elementwise_tbps"], 3), "attention_tflops": attention,
             "default_backend": "cudnn" if "cudnn" in attention else next(iter(attention)),
             "launch_us": round(launch_floor(device), 2), "h2d_gbps": round(bw["h2d_gbps"], 1)}
    out = Path(args.out) if args.out else TABLES / f"{key}.json"
    from diffsynth_qie.utils.atomic import atomic_write_text

    atomic_write_text(out, json.dumps(table, indent=2) + "\n")
    log.info("wrote %s:\n%s", out, json.dumps(table, indent=2))
    return out


if __name__ == "__main__":
    main()
