"""Dataset rows and their validation.

One :class:`EditRow` is one training sample after parsing any metadata format
(see ``formats.py``): a target image, zero or more source images, one or more
prompt alternatives, optional mask and ``ref_gt``. Bad rows become
:class:`SkippedRow` records instead of crashing a multi-hour cache run; they are
logged, written to ``skipped.jsonl`` and counted against ``max_bad_fraction``.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ..utils.atomic import atomic_write_text
from ..utils.text import is_empty_prompt
from .images import check_geometry, load_mask, load_rgb

log = logging.getLogger(__name__)

DEFAULT_MAX_BAD_FRACTION: float = 0.05
"""Default for ``--max_bad_fraction``: fail when more than 5 % of rows are bad.

Why 5 %: scraped or hand-collected editing datasets routinely contain a few
broken downloads, truncated JPEGs or empty captions, and one such row must not
kill a long cache run — those are skipped and listed in ``skipped.jsonl``.
More than a few percent, however, almost always means a *systematic* mistake
(wrong ``--dataset_base``, a renamed field, the wrong metadata file, t2i rows
without ``--t2i_mode``) that would otherwise silently train on a fraction or a
biased subset of the data. Use 0 to require a clean dataset, 1 to accept any.
"""


@dataclass
class EditRow:
    """One training sample, format-independent.

    ``prompts`` are alternatives (e.g. English and Chinese instruction); training
    picks one at random per step. A row that passed :func:`validate_rows` has at
    least one non-empty prompt. ``edit_images`` empty means a text-to-image row.
    ``back_mask`` marks the edit region (white = edit). ``inverse`` rows are
    generated from a FireRed-style row by swapping source and target.
    """

    row_id: str
    prompts: list[str]
    target: Path
    edit_images: list[Path] = field(default_factory=list)
    back_mask: Path | None = None
    ref_gt: Path | None = None
    dataset: str = "default"
    inverse: bool = False
    rejected: Path | None = None  # a preference row's rejected output (the target is the chosen one)

    @property
    def num_sources(self) -> int:
        return len(self.edit_images)

    @property
    def is_t2i(self) -> bool:
        return not self.edit_images

    def pick_prompt(self, rng: random.Random) -> str:
        """One prompt alternative, drawn with the caller's (seeded) RNG."""
        assert self.prompts, f"row {self.row_id} has no prompt (validate_rows first)"
        return self.prompts[rng.randrange(len(self.prompts))] if len(self.prompts) > 1 else self.prompts[0]

    def image_paths(self) -> dict[str, Path]:
        """Every file this row reads, keyed by the field name used in SkippedRow."""
        paths: dict[str, Path] = {"target": self.target}
        for i, p in enumerate(self.edit_images):
            paths[f"edit_images[{i}]"] = p
        if self.back_mask is not None:
            paths["back_mask"] = self.back_mask
        if self.ref_gt is not None:
            paths["ref_gt"] = self.ref_gt
        if self.rejected is not None:
            paths["rejected"] = self.rejected
        return paths

    def to_json(self) -> dict:
        """JSON-serialisable dict (paths as strings), e.g. for manifests."""
        d = dataclasses.asdict(self)
        d["target"] = str(self.target)
        d["edit_images"] = [str(p) for p in self.edit_images]
        d["back_mask"] = None if self.back_mask is None else str(self.back_mask)
        d["ref_gt"] = None if self.ref_gt is None else str(self.ref_gt)
        d["rejected"] = None if self.rejected is None else str(self.rejected)
        return d


@dataclass
class SkippedRow:
    """Why a row was left out. ``field`` names the EditRow field (``target``,
    ``edit_images[1]``, ``back_mask``, ``ref_gt``, ``rejected``, ``prompts``) or, for parse
    problems, the metadata field; ``path`` is the offending file if any."""

    row_id: str
    field: str
    path: str | None
    reason: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def log_skip(s: SkippedRow) -> None:
    log.warning("skipping row %s: %s: %s%s", s.row_id, s.field, s.reason, f" ({s.path})" if s.path else "")


def _check_row(row: EditRow, check_images: bool, sizes: dict) -> SkippedRow | None:
    """First problem of ``row`` or None. ``sizes`` memoises path -> size | error
    (inverse rows and shared references read the same files)."""
    if all(is_empty_prompt(p) for p in row.prompts):
        return SkippedRow(row.row_id, "prompts", None, "empty prompt")  # (or only spaces / invisible characters)
    for name, path in row.image_paths().items():
        if not path.is_file():
            return SkippedRow(row.row_id, name, str(path), "missing file")
        if not check_images:
            continue
        key = (str(path), name == "back_mask")
        if key not in sizes:
            try:
                im = load_mask(path) if name == "back_mask" else load_rgb(path)
                sizes[key] = im.size
            except (ValueError, OSError) as e:
                sizes[key] = e
        got = sizes[key]
        if isinstance(got, Exception):
            kind = "unreadable mask" if name == "back_mask" else "unreadable or truncated image"
            return SkippedRow(row.row_id, name, str(path), f"{kind}: {got}")
        try:
            check_geometry(got, str(path))
        except ValueError as e:
            return SkippedRow(row.row_id, name, str(path), f"unusable size: {e}")
    if check_images and row.back_mask is not None:
        mask_size = sizes[(str(row.back_mask), True)]
        target_size = sizes[(str(row.target), False)]
        if mask_size != target_size:
            return SkippedRow(row.row_id, "back_mask", str(row.back_mask),
                              f"mask size {mask_size[0]}x{mask_size[1]} differs from target image size "
                              f"{target_size[0]}x{target_size[1]} (after EXIF rotation)")
    return identical_pair(row) if check_images else None


IDENTICAL_PAIR = ("the rejected image has the same pixels as the chosen target {target}, so the pair teaches "
                  "no preference; point 'rejected' at the other output or drop the row")


def identical_pair(row: EditRow) -> SkippedRow | None:
    """A preference row whose rejected image has its chosen target's pixels (it teaches nothing), else None."""
    if row.rejected is None or not same_pixels(row.target, row.rejected):
        return None
    return SkippedRow(row.row_id, "rejected", str(row.rejected), IDENTICAL_PAIR.format(target=row.target))


def same_pixels(a: Path, b: Path) -> bool:
    """Whether two image files decode to the same RGB pixels (the same file, or equal sizes and values)."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    ia, ib = load_rgb(a), load_rgb(b)
    return ia.size == ib.size and ia.tobytes() == ib.tobytes()


def check_row(row: EditRow, *, check_images: bool = True) -> SkippedRow | None:
    """Validate one row (for writers that validate lazily per rank); None if good."""
    return _check_row(row, check_images, {})


def validate_rows(rows: Iterable[EditRow], *, check_images: bool = True) -> tuple[list[EditRow], list[SkippedRow]]:
    """Split ``rows`` into good rows and :class:`SkippedRow` records (logged).

    Checks: non-empty prompt; every referenced file exists; with ``check_images``
    every image (target, sources, ref_gt, rejected) and the mask fully decode, the
    mask has the target's size (after EXIF rotation), and a preference row's
    rejected image is not the target's pixels again. Each bad row is reported
    once, with its first problem.
    """
    good: list[EditRow] = []
    skipped: list[SkippedRow] = []
    sizes: dict = {}
    for row in rows:
        problem = _check_row(row, check_images, sizes)
        if problem is None:
            good.append(row)
        else:
            log_skip(problem)
            skipped.append(problem)
    return good, skipped


def write_skipped(path: str | os.PathLike, skipped: Iterable[SkippedRow]) -> Path:
    """Write ``skipped.jsonl`` atomically (an empty file when nothing was skipped)."""
    path = Path(path)
    text = "".join(json.dumps(s.to_json(), ensure_ascii=False) + "\n" for s in skipped)
    atomic_write_text(path, text)
    return path


def check_bad_fraction(n_total: int, skipped: list[SkippedRow], max_bad_fraction: float,
                       metadata_path: str | os.PathLike, skipped_path: str | os.PathLike | None = None) -> None:
    """Raise ValueError when more than ``max_bad_fraction`` of ``n_total`` rows are bad
    (or when no row is usable at all), summarising the most common reasons."""
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"--max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
    n_bad = len(skipped)
    where = f"; the list is in {skipped_path}" if skipped_path else ""
    if n_total == 0:
        raise ValueError(f"{metadata_path} contains no rows; check the file and the field names")
    reasons = collections.Counter(f"{s.field}: {s.reason.split(':')[0]}" for s in skipped)
    summary = "; ".join(f"{n}x {r}" for r, n in reasons.most_common(3))
    if n_bad >= n_total:
        raise ValueError(f"all {n_total} rows of {metadata_path} are bad ({summary}){where}. "
                         "Check --dataset_base (paths are relative to it) and the field-name flags.")
    frac = n_bad / n_total
    if frac > max_bad_fraction:
        raise ValueError(
            f"{n_bad} of {n_total} rows ({frac:.1%}) of {metadata_path} are bad, more than "
            f"--max_bad_fraction {max_bad_fraction:g} ({summary}){where}. Fix the data or the paths, "
            f"or raise --max_bad_fraction to train on the {n_total - n_bad} good rows.")
    if n_bad:
        log.warning("%d of %d rows (%.1f%%) of %s skipped%s", n_bad, n_total, 100 * frac, metadata_path, where)
