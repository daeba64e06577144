"""`qie make-dataset`: DiffSynth metadata (JSON or JSONL) from folders of images (see ``data/folders.py``)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..utils.cli_checks import checked

log = logging.getLogger(__name__)
# output flags: leftovers of killed runs in their directories are removed before a run (cli.main)
OUTPUTS = {"out": "file"}
INPUTS = ("target", "source", "ref_gt", "rejected")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="DIR", help="folder of target (edited) images")
    parser.add_argument("--source", required=True, action="append", metavar="DIR",
                        help="folder of source images, matched to targets by file stem; repeat for "
                             "multi-image edits (the order given is the order of the references)")
    parser.add_argument("--check", action="store_true",
                        help="then run `qie check-dataset` on the result (report in <out>.check/)")
    parser.add_argument("--mask", metavar="DIR", help="optional folder of edit-region masks (white = edit), "
                        "same stems and sizes as the targets")
    parser.add_argument("--ref_gt", metavar="DIR", help="optional folder of reference ground-truth images")
    parser.add_argument("--rejected", metavar="DIR", help="optional folder of rejected outputs, matched by stem: a "
                        "preference dataset for qie train --loss dpo, the --target images being the chosen ones "
                        "(docs/PREFERENCE.md)")
    parser.add_argument("--prompt", help="one prompt for every row (default: a .txt beside each target)")
    parser.add_argument("--prompts", metavar="FILE", help="CSV or JSONL with columns stem and prompt (or "
                        "instruction); optional instruction_cn, inverse_instruction, inverse_instruction_cn")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="metadata file to write (.json or .jsonl); <out>.skipped.jsonl lists skipped rows")
    parser.add_argument("--format", choices=["json", "jsonl"], default=None,
                        help="output format (default: from the --out extension)")
    parser.add_argument("--fields", choices=["auto", "diffsynth", "firered"], default="auto",
                        help="field names: DiffSynth's (prompt, image, edit_image), or FireRed-style "
                             "(target_image, source_image, instruction, ...), which also hold instruction_cn and "
                             "inverse instructions; auto picks FireRed-style only when the prompts need it")
    parser.add_argument("--absolute_paths", action="store_true",
                        help="write absolute image paths (default: relative to the metadata file's folder)")
    parser.add_argument("--max_pixels", type=checked(int, 256, 1 << 32), default=None,
                        help="skip images with more pixels than this (default: the loader's cap, 8192x8192)")
    parser.add_argument("--workers", type=checked(int, 0, 1024), default=4, help="processes that check images (0: none)")


def output_format(out: Path, fmt: str | None) -> str:
    suffix = out.suffix.lower()
    if suffix not in (".json", ".jsonl"):
        raise ValueError(f"--out {out}: the metadata file must end in .json or .jsonl")
    ext_fmt = suffix[1:]
    if fmt is not None and fmt != ext_fmt:
        raise ValueError(f"--format {fmt} does not match --out {out}; name the file *.{fmt} or drop --format")
    return ext_fmt


def run(args: argparse.Namespace) -> int:
    from ..data import folders
    from ..data.images import MAX_IMAGE_PIXELS
    from ..data.rows import write_skipped
    from ..utils.atomic import atomic_write_text

    out = Path(args.out)
    fmt = output_format(out, args.format)
    max_pixels = MAX_IMAGE_PIXELS if args.max_pixels is None else args.max_pixels
    if max_pixels < folders.MIN_SIDE ** 2:
        raise ValueError(f"--max_pixels {args.max_pixels} is below {folders.MIN_SIDE ** 2} (16x16); give a larger budget")
    if args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    spec = folders.FolderSpec(target=Path(args.target), sources=[Path(s) for s in args.source],
                              mask=Path(args.mask) if args.mask else None,
                              ref_gt=Path(args.ref_gt) if args.ref_gt else None, prompt=args.prompt,
                              rejected=Path(args.rejected) if args.rejected else None,
                              prompts_file=Path(args.prompts) if args.prompts else None,
                              max_pixels=max_pixels, workers=args.workers)
    scan = folders.validate(folders.match_folders(spec), max_pixels, args.workers)
    firered = args.fields == "firered" or (args.fields == "auto" and folders.needs_firered_fields(scan.rows))
    if args.fields == "diffsynth" and folders.needs_firered_fields(scan.rows):
        raise ValueError("the prompts have instruction_cn or inverse instructions, which DiffSynth's fields "
                         "cannot hold; use --fields firered (or auto)")
    out.parent.mkdir(parents=True, exist_ok=True)
    records = [folders.row_record(r, out.parent, args.absolute_paths, firered) for r in scan.rows]
    skipped_path = write_skipped(out.with_name(out.name + ".skipped.jsonl"), scan.skipped)
    if not records:
        raise ValueError(f"no usable rows (the reasons are in {skipped_path}):\n{scan.summary()}")
    atomic_write_text(out, folders.render(records, fmt))
    log.info("wrote %s (%s, %s fields)\n%s", out, fmt, "FireRed-style" if firered else "DiffSynth", scan.summary())
    if scan.skipped:
        log.warning("%d row(s) skipped; reasons in %s", len(scan.skipped), skipped_path)
    if args.check:  # the pairs' own problems (misaligned, identical, duplicate, reversed, masks)
        from . import check_dataset

        check_dataset.run(argparse.Namespace(**{
            **vars(check_dataset.default_thresholds()), "metadata": str(out), "workers": args.workers,
            "out": str(out.with_name(out.name + ".check")), "dataset_base": None, "holdout": None,
            "write_clean": None}))
    return 0
