"""Folders of images -> DiffSynth metadata rows (what ``qie make-dataset`` writes).

Files are matched by *key*: the path below its folder without the extension
(``a.png`` -> ``a``, ``sub/b.jpg`` -> ``sub/b``). Every key of ``--target`` is one
candidate row; each ``--source`` folder must hold the same key (several sources make a
multi-image edit, in the order given); ``--mask`` and ``--ref_gt`` are optional per row;
with ``--rejected`` (a preference dataset's rejected outputs; the targets are the chosen ones)
every row needs one, and a target without it is skipped with the reason. Prompts come from
one of: ``--prompt`` (the same for every row), ``--prompts FILE`` (CSV or JSONL with a ``stem``
column and ``prompt`` or ``instruction``, optionally ``instruction_cn``, ``inverse_instruction``,
``inverse_instruction_cn``), or a ``.txt`` beside each target (``<target>/<key>.txt``).

Every image is opened with :func:`~.images.open_image` (the project's loader and its
pixel cap) in worker processes: a row whose images cannot be read, exceed
``max_pixels``, have a side under :data:`MIN_SIDE` pixels, or whose mask's size is not
its target's, is skipped with the reason. Rows are written with DiffSynth's field names
(``prompt``, ``image``, ``edit_image``, ``back_mask``, ``ref_gt``, ``rejected``), or with the
FireRed-style names (``target_image``, ``source_image``, ``instruction``, ...) when the
prompts have a second language or inverse instructions, which DiffSynth's fields cannot
hold. Both are read by :func:`~.formats.read_rows`.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from ..utils.atomic import is_temp_name
from .formats import read_utf8
from .images import MAX_IMAGE_PIXELS, open_image
from .rows import SkippedRow

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
#: The cache's size divisor: images are never enlarged, so a shorter side cannot be used.
MIN_SIDE = 16
PROMPT_FIELDS = ("instruction_cn", "inverse_instruction", "inverse_instruction_cn")


@dataclass
class FolderSpec:
    """What to match: the folders, where prompts come from, and the pixel budget."""

    target: Path
    sources: list[Path]
    mask: Optional[Path] = None
    ref_gt: Optional[Path] = None
    rejected: Optional[Path] = None
    prompt: Optional[str] = None
    prompts_file: Optional[Path] = None
    max_pixels: int = MAX_IMAGE_PIXELS
    workers: int = 4


@dataclass
class FolderRow:
    """One matched row, absolute paths; ``texts`` maps prompt fields (``prompt``, ``instruction_cn``, ...)."""

    key: str
    target: Path
    sources: list[Path]
    texts: dict[str, str]
    mask: Optional[Path] = None
    ref_gt: Optional[Path] = None
    rejected: Optional[Path] = None

    def images(self) -> dict[str, Path]:
        out = {"target": self.target, **{f"edit_images[{i}]": p for i, p in enumerate(self.sources)}}
        if self.mask is not None:
            out["back_mask"] = self.mask
        if self.ref_gt is not None:
            out["ref_gt"] = self.ref_gt
        if self.rejected is not None:
            out["rejected"] = self.rejected
        return out


@dataclass
class FolderScan:
    """Rows that passed every check, rows skipped (with why), and what was left unmatched."""

    rows: list[FolderRow] = field(default_factory=list)
    skipped: list[SkippedRow] = field(default_factory=list)
    unmatched: dict[str, list[str]] = field(default_factory=dict)  # folder -> keys with no target
    without: dict[str, list[str]] = field(default_factory=dict)  # "mask" / "ref_gt" / ... -> keys written without one
    images_checked: int = 0

    def summary(self) -> str:
        reasons: dict[str, int] = {}
        for s in self.skipped:
            reasons[s.reason.split(":")[0]] = reasons.get(s.reason.split(":")[0], 0) + 1
        parts = [f"{len(self.rows)} row(s) written, {len(self.skipped)} skipped, "
                 f"{self.images_checked} image(s) checked"]
        parts += [f"  skipped {n}: {r}" for r, n in sorted(reasons.items(), key=lambda x: -x[1])]
        parts += [f"  {len(keys)} file(s) in {folder} match no target: {', '.join(keys[:5])}"
                  f"{' ...' if len(keys) > 5 else ''}" for folder, keys in self.unmatched.items() if keys]
        kept = {k for r in self.rows for k in [r.key]}
        for name, keys in self.without.items():
            keys = [k for k in keys if k in kept]
            if keys:
                parts.append(f"  {len(keys)} row(s) written without a {name} (none has this stem): "
                             f"{', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}")
        return "\n".join(parts)


# ---------------------------------------------------------------- listing and matching
def list_images(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """``({key: path}, ambiguous keys)`` of the images below ``folder`` (temp and hidden files ignored)."""
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a directory; pass a folder of images")
    found: dict[str, list[Path]] = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith(".") or is_temp_name(name) or Path(name).suffix.lower() not in IMAGE_EXTENSIONS:
                continue
            path = Path(root) / name
            found.setdefault(path.relative_to(folder).with_suffix("").as_posix(), []).append(path)
    return {k: v[0] for k, v in found.items() if len(v) == 1}, sorted(k for k, v in found.items() if len(v) > 1)


def _strip_image_suffix(stem: str) -> str:
    return stem[: -len(Path(stem).suffix)] if Path(stem).suffix.lower() in IMAGE_EXTENSIONS else stem


def read_prompts(path: Path) -> dict[str, dict[str, str]]:
    """``{stem: {"prompt": ..., "instruction_cn": ..., ...}}`` from a CSV or JSONL prompts file."""
    if not path.is_file():
        raise ValueError(f"prompts file {path} not found; pass a CSV or JSONL with stem and prompt columns")
    text = read_utf8(path, "prompts file")
    if path.suffix.lower() == ".csv":
        records = list(csv.DictReader(io.StringIO(text, newline="")))  # quoted newlines stay in their cell
    else:
        records = []
        for i, line in enumerate(text.split("\n")):  # (splitlines also splits at U+2028 inside strings)
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i + 1}: invalid JSON line ({e.msg}); a .jsonl prompts file needs "
                                     "one object per line (or use a .csv)") from e
    out: dict[str, dict[str, str]] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or not str(rec.get("stem") or "").strip():
            raise ValueError(f"{path}: record {i + 1} has no 'stem' field; every record needs stem and prompt "
                             "(or instruction)")
        prompt = str(rec.get("prompt") or rec.get("instruction") or "").strip()
        texts = {"prompt": prompt} if prompt else {}
        texts.update({k: str(rec[k]).strip() for k in PROMPT_FIELDS if str(rec.get(k) or "").strip()})
        stem = _strip_image_suffix(str(rec["stem"]).strip())
        if stem in out:
            raise ValueError(f"{path}: stem {stem!r} appears twice; keep one record per stem")
        out[stem] = texts
    return out


def match_folders(spec: FolderSpec) -> FolderScan:
    """Pair the folders' files by key and attach prompts (no image is opened)."""
    if spec.prompt is not None and spec.prompts_file is not None:
        raise ValueError("give --prompt (one prompt for all) or --prompts FILE, not both")
    if not spec.sources:
        raise ValueError("no --source folder given; pass --source DIR (several for multi-image edits)")
    if spec.rejected is not None and Path(spec.rejected).resolve() == Path(spec.target).resolve():
        raise ValueError(f"--rejected {spec.rejected} is the --target folder itself; the targets are the chosen "
                         "outputs, --rejected the other ones: give two different folders")
    same = [str(d) for d in spec.sources if Path(d).resolve() == Path(spec.target).resolve()]
    if same:  # every pair would be an image and itself: an edit that teaches nothing
        raise ValueError(f"--source {same[0]} is the --target folder itself; the sources are the images before "
                         "the edit, the target the images after it: give two different folders")
    scan = FolderScan()
    targets, ambiguous = list_images(spec.target)
    if not targets and not ambiguous:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found in --target {spec.target}")
    others = {f"source {i}": list_images(d) for i, d in enumerate(spec.sources)}
    for name, folder in (("mask", spec.mask), ("ref_gt", spec.ref_gt), ("rejected", spec.rejected)):
        if folder is not None:
            others[name] = list_images(folder)
    prompts = read_prompts(spec.prompts_file) if spec.prompts_file is not None else None
    for key in ambiguous:
        scan.skipped.append(SkippedRow(key, "target", str(spec.target), "several target files share this stem"))
    for name, (files, amb) in others.items():
        scan.unmatched[_folder(spec, name)] = sorted(k for k in set(files) | set(amb) if k not in targets)
    for key, target in sorted(targets.items()):
        skip = _match_one(spec, key, target, others, prompts, scan)
        if skip is not None:
            scan.skipped.append(skip)
    return scan


def _folder(spec: FolderSpec, name: str) -> str:
    if name.startswith("source"):
        return str(spec.sources[int(name.split()[1])])
    return str(getattr(spec, name))  # mask, ref_gt, rejected


def _match_one(spec, key, target, others, prompts, scan) -> Optional[SkippedRow]:
    sources = []
    for i in range(len(spec.sources)):
        files, amb = others[f"source {i}"]
        if key not in files:
            why = "several source files share this stem" if key in amb else "no source image with this stem"
            return SkippedRow(key, f"edit_images[{i}]", str(spec.sources[i]), why)
        sources.append(files[key])
    optional = {}
    for name in ("mask", "ref_gt", "rejected"):
        if name in others:
            files, amb = others[name]
            if key in amb:
                return SkippedRow(key, "back_mask" if name == "mask" else name, _folder(spec, name),
                                  f"several {name} files share this stem")
            optional[name] = files.get(key)
            if optional[name] is None and name == "rejected":  # --loss dpo refuses a row that is not a pair
                return SkippedRow(key, "rejected", _folder(spec, name), "no rejected image with this stem: with "
                                  "--rejected every row is a chosen/rejected pair; add one to the --rejected folder "
                                  "or remove the target")
            if optional[name] is None:  # allowed (the row trains without it), but said in the summary
                scan.without.setdefault(name, []).append(key)
    if spec.prompt is not None:
        texts = {"prompt": spec.prompt.strip()}
    elif prompts is not None:
        texts = prompts.get(key, {})
    else:
        txt = spec.target / f"{key}.txt"
        texts = {"prompt": read_utf8(txt, "prompt file").strip()} if txt.is_file() else {}
    if not texts.get("prompt"):
        where = (f"--prompts {spec.prompts_file}" if prompts is not None
                 else f"{spec.target / (key + '.txt')}" if spec.prompt is None else "--prompt")
        return SkippedRow(key, "prompts", where, "no prompt for this stem")
    scan.rows.append(FolderRow(key, target, sources, texts, optional.get("mask"), optional.get("ref_gt"),
                               optional.get("rejected")))
    return None


# ---------------------------------------------------------------- validating images
def check_image(path: str, max_pixels: int) -> tuple[Optional[tuple[int, int]], Optional[str]]:
    """``(size, None)`` for a usable image, ``(None, reason)`` otherwise (runs in worker processes)."""
    try:
        with open_image(path, max_pixels=max_pixels) as im:
            size = im.size
    except (ValueError, OSError) as e:
        return None, str(e)
    if min(size) < MIN_SIDE:
        return None, f"{size[0]}x{size[1]} pixels: sides under {MIN_SIDE} px cannot be used (images are never enlarged)"
    return size, None


def check_images(paths: Sequence[Path], max_pixels: int, workers: int) -> dict[Path, tuple]:
    """:func:`check_image` for every path, in ``workers`` processes (0: in this process), with a progress bar."""
    from tqdm import tqdm

    unique = sorted(set(paths))
    results: dict[Path, tuple] = {}
    bar = tqdm(total=len(unique), desc="checking images", unit="image", dynamic_ncols=True)
    try:
        if workers <= 0 or len(unique) < 2:
            for p in unique:
                results[p] = check_image(str(p), max_pixels)
                bar.update(1)
        else:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                chunk = max(1, len(unique) // (workers * 8))
                for p, res in zip(unique, pool.map(check_image, [str(p) for p in unique],
                                                   [max_pixels] * len(unique), chunksize=chunk)):
                    results[p] = res
                    bar.update(1)
    finally:
        bar.close()
    return results


def validate(scan: FolderScan, max_pixels: int, workers: int) -> FolderScan:
    """Drop (into ``scan.skipped``) the rows with an unusable image or a mask of another size."""
    paths = [p for row in scan.rows for p in row.images().values()]
    checked = check_images(paths, max_pixels, workers)
    good = []
    for row in scan.rows:
        problem = None
        for name, p in row.images().items():
            size, reason = checked[p]
            if reason is not None:
                problem = SkippedRow(row.key, name, str(p), reason)
                break
        if problem is None and row.mask is not None and checked[row.mask][0] != checked[row.target][0]:
            (mw, mh), (tw, th) = checked[row.mask][0], checked[row.target][0]
            problem = SkippedRow(row.key, "back_mask", str(row.mask),
                                 f"mask size differs from the target: {mw}x{mh} vs {tw}x{th}")
        if problem is None:
            good.append(row)
        else:
            scan.skipped.append(problem)
    scan.rows, scan.images_checked = good, len(checked)
    return scan


# ---------------------------------------------------------------- writing
def row_record(row: FolderRow, base: Path, absolute: bool, firered: bool) -> dict:
    """One metadata record; paths relative to ``base`` (the metadata file's folder) unless ``absolute``."""
    def p(path: Optional[Path]):
        if path is None:
            return None
        path = path.resolve()
        return str(path) if absolute else Path(os.path.relpath(path, base.resolve())).as_posix()

    sources = [p(s) for s in row.sources]
    if firered:
        rec = {"target_image": p(row.target), "source_image": sources[0] if len(sources) == 1 else sources,
               "instruction": row.texts["prompt"], **{k: row.texts[k] for k in PROMPT_FIELDS if k in row.texts}}
    else:
        rec = {"prompt": row.texts["prompt"], "image": p(row.target),
               "edit_image": sources[0] if len(sources) == 1 else sources}
    if row.mask is not None:
        rec["back_mask"] = p(row.mask)
    if row.ref_gt is not None:
        rec["ref_gt"] = p(row.ref_gt)
    if row.rejected is not None:
        rec["rejected"] = p(row.rejected)
    return rec


def needs_firered_fields(rows: Iterable[FolderRow]) -> bool:
    """Whether any row has a second-language or inverse prompt (DiffSynth's fields have no place for them)."""
    return any(k in row.texts for row in rows for k in PROMPT_FIELDS)


def render(records: list[dict], fmt: str) -> str:
    if fmt == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return json.dumps(records, ensure_ascii=False, indent=1) + "\n"
