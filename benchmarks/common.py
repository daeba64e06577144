"""Shared benchmark plumbing: environment facts, timing, matmul ceiling, result files.

Result files: ``<out_dir>/<gpu>-<date>.json`` (``{"format_version", "gpu", "date",
"rows": [...]}``) and a Markdown table beside it (same stem, ``.md``). Rows are
keyed by ``row["id"]``; writing merges into an existing file of the same GPU and
day, replacing rows with the same id, so a benchmark split over several GPU calls
(each under the 10-minute limit) ends up in one table. The files are rewritten
atomically after every row, so a run killed at its time limit keeps what it measured.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import math
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
GiB = 1024 ** 3


# --- environment -----------------------------------------------------------------------
def env_info(device: torch.device) -> dict[str, Any]:
    """Versions and hardware every row carries."""
    import diffsynth
    from importlib.metadata import PackageNotFoundError, version

    try:
        diffsynth_version = version("diffsynth")
    except PackageNotFoundError:  # e.g. a source checkout on PYTHONPATH
        diffsynth_version = getattr(diffsynth, "__version__", "unknown")
    info = {
        "torch": torch.__version__,
        "diffsynth": diffsynth_version,
        "cuda": torch.version.cuda,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    try:
        info["peft"] = version("peft")
        info["transformers"] = version("transformers")
    except PackageNotFoundError:
        pass
    return info


def gpu_slug(gpu_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"`` (file-name safe)."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")
    return slug or "unknown"


def today() -> str:
    return _dt.date.today().isoformat()


def resolve_device(tiny: bool, device: str | None) -> tuple[torch.device, torch.dtype]:
    """Tiny: CPU fp32 (bf16 is ~100x slower on these CPUs). Full size: CUDA bf16 (required)."""
    if tiny:
        return torch.device(device or "cpu"), torch.float32
    if not torch.cuda.is_available():
        raise ValueError("the full-size benchmark needs a CUDA GPU (it builds the 20 B DiT in bf16); "
                         "use --tiny for the CPU smoke test")
    return torch.device(device or "cuda"), torch.bfloat16


# --- timing ----------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds per call of ``fn`` after ``warmup`` untimed calls.

    On CUDA each call is bracketed by CUDA events and the host synchronises only once
    at the end, so the timing adds no host syncs of its own; on CPU, wall clock.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type != "cuda":
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    synchronize(device)
    return [start.elapsed_time(end) / 1000.0 for start, end in events]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 8192, iters: int = 30,
                         repeats: int = 3) -> float:
    """Achieved FLOP/s of a square ``n×n @ n×n`` matmul on random data (best of ``repeats`` medians).

    The MFU denominator: what this GPU's matmul units actually deliver in this run
    (clocks, power state), not the datasheet number.
    """
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    for _ in range(repeats):
        times = time_calls(lambda: torch.mm(a, b), device, warmup=3, repeats=iters)
        best = max(best, 2 * n ** 3 / median(times))
    del a, b
    return best


def memory_fields(device: torch.device) -> dict:
    """A row's memory columns: the peak, and the caching allocator's retries since the last reset (a row near the
    GPU's capacity slows down on them: it frees its cache and tries again, which no kernel count shows)."""
    if device.type != "cuda":
        return {"peak_mem_gib": None, "alloc_retries": None}
    return {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / GiB,
            "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries")}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)


def free_memory(device: torch.device) -> None:
    """Return cached GPU memory between cases (no-op on CPU, where gc.collect only costs time)."""
    import gc

    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def record_failure(row: dict, exc: BaseException, device: torch.device, logger: logging.Logger) -> None:
    """A failed case as a result row: ``OOM`` (with the peak it reached) or ``error: <type>: <first line>``
    (logged with its traceback); the run goes on."""
    if is_oom(exc):
        row.update(status="OOM", **memory_fields(device))
        return
    logger.exception("case %s failed", row["id"])
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    row.update(status=f"error: {type(exc).__name__}: {first}", **memory_fields(device))


def time_image_row(row: dict, fn: Callable[[], Any], warm: Callable[[], Any] | None, device: torch.device,
                   repeats: int, logger: logging.Logger, context: Callable[[], Any] = contextlib.nullcontext) -> None:
    """Time ``fn`` (one image) into ``row``: ``warm`` once untimed (None: no warm-up, as in tiny runs), then
    ``repeats`` timed calls from a fresh peak, all inside ``context()``; the median is ``s_per_image``. A failure is a
    result row (:func:`record_failure`); cached memory is freed after either way, and the row's line logged."""
    try:
        with context():
            if warm is not None:
                warm()
            free_memory(device)
            reset_peak_memory(device)
            times = time_calls(fn, device, warmup=0, repeats=repeats)
        row.update(status="ok", s_per_image=median(times), times_s=times, **memory_fields(device))
    except Exception as exc:  # noqa: BLE001 - a failed case is a result row
        record_failure(row, exc, device, logger)
    finally:
        free_memory(device)
    logger.info("%-70s %s %s", row["id"], row["status"],
                f"{row['s_per_image']:.3f} s/image" if row["status"] == "ok" else "")


def finish(rows: list[dict], out_dir, env: dict, date: str, logger: logging.Logger) -> dict:
    """Write the rows and log the table; what a benchmark's ``main`` returns."""
    json_path, md_path = write_results(rows, out_dir, env["gpu"], date)
    logger.info("results: %s\n%s", json_path, md_path.read_text())
    return {"json": json_path, "markdown": md_path, "rows": rows}


# --- results -----------------------------------------------------------------------------
def result_paths(out_dir: str | Path, gpu: str, date: str) -> tuple[Path, Path]:
    stem = f"{gpu_slug(gpu)}-{date}"
    return Path(out_dir) / f"{stem}.json", Path(out_dir) / f"{stem}.md"


def load_rows(json_path: Path) -> list[dict]:
    if not json_path.exists():
        return []
    data = json.loads(json_path.read_text())
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{json_path} has format_version {data.get('format_version')!r}, expected "
                         f"{FORMAT_VERSION}; move it away or pass another --out_dir")
    return list(data.get("rows", []))


def write_results(rows: Sequence[dict], out_dir: str | Path, gpu: str, date: str,
                  extra: dict | None = None) -> tuple[Path, Path]:
    """Merge ``rows`` into ``<out_dir>/<gpu>-<date>.json`` (by id) and rewrite the Markdown table."""
    from diffsynth_qie.utils.atomic import atomic_write_json, atomic_write_text

    json_path, md_path = result_paths(out_dir, gpu, date)
    merged = {r["id"]: r for r in load_rows(json_path)}
    for row in rows:
        merged[row["id"]] = row
    all_rows = list(merged.values())
    meta = {}
    if json_path.exists():
        meta = {k: v for k, v in json.loads(json_path.read_text()).items() if k not in ("rows",)}
    meta.update(extra or {})
    meta.update({"format_version": FORMAT_VERSION, "gpu": gpu, "date": date})
    atomic_write_json(json_path, {**meta, "rows": all_rows})
    atomic_write_text(md_path, markdown_report(all_rows, gpu, date, meta))
    return json_path, md_path


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


# Option values that are the defaults (not shown in the tables).
DEFAULT_OPTIONS = dict(sdpa_backend="auto", compile_blocks=False, fp8_base=False, lora_fp32=True,
                       compute_precision="auto")


def _options(row: dict) -> str:
    opts = row.get("options") or {}
    parts = [f"{k}={v}" for k, v in sorted(opts.items()) if DEFAULT_OPTIONS.get(k, None) != v]
    if row.get("tag"):
        parts.append(f"tag={row['tag']}")
    return ", ".join(parts) or "–"


def _train_table(rows: list[dict]) -> list[str]:
    def key(r: dict, options: str) -> tuple:
        return r.get("model", "2511"), r.get("refs", 1), r["lora_rank"], r["checkpointing"], options

    # × stock: against DiffSynth's step of the same model, references, rank, checkpointing and options, or, for a
    # speed-up stock does not have (block swapping, FP8, an attention backend), against its plain step
    stock = {key(r, _options(r)): r for r in rows if r["impl"] == "stock" and r["status"] == "ok"}
    out = ["| case | impl | batch | shapes | LoRA r | ckpt | options | status | step s (median) | samples/s "
           "| peak GiB | MFU | × stock samples/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = stock.get(key(r, _options(r))) or stock.get(key(r, "–"))
        ratio = None
        if ref and r["status"] == "ok" and r.get("samples_per_s") and ref.get("samples_per_s"):
            ratio = r["samples_per_s"] / ref["samples_per_s"]
        mfu = r.get("mfu")
        out.append("| " + " | ".join([
            r["case"], r["impl"], str(r["batch"]), r.get("shapes_label", "–"), str(r["lora_rank"]),
            r["checkpointing"], _options(r), r["status"], _fmt(r.get("median_s")),
            _fmt(r.get("samples_per_s")), _fmt(r.get("peak_mem_gib")),
            "–" if mfu is None else f"{100 * mfu:.1f} %", _fmt(ratio),
        ]) + " |")
    return out


def _inference_table(rows: list[dict]) -> list[str]:
    out = ["| case | impl | steps | CFG | options | status | s/image (median) | DiT forwards | peak GiB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append("| " + " | ".join([
            r["case"], r["impl"], str(r["num_inference_steps"]), _fmt(r.get("cfg_scale")), _options(r),
            r["status"], _fmt(r.get("s_per_image")), str(r.get("dit_forwards", "–")), _fmt(r.get("peak_mem_gib")),
        ]) + " |")
    return out


def _numerics_lines(meta: dict) -> list[str]:
    """The bf16 checks (``numerics.py``, the inference parity) as a short list."""
    num, par = meta.get("numerics") or {}, meta.get("inference_parity")
    out = []
    loss = num.get("loss_parity") or {}
    if "rel_diff" in loss:
        out.append(f"- training loss, ours vs `FlowMatchSFTLoss` (same σ and noise): {loss['ours']:.6g} vs "
                   f"{loss['stock']:.6g}, relative difference {loss['rel_diff']:.1e}")
    swap = num.get("block_swap_parity") or {}
    if "grads" in swap:
        out.append(f"- block swapping ({swap['blocks_to_swap']} blocks): loss equal {swap['loss_equal']}, "
                   f"{swap['grads_equal']}/{swap['grads']} LoRA gradients bit-identical "
                   f"(largest difference {swap['max_abs_grad_diff']:.1e})")
    lora = num.get("lora_branch") or {}
    if "median_rel_err" in lora:
        out.append(f"- unmerged LoRA ({lora['dtype']}) vs merged fp32, {lora['layers']} layers of block "
                   f"{lora['block']}: relative error median {lora['median_rel_err']:.1e}, worst "
                   f"{lora['max_rel_err']:.1e} ({lora['worst_layer']})")
    out += [f"- {check['line']}" for check in num.values() if isinstance(check, dict) and "line" in check]
    for name, check in num.items():
        if isinstance(check, dict) and "error" in check:
            out.append(f"- {name.replace('_', ' ')}: not measured ({check['error']})")
    if par:
        out.append(f"- `Editor` final latents vs `QwenImagePipeline.__call__` after {par['steps']} steps "
                   f"({par.get('dtype', '?')}): relative difference {par['rel_diff_latents']:.1e}")
    return ["", "## Numerics", ""] + out if out else []


def markdown_report(rows: Sequence[dict], gpu: str, date: str, meta: dict | None = None) -> str:
    """The human-readable table (training rows, then inference rows, then the numerics) with the environment."""
    rows = list(rows)
    train = [r for r in rows if r.get("script") == "train_step"]
    infer = [r for r in rows if r.get("script") == "inference"]
    envs = sorted({f"torch {r.get('torch')}, diffsynth {r.get('diffsynth')}, peft {r.get('peft', '?')}"
                   for r in rows})
    lines = [f"# Benchmarks on {gpu}, {date}", "",
             "Generated by `benchmarks/gpu_all.sh` (`train_step.py`, `train21.py`, `inference.py`, `inference21.py`) "
             "(columns: `benchmarks/README.md`).", ""]
    lines += [f"Environment: {e}" for e in envs]
    if any(r.get("tiny") for r in rows):
        lines += ["", "**Tiny smoke-test rows: the numbers are not meaningful timings.**"]
    matmul = sorted({r.get("matmul_tflops") for r in rows if r.get("matmul_tflops")})
    if matmul:
        lines += ["", "Measured matmul rate (MFU denominator): " + ", ".join(f"{_fmt(m)} TFLOP/s" for m in matmul)]
    if train:
        lines += ["", "## LoRA training step", ""] + _train_table(train)
    if infer:
        lines += ["", "## Edit inference", ""] + _inference_table(infer)
    lines += _numerics_lines(meta or {})
    return "\n".join(lines) + "\n"


def start_run(cfg) -> tuple[torch.device, torch.dtype, dict[str, Any], str]:
    """Shared opening of both benchmarks: logging (script runs only; under pytest or an app their
    logging stays), the device/dtype, the environment facts every row carries, and the date."""
    from diffsynth_qie.utils.logging import setup_logging

    if not logging.getLogger().handlers:
        setup_logging(cfg.log_level)
    device, dtype = resolve_device(cfg.tiny, cfg.device)
    return device, dtype, env_info(device), today()
