"""`qie eval-edits`: the edit scorecard on held-out rows, without and with LoRA(s).

Logs the mean PSNR without and with the LoRA(s), then the scorecard side by side
(``inference/scorecard_table.py``: preservation, edit fidelity, drift, and the LoRA's win
rate over the base), and with ``--few_steps N`` the same LoRA at N steps and one line
saying how much that loses. ``--scorecard FILE`` writes it all as JSON (per row too);
``--grid`` a grid (source | base | LoRA [| LoRA sub-stream] | target per row). The CPU
demo's launch scripts call it on the demo's ``heldout.json``. ``--bench DIR`` edits a benchmark folder as it
ships (GEdit-Bench, ImgEdit-Bench: sources and instructions, no targets) and writes the generations in that
benchmark's layout (``--export``); ``--judge SPEC`` adds a judge's score; a LoRA trained on top of a frozen LoRA
(``qie train --frozen_lora``) is evaluated stacked on it, with its declared schedule. See docs/SCORECARD.md.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..utils.cli_checks import INT64_MAX, checked

log = logging.getLogger(__name__)
# output flags: leftovers of killed runs in their directories are removed before a run (cli.main)
OUTPUTS = {"grid": "file", "scorecard": "file"}
INPUTS = ("lora", "dataset_metadata", "bench", "model_dir", "clip")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..models.preset_flags import preset_help, preset_type

    parser.add_argument("--model", default="tiny", type=preset_type(), metavar="PRESET", help=preset_help())
    parser.add_argument("--model_dir", default=None, help="local directory with the model repo's layout")
    parser.add_argument("--lora", action="append", default=[], metavar="PATH", help="LoRA file (repeatable)")
    parser.add_argument("--zero_cond_t", action=argparse.BooleanOptionalAction, default=None,
                        help="override the preset's zero_cond_t")
    parser.add_argument("--dataset_metadata", default=None, metavar="FILE",
                        help="held-out rows (source, prompt, target, optional mask); or --bench")
    parser.add_argument("--bench", default=None, metavar="DIR",
                        help="a GEdit-Bench or ImgEdit-Bench folder as it ships (sources and instructions, no targets; "
                             "docs/SCORECARD.md) instead of --dataset_metadata; needs --export LAYOUT OUT")
    parser.add_argument("--dataset_base", default=None, metavar="DIR")
    parser.add_argument("--limit", type=checked(int, 0), default=None, help="evaluate only the first N rows")
    parser.add_argument("--no_mask", action="store_true", help="ignore the rows' masks")
    parser.add_argument("--steps", type=checked(int, 1, 10000), default=8, help="flow-matching steps")
    parser.add_argument("--cfg", type=checked(float, 0, 100), default=1.0, help="true CFG scale (1 = off)")
    parser.add_argument("--lbm_steps", type=checked(int, 1, 4), default=None, help="LBM bridge sampling with N steps")
    parser.add_argument("--seed", type=checked(int, 0, INT64_MAX), default=0)
    from .edit import add_cache_arguments

    add_cache_arguments(parser)
    parser.add_argument("--few_steps", type=checked(int, 1, 10000), action="append", default=[], metavar="N",
                        help="also score the LoRA at N steps (LBM: N bridge steps, 1-4), e.g. a Lightning LoRA's 4 "
                             "or 8 (repeatable); one line says how much each loses against --steps")
    parser.add_argument("--export", nargs=2, default=None, metavar=("LAYOUT", "DIR"),
                        help="also write the generations in a benchmark's layout (gedit or imgedit; docs/SCORECARD.md): "
                             "DIR/base and DIR/lora, for that benchmark's own scorer")
    parser.add_argument("--clip", default=None, metavar="DIR",
                        help="a local CLIP model directory (transformers layout; nothing is downloaded): adds "
                             "clip_direction, the image change against the instruction's text change")
    parser.add_argument("--reward", default=None, metavar="SPEC",
                        help="add a reward per row, as qie train --loss nft scores rollouts (docs/REWARD.md), e.g. "
                             "'preserve:1,diffsynth_qie.metrics.demo_reward:blue_inside:1'")
    parser.add_argument("--judge", default=None, metavar="SPEC",
                        help="add a judge's 0-10 score per row: URL#MODEL[#FORMAT] (an OpenAI-compatible endpoint, "
                             "e.g. a local vLLM; FORMAT: editscore, viescore or number, docs/SCORECARD.md) or a local "
                             "EditScore-7B directory ([BASE_DIR,]DIR); nothing is downloaded")
    parser.add_argument("--scorecard", default=None, metavar="JSON", help="write the scorecard (per row too) here")
    parser.add_argument("--grid", default=None, metavar="PNG", help="write the comparison grid here")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto")
    from ..metrics.judge_config import JudgeConfig
    from ..utils.config_cli import add_dataclass_args

    add_dataclass_args(parser, JudgeConfig, title="--judge: how it is asked")


def _reward(args, judge):
    """``--reward``'s reward (its judge term scores with ``--judge``), or None."""
    from ..metrics.rewards import parse_reward

    return None if not args.reward else parse_reward(args.reward, judge=judge, judge_flag="--judge")


def run(args: argparse.Namespace) -> int:
    from ..inference import Editor
    from ..inference.evaluate import evaluate
    from ..models.load.devices import check_device_name

    check_device_name(args.device)  # before anything loads
    check_flags(args)
    cases = _cases(args)
    from ..metrics.judge_config import JudgeConfig
    from ..metrics.judge_spec import build_judge
    from ..utils.config_cli import dataclass_from_args

    judge = build_judge(args.judge, "--judge", dataclass_from_args(JudgeConfig, args))  # (answers, or is refused)
    editor = Editor.from_preset(args.model, model_dir=args.model_dir, device=args.device, torch_dtype=args.dtype,
                                zero_cond_t=args.zero_cond_t)
    from ..metrics.lpips import load_lpips

    kwargs = dict(use_mask=not args.no_mask, steps=args.steps, cfg=args.cfg, seed=args.seed,
                  lbm_steps=args.lbm_steps, lpips_model=load_lpips(), clip=_clip(args.clip), judge=judge,
                  reward=_reward(args, judge), cache=args.cache, cache_method=args.cache_method,
                  cache_threshold=args.cache_threshold)
    reports = {"base": evaluate(editor, cases, column="base", **kwargs)}
    scores = {"base": reports["base"].scores}
    if args.lora:
        from .edit import lora_pairs

        editor.set_loras(lora_pairs(args.lora, []))
        reports["lora"] = evaluate(editor, cases, column="lora", **kwargs)
        scores["lora"] = reports["lora"].scores
        for n in args.few_steps:
            few = {"lbm_steps": n} if args.lbm_steps else {"steps": n}
            scores[f"lora@{n}"] = evaluate(editor, cases, column=f"lora@{n}", **{**kwargs, **few}).scores
        stacked = _stacked_on_frozen(editor, args, cases, kwargs)
        if stacked is not None:
            reports[stacked[0]] = stacked[1]
            scores[stacked[0]] = stacked[1].scores
    _log_psnr(reports, len(cases))
    _log_scorecard(scores, args)
    if args.export:
        _export(args, cases, reports)
    if args.grid:
        _grid(args, cases, reports)
    return 0


def check_flags(args: argparse.Namespace) -> None:
    """Every flag, before a model loads."""
    from ..utils.atomic import check_output_file

    if args.export:
        from ..inference.bench_layout import LAYOUTS

        if args.export[0] not in LAYOUTS:
            raise ValueError(f"--export {args.export[0]!r}: choose one of {', '.join(LAYOUTS)}")
    for flag in ("grid", "scorecard"):
        if getattr(args, flag):
            check_output_file(getattr(args, flag), f"--{flag}")
    if (args.dataset_metadata is None) == (args.bench is None):
        raise ValueError("give the rows to edit: --dataset_metadata FILE (held-out rows) or --bench DIR (a benchmark "
                         "folder), one of the two")
    if args.bench and not args.export:
        raise ValueError(f"--bench {args.bench} writes the generations for the benchmark's scorer: add --export "
                         "LAYOUT OUT_DIR (gedit or imgedit; docs/SCORECARD.md)")
    if args.few_steps and not args.lora:
        raise ValueError("--few_steps scores a LoRA at fewer steps; pass --lora FILE too")
    if args.lbm_steps and any(n > 4 for n in args.few_steps):
        raise ValueError(f"--few_steps {max(args.few_steps)} with --lbm_steps: LBM samples with 1-4 bridge steps")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit}: evaluate at least one row (or leave --limit out for all)")
    for path in args.lora:
        if not Path(path).is_file():
            raise FileNotFoundError(f"LoRA file not found: {path} (--lora takes a .safetensors file)")
    if args.judge:
        from ..metrics.judge_spec import parse_spec

        parse_spec(args.judge)
    if args.reward:  # the reward resolves (a judge term needs --judge) before a model loads
        from ..metrics.rewards import parse_reward

        parse_reward(args.reward, judge=object() if args.judge else None, judge_flag="--judge")
    from ..models.samplers.step_cache import cache_settings

    cache_settings(args.cache, args.cache_method, args.cache_threshold)


def _cases(args: argparse.Namespace) -> list:
    from ..inference.evaluate import EvalCase, load_cases

    if args.dataset_metadata:
        return load_cases(args.dataset_metadata, args.dataset_base, args.limit)
    from ..inference.bench_inputs import read_bench

    layout, rows = read_bench(args.bench, args.limit)
    log.info("--bench %s: %d %s row(s) (sources and instructions, no targets)", args.bench, len(rows), layout)
    return [EvalCase(images=[r.source], prompt=r.prompt, target=None, extra=r.extra) for r in rows]


def _stacked_on_frozen(editor, args: argparse.Namespace, cases, kwargs: dict):
    """(column name, report) of the LoRA stacked on the frozen LoRA it was trained on top of (its ``qie_trained_on``
    metadata), sampled with the declared schedule: the few-step setting it was trained for; None without one."""
    from ..inference.evaluate import evaluate
    from ..lora.frozen import stack_hint
    from ..models.presets import family_of
    from ..models.samplers.declared import plan_schedule
    from .edit import lora_pairs

    offers = stack_hint(args.lora)
    found = [(p, s) for p, s in offers if Path(p).is_file()]
    for p, _ in offers:
        if not Path(p).is_file():
            log.warning("the frozen LoRA %s a --lora was trained on is not there: not scored stacked on it", p)
    if not found or args.lbm_steps:
        return None
    family = family_of(args.model)
    plan = plan_schedule("auto", None, None, [*args.lora, *(p for p, _ in found)], family.name,
                         default_steps=args.steps, default_cfg=args.cfg)
    name = "lora+" + "+".join(Path(p).stem for p, _ in found) + f"@{plan.steps}"
    log.info("scoring the LoRA stacked on the frozen LoRA it was trained on (%s) with %d steps, cfg %g%s: column %s",
             ", ".join(f"{Path(p).name} at scale {s:g}" for p, s in found), plan.steps, plan.cfg,
             " (its declared schedule)" if plan.sigmas is not None else "", name)
    editor.set_loras(lora_pairs(args.lora, []) + found)
    schedule = dict(steps=plan.steps, cfg=plan.cfg, sigmas=plan.sigmas, scheduler=plan.scheduler)
    report = evaluate(editor, cases, column=name, **{**kwargs, **schedule})
    editor.set_loras(lora_pairs(args.lora, []))
    return name, report


def _log_psnr(reports: dict, rows: int) -> None:
    base = reports["base"]
    stats = [s for r in reports.values() for s in r.cache if s is not None]
    if stats:
        log.info("the step cache reused %d of %d DiT calls", sum(s.skipped for s in stats), sum(s.calls for s in stats))
    if not base.psnr:
        return  # benchmark rows: no target
    line = f"held-out PSNR to target ({rows} rows): base {base.mean_psnr:.2f} dB"
    if "lora" in reports:
        tuned = reports["lora"]
        line += f", with LoRA {tuned.mean_psnr:.2f} dB ({tuned.mean_psnr - base.mean_psnr:+.2f} dB)"
    log.info("%s", line)


def _export(args: argparse.Namespace, cases, reports: dict) -> None:
    """Every column's generations in the benchmark's layout, one folder per column (``base``, ``lora``, ...)."""
    from ..inference.bench_layout import export, folder_name

    layout, root = args.export
    for name, report in reports.items():
        folder = Path(root) / folder_name(name)
        export(layout, folder, [c.images[0] for c in cases], [c.prompt for c in cases], report.outputs,
               [c.extra for c in cases])
        log.info("wrote %d %s edit(s) in the %s layout to %s", len(cases), name, layout, folder)


def _grid(args: argparse.Namespace, cases, reports: dict) -> None:
    from ..inference.evaluate import compare_grid
    from ..utils.atomic import atomic_path

    columns = [r.outputs for r in reports.values()]
    if "lora" in reports:
        columns.insert(2, reports["lora"].sub_outputs)
    with atomic_path(args.grid) as tmp:
        compare_grid(cases, columns).save(tmp, format="PNG")
    log.info("wrote %s (references | %s%s | target per row)", args.grid, " | ".join(reports),
             " | sub-stream" if args.lbm_steps else "")


def _clip(path):
    if path is None:
        return None
    from ..metrics.clip_direction import load_clip

    return load_clip(path)  # None (and one logged line) when the directory holds no CLIP model


def _log_scorecard(scores: dict, args: argparse.Namespace) -> None:
    import json

    from ..inference.scorecard_table import compare, format_table, gap_line, win_line
    from ..utils.atomic import atomic_write_text

    summary = compare(scores)
    log.info("%s", format_table(summary))
    if "lora" in scores:
        log.info("win rate: %s", win_line(summary))
    few = [k for k in scores if k not in ("base", "lora")]
    if few:
        log.info("%s (lora at %d steps)", gap_line(summary, "lora", few), args.lbm_steps or args.steps)
    if args.scorecard:
        atomic_write_text(args.scorecard, json.dumps({**summary, "per_row": scores}, indent=1) + "\n")
        log.info("wrote %s", args.scorecard)
