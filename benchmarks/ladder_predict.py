"""The speed ladder as the time model predicts it: each rung's training step on the H200 and H100 tables.

    python -m benchmarks.ladder_predict                    # 2511 and 2.1, every rung, h200 and h100
    python -m benchmarks.ladder_predict --model 2511 --rungs 1 1+2 --gpus h200

Rungs (each a set of ``qie train`` flags over the last; a rung whose flag this version lacks is printed as
skipped):

- ``baseline``: the step as the 2026-11-26 benchmarks ran it (autocast, PEFT's fp32 input copies), from the
  profile stored in ``benchmarks/results/timemodel-profiles.json``; ``stock``: DiffSynth's own step, the same;
- ``1``: ``qie train``'s default (pure bf16 over fp32 LoRA weights, fused AdamW);
- ``1+2``: ``--compile --checkpoint_policy selective`` (the checkpoint inside the compiled blocks);
- ``1+2+3``: and ``--checkpoint_blocks auto`` (only as many blocks recompute as memory requires);
- ``+4``: ``--fp8_compute`` on top of ``1+2`` (FP8 GEMMs on the frozen base: it changes the numerics).

Each rung prints s/step, samples/s, × stock (samples/s over stock's) and MFU. A prediction, not a measurement:
``gpu_all.sh --ladder`` prints the same beside what it measures. The counted steps run on the fake device at
1 and 2 blocks (about a minute of CPU each).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("benchmarks.ladder_predict")
PROFILES = Path(__file__).parent / "results" / "timemodel-profiles.json"
RUNGS = {"1": {}, "1+2": {"compile": True, "checkpoint_policy": "selective"},
         "1+2+3": {"compile": True, "checkpoint_policy": "selective", "checkpoint_blocks": "auto"},
         "+4": {"compile": True, "checkpoint_policy": "selective", "fp8_compute": True}}
STORED = {"2511": {"stock": "train_step/stock/stock/b1/r32/ckpt=on/compile_blocks=False,fp8_base=False,lora_fp32=True,"
                            "sdpa_backend=auto",
                   "baseline": "train_step/ours/ours/b1/r32/ckpt=on/compile_blocks=False,fp8_base=False,"
                               "lora_fp32=True,sdpa_backend=auto"},
          "2.1": {"stock": "train21/stock/b1/refs=1/r32/ckpt=on", "baseline": "train21/ours/b1/refs=1/r32/ckpt=on"}}


def missing_flags(flags: dict) -> list:
    """The rung's flags this version's ``qie train`` does not have (the rung is then skipped)."""
    from diffsynth_qie.training.config import TrainConfig

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return sorted(k for k in flags if k not in known)


def stored_estimate(row_id: str, table):
    from diffsynth_qie.fakegpu.costs import Profile
    from diffsynth_qie.fakegpu.timemodel import predict

    rows = {r["id"]: r for r in json.loads(PROFILES.read_text())["rows"]}
    row = rows[row_id]
    return predict(Profile.from_json(row["profile"]), table, backend=row.get("backend", "auto"),
                   sections=("forward", "backward", "optimizer step"), model_sections=("forward",))


def rung_config(model: str, flags: dict):
    """The resolved ``RunConfig`` of the rung's ``qie train`` (b1, checkpointing, the rung's flags) and the preset."""
    from diffsynth_qie.commands.plan_verify import train_config
    from diffsynth_qie.memory.plan import PlanOptions

    args = argparse.Namespace(model=model, loss="sft", ema_decay=0.0)
    cfg, preset = train_config(args, PlanOptions(gradient_checkpointing=True))
    flags = {**flags, "fp8_base": True} if flags.get("fp8_compute") else flags  # (as qie train resolves it)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **flags)), preset


def rung_estimates(model: str, flags: dict, tables: list) -> list:
    """The rung's counted step (one pass at each depth), costed on every table."""
    from diffsynth_qie.preflight.timing import predict_train, timing_runs
    from diffsynth_qie.preflight.train_step import batch_shapes

    cfg, preset = rung_config(model, flags)
    shapes = batch_shapes(1024, 1, 300, 1, multiple=32 if model.startswith("2.1") else 16)
    reports = timing_runs(cfg, preset, shapes)
    return [predict_train(cfg, preset, shapes, table.key, reports=reports).estimate for table in tables]


def row(label: str, estimate, stock_seconds: float) -> str:
    s = estimate.seconds
    return f"| {label} | {s:.3f} | {1 / s:.2f} | {stock_seconds / s:.2f}x | {100 * estimate.mfu:.0f} % |"


def main(argv=None) -> int:
    from diffsynth_qie.fakegpu.timemodel import gpu_table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["2511", "2.1"], choices=sorted(STORED))
    p.add_argument("--rungs", nargs="+", default=list(RUNGS), choices=list(RUNGS))
    p.add_argument("--gpus", nargs="+", default=["h200", "h100"])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tables = [gpu_table(g) for g in args.gpus]
    out = []
    for model in args.model:
        stock = [stored_estimate(STORED[model]["stock"], t) for t in tables]
        lines = {t.key: [] for t in tables}
        for t, s in zip(tables, stock):
            lines[t.key] += [row("stock (DiffSynth)", s, s.seconds),
                             row("baseline (2026-11-26)", stored_estimate(STORED[model]["baseline"], t), s.seconds)]
        for rung in args.rungs:
            absent = missing_flags(RUNGS[rung])
            if absent:
                for t in tables:
                    lines[t.key].append(f"| {rung} | skipped: no {', '.join('--' + a for a in absent)} | | | |")
                continue
            for t, s, e in zip(tables, stock, rung_estimates(model, RUNGS[rung], tables)):
                lines[t.key].append(row(rung, e, s.seconds))
        for t in tables:
            out.append(f"\n{model}, b1, 1024² + 1 reference, rank 32, predicted on {t.name} [{t.source}]\n\n"
                       "| rung | s/step | samples/s | × stock | MFU |\n|---|---|---|---|---|\n"
                       + "\n".join(lines[t.key]))
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
