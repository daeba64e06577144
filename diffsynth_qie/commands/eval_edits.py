"""`qie eval-edits`: the edit scorecard on held-out rows, without and with LoRA(s).

Logs the mean PSNR without and with the LoRA(s), then the scorecard side by side
(``inference/scorecard_table.py``: preservation, edit fidelity, drift, and the LoRA's win
rate over the base), and with ``--few_steps N`` the same LoRA at N steps and one line
saying how much that loses. ``--scorecard FILE`` writes it all as JSON (per row too);
``--grid`` a grid (source | base | LoRA [| LoRA sub-stream] | target per row). The CPU
demo's launch scripts call it on the demo's ``heldout.json``. See docs/SCORECARD.md.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..utils.cli_checks import INT64_MAX, checked

log = logging.getLogger(__name__)
# output flags: leftovers of killed runs in their directories are removed before a run (cli.main)
OUTPUTS = {"grid": "file", "scorecard": "file"}
INPUTS = ("lora", "dataset_metadata", "model_dir", "clip")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..models.preset_flags import preset_help, preset_type

    parser.add_argument("--model", default="tiny", type=preset_type(), metavar="PRESET", help=preset_help())
    parser.add_argument("--model_dir", default=None, help="local directory with the model repo's layout")
    parser.add_argument("--lora", action="append", default=[], metavar="PATH", help="LoRA file (repeatable)")
    parser.add_argument("--zero_cond_t", action=argparse.BooleanOptionalAction, default=None,
                        help="override the preset's zero_cond_t")
    parser.add_argument("--dataset_metadata", required=True, metavar="FILE",
                        help="held-out rows (source, prompt, target, optional mask)")
    parser.add_argument("--dataset_base", default=None, metavar="DIR")
    parser.add_argument("--limit", type=checked(int, 0), default=None, help="evaluate only the first N rows")
    parser.add_argument("--no_mask", action="store_true", help="ignore the rows' masks")
    parser.add_argument("--steps", type=checked(int, 1, 10000), default=8, help="flow-matching steps")
    parser.add_argument("--cfg", type=checked(float, 0, 100), default=1.0, help="true CFG scale (1 = off)")
    parser.add_argument("--lbm_steps", type=checked(int, 1, 4), default=None, help="LBM bridge sampling with N steps")
    parser.add_argument("--seed", type=checked(int, 0, INT64_MAX), default=0)
    parser.add_argument("--few_steps", type=checked(int, 1, 10000), action="append", default=[], metavar="N",
                        help="also score the LoRA at N steps (LBM: N bridge steps, 1-4), e.g. a Lightning LoRA's 4 "
                             "or 8 (repeatable); one line says how much each loses against --steps")
    parser.add_argument("--export", nargs=2, default=None, metavar=("LAYOUT", "DIR"),
                        help="also write the generations in a benchmark's layout (gedit or imgedit; docs/SCORECARD.md): "
                             "DIR/base and DIR/lora, for that benchmark's own scorer")
    parser.add_argument("--clip", default=None, metavar="DIR",
                        help="a local CLIP model directory (transformers layout; nothing is downloaded): adds "
                             "clip_direction, the image change against the instruction's text change")
    parser.add_argument("--scorecard", default=None, metavar="JSON", help="write the scorecard (per row too) here")
    parser.add_argument("--grid", default=None, metavar="PNG", help="write the comparison grid here")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto")


def run(args: argparse.Namespace) -> int:
    from ..inference import Editor
    from ..inference.evaluate import compare_grid, evaluate, load_cases
    from ..utils.atomic import atomic_path, check_output_file
    from .edit import lora_pairs

    from ..models.load.devices import check_device_name

    check_device_name(args.device)  # before anything loads
    if args.export:
        from ..inference.bench_layout import LAYOUTS

        if args.export[0] not in LAYOUTS:
            raise ValueError(f"--export {args.export[0]!r}: choose one of {', '.join(LAYOUTS)}")
    for flag in ("grid", "scorecard"):
        if getattr(args, flag):
            check_output_file(getattr(args, flag), f"--{flag}")
    if args.few_steps and not args.lora:
        raise ValueError("--few_steps scores a LoRA at fewer steps; pass --lora FILE too")
    if args.lbm_steps and any(n > 4 for n in args.few_steps):
        raise ValueError(f"--few_steps {max(args.few_steps)} with --lbm_steps: LBM samples with 1-4 bridge steps")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit}: evaluate at least one row (or leave --limit out for all)")
    cases = load_cases(args.dataset_metadata, args.dataset_base, args.limit)
    for path in args.lora:
        if not Path(path).is_file():
            raise FileNotFoundError(f"LoRA file not found: {path} (--lora takes a .safetensors file)")
    editor = Editor.from_preset(args.model, model_dir=args.model_dir, device=args.device, torch_dtype=args.dtype,
                                zero_cond_t=args.zero_cond_t)
    from ..metrics.lpips import load_lpips

    kwargs = dict(use_mask=not args.no_mask, steps=args.steps, cfg=args.cfg, seed=args.seed,
                  lbm_steps=args.lbm_steps, lpips_model=load_lpips(), clip=_clip(args.clip))
    base = evaluate(editor, cases, **kwargs)
    columns = [base.outputs]
    scores = {"base": base.scores}
    line = f"held-out PSNR to target ({len(cases)} rows): base {base.mean_psnr:.2f} dB"
    if args.lora:
        editor.set_loras(lora_pairs(args.lora, []))
        tuned = evaluate(editor, cases, **kwargs)
        columns += [tuned.outputs, tuned.sub_outputs]
        scores["lora"] = tuned.scores
        line += f", with LoRA {tuned.mean_psnr:.2f} dB ({tuned.mean_psnr - base.mean_psnr:+.2f} dB)"
        for n in args.few_steps:
            few = {"lbm_steps": n} if args.lbm_steps else {"steps": n}
            scores[f"lora@{n}"] = evaluate(editor, cases, **{**kwargs, **few}).scores
    log.info("%s", line)
    _log_scorecard(scores, args)
    if args.export:
        from ..inference.bench_layout import export

        for name, report in (("base", base), ("lora", tuned if args.lora else None)):
            if report is not None:
                folder = Path(args.export[1]) / name
                export(args.export[0], folder, [c.images[0] for c in cases], [c.prompt for c in cases], report.outputs)
                log.info("wrote %d %s edit(s) in the %s layout to %s", len(cases), name, args.export[0], folder)
    if args.grid:
        with atomic_path(args.grid) as tmp:
            compare_grid(cases, columns).save(tmp, format="PNG")
        log.info("wrote %s (source | base | LoRA%s | target per row)", args.grid,
                 " | sub-stream" if args.lbm_steps else "")
    return 0


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
    few = [k for k in scores if k.startswith("lora@")]
    if few:
        log.info("%s (lora at %d steps)", gap_line(summary, "lora", few), args.lbm_steps or args.steps)
    if args.scorecard:
        atomic_write_text(args.scorecard, json.dumps({**summary, "per_row": scores}, indent=1) + "\n")
        log.info("wrote %s", args.scorecard)
