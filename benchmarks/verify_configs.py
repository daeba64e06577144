"""`qie plan --verify` over the covered configurations at full size, beside `qie plan`'s predictions.

    python -m benchmarks.verify_configs [--out table.md]

Prints one Markdown row per configuration: the fake-device peak (live device bytes, steady state for
training) and the plan's prediction without its CUDA-context allowance, and their difference.
About a minute per training configuration and half a minute per edit on one CPU core.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging

log = logging.getLogger("verify_configs")
GiB = 1024 ** 3

TRAIN = [  # (label, model, PlanOptions fields, mixed, loss)
    ("2511, checkpointing", "2511", {}, False, "sft"),
    ("2511, no checkpointing", "2511", {"gradient_checkpointing": False}, False, "sft"),
    ("2509, checkpointing", "2509", {}, False, "sft"),
    ("2511, batch 2, mixed shapes and prompt lengths", "2511", {"batch_size": 2}, True, "sft"),
    ("2511, --fp8_base", "2511", {"fp8_base": True}, False, "sft"),
    ("2511, LBM loss (AdamW)", "2511", {}, False, "lbm"),
    ("2511, 2 reference images", "2511", {"ref_images": 2}, False, "sft"),
    ("2511, --blocks_to_swap 20", "2511", {"blocks_to_swap": 20}, False, "sft"),
    ("2511, --fp8_base --blocks_to_swap 30", "2511", {"fp8_base": True, "blocks_to_swap": 30}, False, "sft"),
]
EDIT = [  # (label, model, PlanOptions fields, verify_edit kwargs)
    ("edit 2511, CFG 4, LoRA rank 32", "2511", {}, {}),
    ("edit 2511, 2 reference images", "2511", {"ref_images": 2}, {}),
    ("edit 2509, --fp8_base, no LoRA", "2509", {"fp8_base": True, "lora_rank": 0}, {}),
    ("edit 2511, LBM 1 step", "2511", {"cfg": False}, {"lbm_steps": 1}),
    ("edit 2511, --blocks_to_swap 30", "2511", {"blocks_to_swap": 30}, {}),
]


def main() -> None:
    from diffsynth_qie.commands.plan_verify import train_config
    from diffsynth_qie.preflight.edit_step import verify_edit
    from diffsynth_qie.memory.census import preset_census
    from diffsynth_qie.memory.plan import PlanOptions, predict
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.preflight.train_step import batch_shapes, verify_train_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the table to this Markdown file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = ["| configuration | fake-device peak (GiB) | `qie plan` (GiB, no CUDA context) | difference | seconds |",
            "| --- | ---: | ---: | ---: | ---: |"]

    def add(label, peak, options, seconds):
        predicted = predict(preset_census(options_model[0]), options).gpu_peak - options.overhead_bytes
        rows.append(f"| {label} | {peak / GiB:.2f} | {predicted / GiB:.2f} | {100 * (predicted / peak - 1):+.1f} % "
                    f"| {seconds:.0f} |")
        log.info(rows[-1])

    for label, model, fields, mixed, loss in TRAIN:
        options_model = [model]
        options = PlanOptions(**{"lora_rank": 32, "gradient_checkpointing": True, **fields})
        ns = argparse.Namespace(model=model, loss=loss)
        cfg, preset = train_config(ns, options)
        if loss == "lbm":
            cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, optimizer="adamw"))
        shapes = batch_shapes(options.resolution, options.ref_images, options.prompt_tokens, options.batch_size,
                              mixed=mixed)
        r = verify_train_step(cfg, preset, shapes)
        add(label, r.peak, options, r.seconds)
    for label, model, fields, kwargs in EDIT:
        options_model = [model]
        options = PlanOptions(task="edit", **{"lora_rank": 32, **fields})
        r = verify_edit(get_preset(model), resolution=options.resolution, ref_images=options.ref_images,
                        prompt_tokens=options.prompt_tokens, cfg=4.0 if options.cfg else 1.0,
                        lora_rank=options.lora_rank, fp8_base=options.fp8_base,
                        blocks_to_swap=options.blocks_to_swap, **kwargs)
        add(label, r.peak, options, r.seconds)
    table = "\n".join(rows)
    print(table)
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
