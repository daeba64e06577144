"""`qie eval-edits`: mean PSNR to the target on held-out rows, without and with LoRA(s).

Logs one line with the mean PSNR without and with the LoRA(s) and optionally writes a grid
(source | base | LoRA [| LoRA sub-stream] | target per row). The CPU demo's launch
scripts call it on the demo's ``heldout.json``.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..utils.cli_checks import INT64_MAX, checked

log = logging.getLogger(__name__)
# output flags: leftovers of killed runs in their directories are removed before a run (cli.main)
OUTPUTS = {"grid": "file"}
INPUTS = ("lora", "dataset_metadata", "model_dir")


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
    if args.grid:
        check_output_file(args.grid, "--grid")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit}: evaluate at least one row (or leave --limit out for all)")
    cases = load_cases(args.dataset_metadata, args.dataset_base, args.limit)
    for path in args.lora:
        if not Path(path).is_file():
            raise FileNotFoundError(f"LoRA file not found: {path} (--lora takes a .safetensors file)")
    editor = Editor.from_preset(args.model, model_dir=args.model_dir, device=args.device, torch_dtype=args.dtype,
                                zero_cond_t=args.zero_cond_t)
    kwargs = dict(use_mask=not args.no_mask, steps=args.steps, cfg=args.cfg, seed=args.seed,
                  lbm_steps=args.lbm_steps)
    base = evaluate(editor, cases, **kwargs)
    columns = [base.outputs]
    line = f"held-out PSNR to target ({len(cases)} rows): base {base.mean_psnr:.2f} dB"
    if args.lora:
        editor.set_loras(lora_pairs(args.lora, []))
        tuned = evaluate(editor, cases, **kwargs)
        columns += [tuned.outputs, tuned.sub_outputs]
        line += f", with LoRA {tuned.mean_psnr:.2f} dB ({tuned.mean_psnr - base.mean_psnr:+.2f} dB)"
    log.info("%s", line)
    if args.grid:
        with atomic_path(args.grid) as tmp:
            compare_grid(cases, columns).save(tmp, format="PNG")
        log.info("wrote %s (source | base | LoRA%s | target per row)", args.grid,
                 " | sub-stream" if args.lbm_steps else "")
    return 0
