"""Fit the time model's H200 table on the measured rows, check it leave-one-out, and derive the other GPUs' tables.

Inputs: the fake-device profiles of the measured rows (``benchmarks/results/timemodel-profiles.json``, from
``python -m benchmarks.timemodel_rows``) and the measured seconds (``benchmarks/results/<gpu>-<date>.json``).
Fitted (in log space, least squares over every row): the bf16 GEMM rate, the thin-GEMM bandwidth, cuDNN
attention's forward and backward rates, the elementwise bandwidth, the launch floor, and flash attention's rate
relative to cuDNN's. Rows whose measured peak is within 3 % of the GPU's memory are flagged "near capacity"
(the caching allocator's retries slow them, which no kernel count sees) and left out of the fit.

Leave-one-out: each row is predicted by a fit made without it. Writes ``diffsynth_qie/fakegpu/gpus/h200.json``
(fitted), the datasheet-derived tables (H100 SXM, A100, L40S, RTX 4090 / 5090) and
``benchmarks/results/timemodel-accuracy.md``.

    python -m benchmarks.timemodel_fit [--measured benchmarks/results/nvidia-h200-2026-11-26.json]
    python -m benchmarks.timemodel_fit --compare RESULTS_DIR [--table TABLE.json]   # no fit: predicted vs measured
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
from pathlib import Path

from diffsynth_qie.fakegpu.costs import Profile
from diffsynth_qie.fakegpu.timemodel import TABLES, GpuTable, load_table, predict

RESULTS = Path(__file__).with_name("results")
log = logging.getLogger("timemodel_fit")
NEAR_CAPACITY = 0.97
# each fitted parameter's start and physical bounds on an H200 (datasheet: 989 TFLOP/s bf16, 4.8 TB/s): a fit
# free of bounds trades the classes against each other (GEMMs above peak, a free attention backward)
BOUNDS = {"gemm": (760, 450, 989), "conv": (200, 30, 900), "thin": (2.8, 0.5, 4.8), "att_fwd": (600, 250, 989),
          "att_bwd": (500, 200, 989), "elementwise": (2.8, 1.0, 4.8), "launch": (2.0, 0.5, 10.0),
          "flash": (0.7, 0.3, 1.2)}
# dense datasheet figures (bf16 / fp8 tensor TFLOP/s with fp32 accumulation, HBM TB/s, GiB usable, host link GB/s)
DATASHEET = {
    "h200": dict(name="NVIDIA H200 SXM", bf16=989, fp8=1979, hbm=4.8, gib=139.8, h2d=50, aliases=["H200", "H200 SXM"]),
    "h100": dict(name="NVIDIA H100 SXM", bf16=989, fp8=1979, hbm=3.35, gib=79.2, h2d=50,
                 aliases=["H100", "H100 SXM", "H100 80GB HBM3"]),
    "a100": dict(name="NVIDIA A100 80GB SXM", bf16=312, fp8=None, hbm=2.04, gib=79.2, h2d=25,
                 aliases=["A100", "A100-SXM4-80GB", "A100 80GB"]),
    "l40s": dict(name="NVIDIA L40S", bf16=362, fp8=733, hbm=0.864, gib=44.4, h2d=25, aliases=["L40S"]),
    "rtx4090": dict(name="NVIDIA GeForce RTX 4090", bf16=165, fp8=330, hbm=1.008, gib=23.5, h2d=25,
                    aliases=["4090", "RTX 4090", "GeForce RTX 4090"]),
    "rtx5090": dict(name="NVIDIA GeForce RTX 5090", bf16=209, fp8=419, hbm=1.792, gib=31.4, h2d=50,
                    aliases=["5090", "RTX 5090", "GeForce RTX 5090"]),
}


def table_of(x: dict, base: GpuTable, name: str = "h200") -> GpuTable:
    """The H200 table with the fitted parameters ``x``."""
    return dataclasses.replace(
        base, gemm_tflops={**base.gemm_tflops, "bfloat16": x["gemm"], "float16": x["gemm"]},
        thin_gemm_tbps=x["thin"], elementwise_tbps=x["elementwise"], launch_us=x["launch"], conv_tflops=x["conv"],
        attention_tflops={"cudnn": (x["att_fwd"], x["att_bwd"]),
                          "flash": (x["att_fwd"] * x["flash"], x["att_bwd"] * x["flash"]),
                          "efficient": (x["att_fwd"] * x["flash"], x["att_bwd"] * x["flash"])})


def predict_row(row: dict, table: GpuTable) -> float:
    """Seconds of a measured row: a training step, or an edit (its denoising steps from the 2 run)."""
    from diffsynth_qie.preflight.timing import edit_estimate

    profile = Profile.from_json(row["profile"])
    if row["kind"] != "edit":
        return predict(profile, table, backend=row["backend"]).seconds
    return edit_estimate(profile, table, row["steps"], row["steps_run"]).seconds


def fit(rows: list[dict], measured: dict, base: GpuTable, start: dict) -> dict:
    from scipy.optimize import least_squares

    names = list(start)

    def residuals(logx):
        x = dict(zip(names, map(math.exp, logx)))
        table = table_of(x, base)
        return [math.log(predict_row(r, table) / measured[r["id"]]) for r in rows]

    lo, hi = [math.log(BOUNDS[n][1]) for n in names], [math.log(BOUNDS[n][2]) for n in names]
    x0 = [min(max(math.log(start[n]), a + 1e-6), b - 1e-6) for n, a, b in zip(names, lo, hi)]
    res = least_squares(residuals, x0, bounds=(lo, hi), method="trf")
    return dict(zip(names, map(math.exp, res.x)))


def derived(key: str, fitted: GpuTable, fitted_key: str = "h200") -> GpuTable:
    """A GPU's table from the fitted one's efficiencies and the datasheets' ratios."""
    me, ref = DATASHEET[key], DATASHEET[fitted_key]
    flops, bw = me["bf16"] / ref["bf16"], me["hbm"] / ref["hbm"]
    gemm = {d: r * flops for d, r in fitted.gemm_tflops.items() if d != "float8_e4m3fn"}
    if me["fp8"]:
        gemm["float8_e4m3fn"] = fitted.gemm_tflops["float8_e4m3fn"] * me["fp8"] / ref["fp8"]
    source = ("H200 fit x datasheet ratios (same compute, 3.35 vs 4.8 TB/s); not yet measured" if key == "h100"
              else "datasheet ratios applied to the H200 fit")
    return dataclasses.replace(
        fitted, key=key, name=me["name"], aliases=tuple(me["aliases"]), source=source,
        accuracy="±15 % until measured" if key == "h100" else "datasheet, ±25 %", memory_gib=me["gib"],
        matmul_tflops=fitted.matmul_tflops * flops, gemm_tflops=gemm, hbm_tbps=me["hbm"],
        thin_gemm_tbps=fitted.thin_gemm_tbps * bw, elementwise_tbps=fitted.elementwise_tbps * bw,
        attention_tflops={k: (f * flops, b * flops) for k, (f, b) in fitted.attention_tflops.items()},
        conv_tflops=fitted.conv_tflops * flops,
        h2d_gbps=me["h2d"])


def seconds_of(row: dict) -> float:
    return row.get("median_s") or row["s_per_image"]


def compare(results: Path, profiles: list, table_path) -> None:
    """Each measured row of a run (``results/*.json``) beside the time model's prediction, with the shipped table
    of that GPU and with ``table_path`` (a table measured by ``calibrate_gpu``); rows without a profile skipped."""
    from diffsynth_qie.fakegpu.timemodel import gpu_table

    rows = [r for f in sorted(Path(results).glob("*.json")) if f.name != "gpu-table.json"
            for r in json.loads(f.read_text()).get("rows", []) if r.get("status") == "ok"]
    by_id = {p["id"]: p for p in profiles}
    gpu = next((r.get("gpu") for r in rows if r.get("gpu")), None)
    tables = {"shipped": gpu_table(gpu)}
    if table_path and Path(table_path).exists():
        tables["measured here"] = load_table(Path(table_path))
    lines = ["| row | measured s | alloc retries | " + " | ".join(f"{k} s (error)" for k in tables) + " |",
             "|---|---|---|" + "---|" * len(tables)]
    for r in rows:
        if r["id"] in by_id:
            cells = [f"{predict_row(by_id[r['id']], t):.3f} ({100 * (predict_row(by_id[r['id']], t) / seconds_of(r) - 1):+.1f} %)"
                     for t in tables.values()]
            lines.append(f"| {r['id']} | {seconds_of(r):.3f} | {r.get('alloc_retries')} | " + " | ".join(cells) + " |")
    text = "\n".join([f"# Time model beside the measured rows ({gpu}; shipped table: {tables['shipped'].key})", "",
                      *lines, ""])
    (Path(results) / "timemodel-compare.md").write_text(text)
    log.info("%s", text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measured", default=str(RESULTS / "nvidia-h200-2026-11-26.json"))
    p.add_argument("--profiles", default=str(RESULTS / "timemodel-profiles.json"))
    p.add_argument("--compare", default=None, metavar="RESULTS_DIR", help="print predicted beside measured; no fit")
    p.add_argument("--table", default=None, help="--compare: also predict with this table")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.compare:
        return compare(Path(args.compare), json.loads(Path(args.profiles).read_text())["rows"], args.table)
    data = json.loads(Path(args.measured).read_text())
    measured_rows = {r["id"]: r for r in data["rows"] if r.get("status") == "ok"}
    rows = [r for r in json.loads(Path(args.profiles).read_text())["rows"] if r["id"] in measured_rows]
    base = load_table(TABLES / "h200.json")
    measured = {i: seconds_of(r) for i, r in measured_rows.items()}
    near = {r["id"] for r in rows if (measured_rows[r["id"]].get("peak_mem_gib") or 0) >= NEAR_CAPACITY * base.memory_gib}
    fitted_rows = [r for r in rows if r["id"] not in near]
    start = {name: b[0] for name, b in BOUNDS.items()}
    x = fit(fitted_rows, measured, base, start)
    table = table_of(x, base)
    lines = ["| row | measured s | fitted on all, s | leave-one-out s | LOO error |", "|---|---|---|---|---|"]
    errors, result = [], {}
    for r in rows:
        held = r["id"] in near
        loo = table if held else table_of(fit([q for q in fitted_rows if q is not r], measured, base, start), base)
        pred_all, pred_loo = predict_row(r, table), predict_row(r, loo)
        err = pred_loo / measured[r["id"]] - 1
        result[r["id"]] = (pred_all, pred_loo)
        if not held:
            errors.append(abs(err))
        lines.append(f"| {r['id']} | {measured[r['id']]:.3f} | {pred_all:.3f} | {pred_loo:.3f} | {100 * err:+.1f} %"
                     f"{' (near capacity: not fitted)' if held else ''} |")
    ratios = []
    for r in rows:  # ours / stock at the same shapes
        if "/stock/" in r["id"] and r["id"] not in near:
            ours = r["id"].replace("/stock/stock/", "/ours/ours/").replace("train21/stock/", "train21/ours/")
            if ours in result:
                meas = measured[ours] / measured[r["id"]]
                pred = result[ours][1] / result[r["id"]][1]
                ratios.append(f"- {ours.split('/compile')[0]}: ours/stock measured {meas:.3f}, predicted "
                              f"(leave-one-out) {pred:.3f} ({100 * (pred / meas - 1):+.1f} %)")
    median, worst = statistics.median(errors), max(errors)
    summary = (f"{len(fitted_rows)} rows fitted ({len(near)} near capacity left out); leave-one-out median "
               f"|error| {100 * median:.1f} %, worst {100 * worst:.1f} %")
    table = dataclasses.replace(table, source=f"fitted on {len(fitted_rows)} measured rows ({Path(args.measured).name})",
                                accuracy=f"leave-one-out median {100 * median:.1f} %, worst {100 * worst:.1f} %")
    (TABLES / "h200.json").write_text(json.dumps(table.to_json(), indent=2, ensure_ascii=False) + "\n")
    for key in DATASHEET:
        if key != "h200":
            (TABLES / f"{key}.json").write_text(json.dumps(derived(key, table).to_json(), indent=2, ensure_ascii=False) + "\n")
    params = ", ".join(f"{k} {v:.3g}" for k, v in x.items())
    md = "\n".join([f"# Time model accuracy ({Path(args.measured).name})", "", summary, "",
                    f"Fitted: {params} (TFLOP/s, TB/s, µs, flash/cuDNN).", "", *lines, "", *ratios, ""])
    (RESULTS / "timemodel-accuracy.md").write_text(md)
    log.info("%s", md)


if __name__ == "__main__":
    main()
