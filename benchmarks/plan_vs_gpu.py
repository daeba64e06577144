"""Measured GPU peaks beside ``qie plan``'s prediction and ``qie plan --verify``'s fake-device count.

    python -m benchmarks.plan_vs_gpu benchmarks/results/nvidia-h200-2026-11-26.json [--verify] [--out table.md]

For every measured configuration of the GPU results (``train_step``, ``train21``, ``inference``,
``inference21``), the same configuration as ``qie plan`` flags: the plan's predicted peak without its CUDA
context allowance and without the terms the benchmark does not hold (the 2.1 sampling benchmark runs no prompt
encoder or VAE), beside the measured ``torch.cuda.max_memory_allocated``. ``--verify`` adds the fake-device run
of the same flags (a minute or so per row on two CPU cores) and stores its peaks in the results file
(``fake_device_gib``), so the next table shows them without running again. The last lines fit the training activation term
to the measured peaks: ``peak - (weights + LoRA + optimizer) = fixed + slope x tokens``, the slope as a multiple of
the plan's per-token constant, which is what ``memory/plan_terms.py``'s ``GPU_CHECKPOINTED_ACTIVATION_SCALE`` records.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger("plan_vs_gpu")
GiB = 1024 ** 3
OURS = "compile_blocks=False,fp8_base=False,lora_fp32=True,sdpa_backend=auto"
ENCODER_TERMS = ("text encoder", "VAE")  # edit terms the DiT-only 2.1 sampling benchmark does not build
MEASURED = "--compute_precision autocast"  # the training rows of 2026-11-26 ran under bf16 autocast

# (row id, label, qie plan flags, the plan's terms the benchmark does not hold)
ROWS = [
    (f"train_step/ours/ours/b1/r32/ckpt=on/{OURS}", "2511 train b1", f"--model 2511 {MEASURED}", ()),
    (f"train_step/batch/ours/b2/r32/ckpt=on/{OURS}", "2511 train b2", f"--model 2511 --batch_size 2 {MEASURED}", ()),
    (f"train_step/batch/ours/b4/r32/ckpt=on/{OURS}", "2511 train b4", f"--model 2511 --batch_size 4 {MEASURED}", ()),
    (f"train_step/mixed/ours/b4/r32/ckpt=on/{OURS}", "2511 train b4 mixed",
     f"--model 2511 --batch_size 4 --mixed {MEASURED}", ()),
    (f"train_step/ours/ours/b1/r32/ckpt=off/{OURS}", "2511 train b1, no checkpointing",
     f"--model 2511 --no-gradient_checkpointing {MEASURED}", ()),
    (f"train_step/ours/ours/b1/r32/ckpt=on/blocks_to_swap=16,{OURS}", "2511 train b1, 16 blocks swapped",
     f"--model 2511 --blocks_to_swap 16 {MEASURED}", ()),
    (f"train_step/ours/ours/b1/r32/ckpt=on/blocks_to_swap=30,{OURS}", "2511 train b1, 30 blocks swapped",
     f"--model 2511 --blocks_to_swap 30 {MEASURED}", ()),
    (f"train_step/ours/ours/b1/r32/ckpt=on/{OURS.replace('fp8_base=False', 'fp8_base=True')}",
     "2511 train b1, FP8 base", f"--model 2511 --fp8_base {MEASURED}", ()),
    ("train21/ours/b1/refs=1/r32/ckpt=on", "2.1 train b1, 1 ref", f"--model 2.1 {MEASURED}", ()),
    ("train21/ours/b4/refs=1/r32/ckpt=on", "2.1 train b4, 1 ref", f"--model 2.1 --batch_size 4 {MEASURED}", ()),
    ("train21/ours/b1/refs=3/r32/ckpt=on", "2.1 train b1, 3 refs", f"--model 2.1 --ref_images 3 {MEASURED}", ()),
    ("train21/ours/b4/refs=3/r32/ckpt=on", "2.1 train b4, 3 refs",
     f"--model 2.1 --ref_images 3 --batch_size 4 {MEASURED}", ()),
    ("inference/edit/ours/steps=40/1024px/compile_blocks=False,fp8_base=False,sdpa_backend=auto",
     "2511 edit, CFG 4", "--model 2511 --task edit --lora_rank 0", ()),
    ("inference21/cfg/refs=1/steps=40/kv_cache=True", "2.1 edit DiT, 1 ref, CFG 4",
     "--model 2.1 --task edit --lora_rank 0", ENCODER_TERMS),
    ("inference21/cfg/refs=1/steps=40/kv_cache=False", "2.1 edit DiT, 1 ref, CFG 4, no KV cache",
     "--model 2.1 --task edit --lora_rank 0 --kv_cache off", ENCODER_TERMS),
    ("inference21/cfg/refs=3/steps=40/kv_cache=True", "2.1 edit DiT, 3 refs, CFG 4",
     "--model 2.1 --task edit --lora_rank 0 --ref_images 3", ENCODER_TERMS),
    ("inference21/turbo/refs=1/steps=8/kv_cache=True", "2.1 edit DiT, 1 ref, CFG 1",
     "--model 2.1 --task edit --lora_rank 0 --no_cfg", ENCODER_TERMS),
]


def plan_of(flags: str):
    from diffsynth_qie.commands import plan as plan_cmd
    from diffsynth_qie.memory.plan import predict

    parser = argparse.ArgumentParser()
    plan_cmd.add_arguments(parser)
    args = parser.parse_args(flags.split())
    options = plan_cmd.options_of(args)
    census = plan_cmd._census(args)
    return args, options, census, predict(census, options)


def comparable(plan, left_out) -> int:
    """The plan's GPU peak without the CUDA context allowance and the terms the benchmark does not hold."""
    return sum(b for name, b in plan.gpu.items()
               if not name.startswith("CUDA context") and not any(name.startswith(t) for t in left_out))


def fake_peak(args, options) -> float:
    from diffsynth_qie.commands.plan_verify import fake_run

    args.verify, args.verify_blocks = True, None
    return fake_run(args, options).peak


def table(rows: dict, fakes: dict, verify: bool) -> list[str]:
    """The comparison; ``fakes`` (row id -> fake-device peak in GiB) is filled by ``verify`` and reused after."""
    show_fake = verify or bool(fakes)
    out = ["| configuration | `qie plan` flags | measured peak (GiB) | plan (GiB) | plan vs measured "
           + ("| fake device (GiB) | fake vs measured " if show_fake else "") + "|",
           "| --- | --- | ---: | ---: | ---: |" + (" ---: | ---: |" if show_fake else "")]
    for row_id, label, flags, left_out in ROWS:
        r = rows.get(row_id)
        if r is None or r.get("peak_mem_gib") is None:
            continue
        measured = r["peak_mem_gib"] * GiB
        args, options, _, plan = plan_of(flags)
        planned = comparable(plan, left_out)
        status = "" if r["status"] == "ok" else f" ({r['status']}: more than this)"
        cells = [label, f"`{flags}`", f"{measured / GiB:.1f}{status}", f"{planned / GiB:.1f}",
                 f"{100 * (planned / measured - 1):+.1f} %"]
        if verify:
            fakes[row_id] = fake_peak(args, options) / GiB
        if show_fake:
            # the fake run builds the whole edit: the terms the benchmark leaves out come off, as the plan has them
            fake = fakes.get(row_id, float("nan")) * GiB - (comparable(plan, ()) - comparable(plan, left_out))
            cells += [f"{fake / GiB:.1f}", f"{100 * (fake / measured - 1):+.1f} %"]
        out.append("| " + " | ".join(cells) + " |")
        log.info(out[-1])
    return out


def fit(rows: dict) -> list[str]:
    """Training activations: measured minus the static terms, per token, as a multiple of the plan's."""
    from diffsynth_qie.memory.plan import activation_bytes

    lines = ["", "| configuration | measured activations (GiB) | plan's activations (GiB) | measured / plan |",
             "| --- | ---: | ---: | ---: |"]
    for row_id, label, flags, _ in ROWS:
        r = rows.get(row_id)
        if r is None or r["status"] != "ok" or not label.startswith(("2511 train", "2.1 train")) or "swapped" in label \
                or "FP8" in label:
            continue
        _, options, census, plan = plan_of(flags)
        act = activation_bytes(census, options)
        static = comparable(plan, ()) - act
        measured = r["peak_mem_gib"] * GiB - static
        lines.append(f"| {label} | {measured / GiB:.2f} | {act / GiB:.2f} | {measured / act:.2f} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a <gpu>-<date>.json of the benchmarks")
    parser.add_argument("--verify", action="store_true", help="also run each configuration on the fake device")
    parser.add_argument("--out", default=None, help="also write the tables to this Markdown file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    data = json.loads(Path(args.results).read_text())
    rows, fakes = {r["id"]: r for r in data["rows"]}, dict(data.get("fake_device_gib") or {})
    text = "\n".join(table(rows, fakes, args.verify) + fit(rows))
    if args.verify:  # keep the fake-device counts with the measurements: later tables reuse them
        from diffsynth_qie.utils.atomic import atomic_write_json

        atomic_write_json(Path(args.results), {**data, "fake_device_gib": fakes})
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
