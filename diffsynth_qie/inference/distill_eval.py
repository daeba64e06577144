"""The scorecard of a distilled student (``Qwen-Image-Edit-Distill.sh``, ``docs/DISTILL.md``): held-out rows edited by

- ``base``: the base model at the family's steps and CFG (40, CFG 4 for Qwen-Image-Edit);
- ``teacher``: the base with the task LoRA, the same;
- ``naive@N``: the teacher at the student's N steps and grid, CFG 1 (the same sampler, without the student);
- ``naive@N/own``: the teacher at N steps of the model's own schedule, CFG 1 (what ``--steps N --cfg 1`` gives);
- ``student@N``: the student stacked on the teacher, at its declared schedule (N steps, CFG 1);

with PSNR to each row's target (and the scorecard's other metrics), the DiT calls per edit of each column, and a
grid of every column. ``python -m diffsynth_qie.inference.distill_eval --help``.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)


def dit_calls(steps: int, cfg: float) -> int:
    """DiT calls of one edit: one per step, two with true CFG."""
    from ..models.samplers.sampling import uses_cfg

    return steps * (2 if uses_cfg(cfg) else 1)


def columns(teacher: str, students: Sequence[str], steps: int, cfg: float) -> list[tuple[str, list, dict]]:
    """(column, LoRAs [(path, scale)], edit settings) of the scorecard, in order."""
    from ..models.samplers.declared import declared_schedule

    out = [("base", [], dict(steps=steps, cfg=cfg)), ("teacher", [(teacher, 1.0)], dict(steps=steps, cfg=cfg))]
    for path in students:
        schedule, _ = declared_schedule(path)
        if schedule is None:
            raise ValueError(f"student {path} declares no schedule (qie_schedule): pass the LoRA --loss dmd wrote")
        grid = dict(steps=schedule.steps, cfg=schedule.cfg, sigmas=schedule.grid())
        out.append((f"naive@{schedule.steps}", [(teacher, 1.0)], grid))
        out.append((f"naive@{schedule.steps}/own", [(teacher, 1.0)], dict(steps=schedule.steps, cfg=1.0)))
        out.append((f"student@{schedule.steps}", [(teacher, 1.0), (path, 1.0)], grid))
    return out


def run(args: argparse.Namespace) -> dict:
    from ..inference import Editor
    from ..inference.evaluate import compare_grid, evaluate, load_cases
    from ..inference.scorecard_table import compare, format_table
    from ..models.presets import family_of
    from ..utils.atomic import atomic_path, atomic_write_text

    family = family_of(args.model)
    steps = args.steps or family.default_steps
    cfg = family.default_cfg if args.cfg is None else args.cfg
    plan = columns(args.teacher, args.student, steps, cfg)  # (refuses a student without a schedule, before loading)
    cases = load_cases(args.dataset_metadata, None, args.limit)
    editor = Editor.from_preset(args.model, model_dir=args.model_dir, zero_cond_t=args.zero_cond_t)
    reports, calls = {}, {}
    for name, loras, settings in plan:
        editor.set_loras(loras)
        reports[name] = evaluate(editor, cases, column=name, seed=args.seed, **settings)
        calls[name] = dit_calls(settings["steps"], settings["cfg"])
    summary = compare({name: r.scores for name, r in reports.items()})
    summary["dit_calls_per_edit"] = calls
    summary["psnr"] = {name: round(r.mean_psnr, 2) for name, r in reports.items()}
    log.info("%s", format_table(summary))
    for name, r in reports.items():
        log.info("%-12s %6.2f dB PSNR, %3d DiT calls per edit", name, r.mean_psnr, calls[name])
    if args.scorecard:
        per_row = {name: r.scores for name, r in reports.items()}
        atomic_write_text(args.scorecard, json.dumps({**summary, "per_row": per_row}, indent=1) + "\n")
    if args.grid:
        with atomic_path(args.grid) as tmp:
            compare_grid(cases, [r.outputs for r in reports.values()]).save(tmp, format="PNG")
        log.info("wrote %s (references | %s | target per row)", args.grid, " | ".join(reports))
    return summary


def build_parser() -> argparse.ArgumentParser:
    from ..models.preset_flags import preset_help, preset_type

    p = argparse.ArgumentParser(prog="python -m diffsynth_qie.inference.distill_eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", type=preset_type(), metavar="PRESET", help=preset_help())
    p.add_argument("--model_dir", default=None)
    p.add_argument("--zero_cond_t", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--dataset_metadata", required=True, help="held-out rows with targets")
    p.add_argument("--teacher", required=True, help="the task LoRA (--teacher_lora of the distillation)")
    p.add_argument("--student", action="append", default=[], help="a student LoRA --loss dmd wrote (repeatable)")
    p.add_argument("--steps", type=int, default=None, help="base and teacher steps; default: the family's")
    p.add_argument("--cfg", type=float, default=None, help="base and teacher CFG; default: the family's")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scorecard", default=None, metavar="JSON")
    p.add_argument("--grid", default=None, metavar="PNG")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from ..utils.logging import setup_logging

    setup_logging()
    args = build_parser().parse_args(argv)
    for path in [args.teacher, *args.student]:
        if not Path(path).is_file():
            raise SystemExit(f"LoRA file not found: {path}")
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
