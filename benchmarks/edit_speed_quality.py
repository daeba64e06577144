"""Step caching: DiT calls saved against quality, on the pretrained tiny bases of both families.

    python -m benchmarks.edit_speed_quality                 # the levels (off, balanced, fast), both families
    python -m benchmarks.edit_speed_quality --sweep         # and a threshold sweep of both methods
    python -m benchmarks.edit_speed_quality --calibrate     # first re-measure the schedule method's curves
    python -m benchmarks.edit_speed_quality --time_model    # and the time model's H100 / H200 seconds (minutes)

The CPU demo's held-out rows ("make the red circle blue", 64², ``data/demo.py``) are edited by the demo's LoRA
(trained first on the demo's training rows, ``--lora_steps``; 0 edits with the base alone, whose edit PSNR barely
moves since it does not make the edit) at 40 steps, true CFG 4 (the defaults of ``qie edit`` on
Qwen-Image-Edit), without their masks (so a cache's error can reach every pixel), once exactly and once per
setting. Per setting:

- **calls saved**: DiT calls whose blocks were reused (``first_block``: every block but the first ran);
- **PSNR / LPIPS vs exact**: the output against the exact (uncached) output of the same row and seed; LPIPS
  only where its backbone weights are on the machine (``metrics/lpips.py``), else ``n/a``;
- **edit PSNR / preservation**: the scorecard of ``qie eval-edits`` (``inference/evaluate.py``,
  ``metrics/scorecard.py``): PSNR to the target inside the row's edit region, and to the source outside it;
  Δ against the exact edit;
- **predicted s/image**: a call-count prediction, not a measurement: the measured H200 edit
  (``benchmarks/results/nvidia-h200-2026-11-26.md``: 2511 at 40 steps CFG 4, 34.6 s for 40 DiT calls of the CFG
  batch, DiffSynth's pipeline 34.9 s; 2.1 at 40 steps CFG 4, one reference, with its prefix KV cache, 13.1 s for
  80 calls) scaled by the DiT calls run, a ``first_block`` reuse costing one block of the real DiT's (60 for 2511,
  32 for 2.1). An H100 has the same dense bf16 FLOP rate, so the FLOP count predicts the same seconds there
  (its lower memory bandwidth, which the element-wise third of a step feels, is not modelled);
- **time model H100 / H200 s** (``--time_model``): the fake-device time model's seconds (``docs/SPEED.md``) of
  the real model's 1024² edit with one reference, the steps after the first scaled by the DiT work left.

``--calibrate`` runs the demo's training rows (never the held-out ones) exactly, records the blocks' mean
residual magnitude at every σ, and writes ``diffsynth_qie/models/samplers/step_cache_curves.json`` (one curve
per family, measured on its tiny base). Tiny models have 2 blocks: their quality numbers are what caching does to
these models, not a promise for the 20 B one.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
from pathlib import Path

log = logging.getLogger("edit_speed_quality")

#: the measured H200 edit per family (see the module docstring): seconds, DiT calls, DiffSynth's seconds,
#: blocks of the real DiT
MEASURED = {"qwen-image-edit": (34.6, 40, 34.9, 60), "qwen-image-2.1": (13.1, 80, None, 32)}
STEPS, CFG = 40, 4.0
SWEEP = {"first_block": (0.03, 0.05, 0.08, 0.12, 0.16, 0.2, 0.3), "schedule": (0.05, 0.1, 0.2, 0.3, 0.5, 0.8)}


def predicted_seconds(family: str, stats, method: str | None) -> float:
    """The measured H200 edit's seconds scaled by the DiT work this run's calls did (module docstring)."""
    seconds, calls, _, blocks = MEASURED[family]
    if stats is None or not stats.calls:
        return seconds
    reuse_cost = 1.0 / blocks if method == "first_block" else 0.0
    work = (stats.calls - stats.skipped + stats.skipped * reuse_cost) / stats.calls
    return seconds * work


#: the real preset each tiny base stands for, for ``--time_model``
REAL = {"qwen-image-edit": "2511", "qwen-image-2.1": "2.1"}
GPUS = ("h100", "h200")


def time_model(family: str) -> dict:
    """``--time_model``: the fake-device time model's pieces of the real model's 1024² edit (one reference, 40
    steps, CFG 4) per GPU: (seconds of the encoding, first step and decode, seconds of each later step)."""
    from diffsynth_qie.fakegpu.timemodel import gpu_table, predict
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.preflight.edit_step import verify_edit
    from diffsynth_qie.preflight.timing import DEPTHS, full_depth, step_profile

    preset = get_preset(REAL[family])
    reports = [verify_edit(preset, steps=2, cfg=CFG, num_layers=n, costs=True) for n in DEPTHS]
    profile = step_profile(reports, full_depth(preset))
    out = {}
    for gpu in GPUS:
        table = gpu_table(gpu)
        out[gpu] = (predict(profile, table, sections=("encode", "denoise", "decode")).seconds,
                    predict(profile, table, sections=("denoise_next",)).seconds)
    return out


def time_model_seconds(pieces: tuple, stats, method: str | None, family: str) -> float:
    """The time model's seconds with a step cache: the later steps' DiT work scaled by what the cache left (the
    first step is never reused)."""
    once, later = pieces
    if stats is None or not stats.calls:
        return once + (STEPS - 1) * later
    reuse_cost = 1.0 / MEASURED[family][3] if method == "first_block" else 0.0
    later_calls = stats.calls * (STEPS - 1) / STEPS
    work = 1.0 - stats.skipped * (1.0 - reuse_cost) / later_calls
    return once + (STEPS - 1) * later * work


def _editor(model: str, data: Path, lora_steps: int):
    """The tiny base of ``model`` with the demo's LoRA trained for ``lora_steps`` (none with 0)."""
    import torch

    from diffsynth_qie.inference import Editor
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.training.pretrain_tiny import ensure_pretrained_tiny

    base = ensure_pretrained_tiny(model=model)
    editor = Editor(load_pipeline(model, model_dir=base, device="cpu", torch_dtype=torch.float32))
    if lora_steps:
        editor.set_loras([(train_demo_lora(model, base, data, data / f"lora-{model}", lora_steps), 1.0)])
    return editor


def train_demo_lora(model: str, base, data: Path, out: Path, steps: int) -> str:
    """The CPU demo's LoRA ("make the red circle blue") on ``model``'s tiny base: ``steps`` steps of batch 4, rank
    16, lr 1e-3 on the demo's training rows (``tests/test_demo_learns.py``'s recipe); returns its file."""
    from accelerate.state import AcceleratorState, GradientState

    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.formats import DatasetConfig
    from diffsynth_qie.training import config as tc
    from diffsynth_qie.training.loop import train

    write_cache(CacheConfig(cache_dir=str(out / "cache"), model=model, model_dir=str(base), max_pixels=16384,
                            num_workers=1, device="cpu", dtype="float32",
                            dataset=DatasetConfig(dataset_metadata=str(data / "metadata.json"))), rank=0, world_size=1)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return str(train(tc.RunConfig(
        train=tc.TrainConfig(cache_dir=str(out / "cache"), output_dir=str(out / "run"), model=model,
                             model_dir=str(base), batch_size=4, max_steps=steps, mixed_precision="no",
                             gradient_checkpointing=False, cfg_dropout=0.0, save_every=0, seed=0, device="cpu"),
        lora=tc.LoRAConfig(lora_rank=16), optim=tc.OptimConfig(learning_rate=1e-3))).lora_path)


def calibrate(editor, cases) -> dict:
    """The blocks' residual magnitude curve of ``editor``'s model from exact edits of ``cases``."""
    from diffsynth_qie.inference import EditRequest
    from diffsynth_qie.models.samplers.step_cache import CacheSettings, curve_from_samples

    record = CacheSettings("first_block", threshold=0.0, record=True)  # (a threshold of 0 reuses nothing)
    samples = []
    for case in cases:
        w, h = case.target.size
        result = editor.edit(EditRequest(images=case.images, prompt=case.prompt, steps=STEPS, cfg=CFG, seed=0,
                                         width=w, height=h, cache=record))
        samples += result.cache.magnitudes
    where = f"{editor.preset.name} (pretrained tiny base), {STEPS} steps, CFG {CFG:g}, {len(cases)} demo rows"
    return curve_from_samples(samples, where).to_json()


def write_curves(curves: dict) -> Path:
    from diffsynth_qie.models.samplers import step_cache
    from diffsynth_qie.utils.atomic import atomic_write_json

    step_cache.CURVES_FILE.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(step_cache.CURVES_FILE, {"format": 1, "curves": curves})
    step_cache._stored_curves.cache_clear()
    return step_cache.CURVES_FILE


def _mean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def run_setting(editor, cases, cache, lpips_model, exact=None) -> dict:
    """One setting over ``cases``: outputs, scorecard means, cache stats, and the distance to ``exact``'s outputs."""
    from diffsynth_qie.inference.evaluate import evaluate, psnr
    from diffsynth_qie.metrics.image import ssim, to_pixels

    report = evaluate(editor, cases, use_mask=False, steps=STEPS, cfg=CFG, seed=0, cache=cache)
    stats = [s for s in report.cache if s is not None]
    row = {"outputs": report.outputs,
           "calls": sum(s.calls for s in stats), "skipped": sum(s.skipped for s in stats),
           "edit_psnr": _mean(c.get("edit_psnr") for c in report.scores),
           "preserve_psnr": _mean(c.get("preserve_psnr") for c in report.scores),
           "psnr_target": report.mean_psnr}
    if exact is not None:
        row["psnr_exact"] = _mean(min(psnr(a, b), 99.0) for a, b in zip(report.outputs, exact["outputs"]))
        row["ssim_exact"] = _mean(float(ssim(to_pixels([a]), to_pixels([b]))[0])
                                  for a, b in zip(report.outputs, exact["outputs"]))
        if lpips_model is not None:
            from diffsynth_qie.metrics.lpips import lpips_distance

            row["lpips_exact"] = _mean(float(lpips_distance(lpips_model, to_pixels([a]), to_pixels([b]))[0])
                                       for a, b in zip(report.outputs, exact["outputs"]))
    return row


def settings_to_run(sweep: bool) -> list[tuple[str, object]]:
    from diffsynth_qie.models.samplers.step_cache import LEVELS, cache_settings

    out: list[tuple[str, object]] = [("off", "off")]
    for level in ("balanced", "fast"):
        for method in LEVELS[level]:
            out.append((f"{level} ({method})", cache_settings(level, method)))
    if sweep:
        for method, thresholds in SWEEP.items():
            for max_skips in (2, 4):
                for t in thresholds:
                    base = cache_settings("balanced", method)
                    out.append((f"{method} {t:g} ×{max_skips}",
                                type(base)(method, t, base.warmup, max_skips)))
    return out


def bench_model(model: str, data: Path, args, lpips_model, curves: dict | None) -> list[dict]:
    from diffsynth_qie.inference.evaluate import load_cases
    from diffsynth_qie.models.presets import family_of

    heldout = load_cases(str(data / "heldout.json"))
    family = family_of(model).name
    if curves is not None:  # the base's own curve, measured before a LoRA is attached
        curves[family] = calibrate(_editor(model, data, 0), load_cases(str(data / "metadata.json"), limit=8))
        write_curves(curves)
    editor = _editor(model, data, args.lora_steps)
    sweep = args.sweep
    pieces = time_model(family) if args.time_model else None
    exact = run_setting(editor, heldout, "off", lpips_model)
    rows = []
    for name, cache in settings_to_run(sweep):
        row = exact if cache == "off" else run_setting(editor, heldout, cache, lpips_model, exact)
        method = None if cache == "off" else cache.method
        seconds = predicted_seconds(family, _Stats(row["calls"], row["skipped"]), method)
        stock = MEASURED[family][2]
        rows.append({"model": model, "setting": name, "method": method,
                     "saved": row["skipped"] / row["calls"] if row["calls"] else 0.0,
                     "psnr_exact": row.get("psnr_exact", 99.0), "ssim_exact": row.get("ssim_exact", 1.0),
                     "lpips_exact": row.get("lpips_exact", 0.0
                                                                                       if cache == "off" else None),
                     "edit_psnr": row["edit_psnr"], "d_edit": row["edit_psnr"] - exact["edit_psnr"],
                     "preserve_psnr": row["preserve_psnr"], "d_preserve": row["preserve_psnr"] - exact["preserve_psnr"],
                     "seconds": seconds, "x_exact": MEASURED[family][0] / seconds,
                     "x_stock": stock / seconds if stock else None})
        if pieces is not None:
            for gpu in GPUS:
                rows[-1][f"tm_{gpu}"] = time_model_seconds(pieces[gpu], _Stats(row["calls"], row["skipped"]), method,
                                                           family)
        log.info("%s %-24s saved %5.1f %%  PSNR vs exact %5.1f  edit PSNR %+.2f dB", model, name,
                 100 * rows[-1]["saved"], rows[-1]["psnr_exact"], rows[-1]["d_edit"])
    return rows


class _Stats:
    def __init__(self, calls: int, skipped: int):
        self.calls, self.skipped = calls, skipped


def markdown(rows: list[dict], rows_per_model: int, lpips: bool, lora_steps: int) -> str:
    def f(v, fmt):
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    what = f"the demo LoRA ({lora_steps} steps) on the tiny base" if lora_steps else "the tiny base"
    lines = [f"Held-out rows: {rows_per_model} per model, edited by {what}, {STEPS} steps, CFG {CFG:g}, no mask; "
             "predicted s/image: H200 (= H100 by FLOPs), a call-count prediction from the measured H200 edit.", "",
             "| model | setting | DiT calls saved | PSNR vs exact | SSIM vs exact | LPIPS vs exact | "
             "held-out edit PSNR (Δ) | preservation PSNR (Δ) | predicted s/image | × exact | × DiffSynth |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    if any("tm_h100" in r for r in rows):
        lines[2] += " time model H100 / H200 s |"
        lines[3] += "---|"
    for r in rows:
        tm = f" {r['tm_h100']:.1f} / {r['tm_h200']:.1f} |" if "tm_h100" in r else ""
        lines.append(f"| {r['model']} | {r['setting']} | {100 * r['saved']:.1f} % | {f(r['psnr_exact'], '.1f')} | "
                     f"{r['ssim_exact']:.4f} | "
                     f"{f(r['lpips_exact'], '.4f') if lpips else 'n/a'} | {r['edit_psnr']:.2f} ({r['d_edit']:+.2f}) | "
                     f"{r['preserve_psnr']:.2f} ({r['d_preserve']:+.2f}) | {r['seconds']:.1f} | "
                     f"{r['x_exact']:.2f} | {f(r['x_stock'], '.2f')} |" + tm)
    return "\n".join(lines)


def acceptance(rows: list[dict], lpips: bool) -> list[str]:
    """The levels against the targets: balanced ≥ 40 % saved within 0.3 dB (LPIPS ≤ 0.05), fast ≥ 60 % within 1 dB;
    the held-out edit PSNR and, stricter than asked (the tiny base's edit PSNR moves little), the preservation PSNR."""
    out = []
    for r in rows:
        level = r["setting"].split(" ")[0]
        if level not in ("balanced", "fast"):
            continue
        saved, within = (0.4, 0.3) if level == "balanced" else (0.6, 1.0)
        ok = r["saved"] >= saved and abs(r["d_edit"]) <= within and abs(r["d_preserve"]) <= within
        if level == "balanced" and lpips:
            ok = ok and r["lpips_exact"] is not None and r["lpips_exact"] <= 0.05
        out.append(f"{r['model']} {r['setting']}: {'meets' if ok else 'misses'} the target (saved "
                   f"{100 * r['saved']:.1f} % ≥ {100 * saved:.0f} %, |Δ edit PSNR| {abs(r['d_edit']):.2f} and "
                   f"|Δ preservation| {abs(r['d_preserve']):.2f} ≤ {within} dB"
                   f"{', LPIPS ≤ 0.05' if level == 'balanced' and lpips else ''})")
    return out


def main(argv=None) -> None:
    import torch

    from diffsynth_qie.data.demo import make_recolour_demo
    from diffsynth_qie.metrics.lpips import load_lpips
    from diffsynth_qie.utils.logging import setup_logging

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "tiny-2.1"])
    parser.add_argument("--rows", type=int, default=8, help="held-out rows per model")
    parser.add_argument("--sweep", action="store_true", help="also a threshold sweep of both methods")
    parser.add_argument("--time_model", action="store_true",
                        help="also the fake-device time model's H100 / H200 seconds of the real model's 1024² edit "
                             "(runs it at full width: a few minutes)")
    parser.add_argument("--lora_steps", type=int, default=150,
                        help="train the demo's LoRA for this many steps and edit with it (0: the base alone)")
    parser.add_argument("--calibrate", action="store_true", help="re-measure the schedule method's curves first")
    parser.add_argument("--out", default=None, help="also write the table (.md) and the rows (.json) here")
    args = parser.parse_args(argv)
    setup_logging("INFO")
    torch.set_num_threads(1)
    lpips_model = load_lpips()
    curves = None
    if args.calibrate:
        from diffsynth_qie.models.samplers.step_cache import _stored_curves

        curves = dict(_stored_curves())
    with tempfile.TemporaryDirectory() as tmp:
        data = make_recolour_demo(Path(tmp) / "demo", num_pairs=32, num_heldout=args.rows)
        rows = [r for m in args.models for r in bench_model(m, data, args, lpips_model, curves)]
    table = markdown(rows, args.rows, lpips_model is not None, args.lora_steps)
    print(table)
    print("\n".join(acceptance(rows, lpips_model is not None)))
    if args.out:
        out = Path(args.out)
        out.with_suffix(".md").write_text(table + "\n")
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
