"""`qie plan` against `qie plan --verify`'s fake-device peak, for Qwen-Image-Edit-2511 and Qwen-Image-2.1,
training and editing, at full size (every block), with the verify seconds.

    python -m benchmarks.verify_plan [--only SUBSTRING] [--out table.md]

Each row parses the `qie plan` flags shown, predicts with `memory/plan.py`, runs the same configuration on the
fake CUDA device as `qie plan --verify` does (`commands/plan_verify.fake_run`), and compares like with like:
the plan without its CUDA-context allowance and without the terms the run does not build (named in the last
column: the 2.1 edit is the DiT part, without its prompt encoder and VAE). A few minutes on two CPU cores; the
CPU seconds are the process's own (the wall seconds grow with whatever else the machine runs).
"""
from __future__ import annotations

import argparse
import logging
import time

log = logging.getLogger("verify_plan")
GiB = 1024 ** 3

CONFIGS = [  # (label, qie plan flags)
    ("2511 train, defaults", "--model 2511"),
    ("2511 train, batch 4 mixed shapes, LBM", "--model 2511 --batch_size 4 --mixed --loss lbm"),
    ("2511 train, rank 128", "--model 2511 --lora_rank 128"),
    ("2511 train, 2048²", "--model 2511 --resolution 2048"),
    ("2511 train, fp8 base, no checkpointing", "--model 2511 --fp8_base --no-gradient_checkpointing"),
    ("2511 train, on the fly", "--model 2511 --on_the_fly"),
    ("2511 train, EMA, validate with both", "--model 2511 --ema_decay 0.999 --validate_with both"),
    ("2511 edit, defaults (CFG 4)", "--model 2511 --task edit"),
    ("2511 edit, 3 references", "--model 2511 --task edit --ref_images 3"),
    ("2511 edit, 2 stacked LoRAs", "--model 2511 --task edit --loras 32 32"),
    ("2.1 train, 1 reference", "--model 2.1"),
    ("2.1 train, 10 references", "--model 2.1 --ref_images 10"),
    ("2.1 edit, 1 reference, CFG 1", "--model 2.1 --task edit --no_cfg"),
    ("2.1 edit, 3 references, CFG 4", "--model 2.1 --task edit --ref_images 3"),
    ("2.1 edit, 10 references, CFG 1", "--model 2.1 --task edit --ref_images 10 --no_cfg"),
    ("2.1 edit, 10 references, CFG 4", "--model 2.1 --task edit --ref_images 10"),
]


def row(label: str, flags: str) -> str:
    from diffsynth_qie.commands import plan as plan_cmd
    from diffsynth_qie.commands.plan_verify import fake_run, planned_like
    from diffsynth_qie.memory.plan import predict

    parser = argparse.ArgumentParser()
    plan_cmd.add_arguments(parser)
    args = parser.parse_args(flags.split() + ["--verify"])
    options = plan_cmd.options_of(args)
    plan = predict(plan_cmd._census(args), options)
    t0, c0 = time.perf_counter(), time.process_time()
    run = fake_run(args, options)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    like, _ = planned_like(args, options, plan, run)
    left_out = ", ".join(run.uncovered) or "–"
    return (f"| {label} | `{flags}` | {run.peak / GiB:.2f} | {like / GiB:.2f} | {100 * (like / run.peak - 1):+.1f} % "
            f"| {plan.gpu_peak / GiB:.2f} | {seconds:.0f} | {cpu:.0f} | {left_out} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="run the rows whose label contains this")
    parser.add_argument("--out", default=None, help="also write the table to this Markdown file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    rows = ["| configuration | `qie plan` flags | fake-device peak (GiB) | plan, same terms (GiB) | plan vs fake | "
            "whole plan (GiB) | verify s (wall) | verify s (CPU) | plan terms not run |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for label, flags in CONFIGS:
        if args.only and args.only not in label:
            continue
        rows.append(row(label, flags))
        log.info(rows[-1])
    table = "\n".join(rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
