"""Held-out evaluation: PSNR to the target and the edit scorecard of edits with and without LoRAs.

Used by ``qie eval-edits`` (the launch scripts print its numbers after the CPU
demo) and by the test that the system learns an edit. The rows are ordinary dataset
rows (``data.formats.read_rows``): source image(s), prompt, target, optional mask.
With ``use_mask`` the row's mask is passed to the editor, so pixels outside it are
the source's by construction and the PSNR measures the edit region's quality. Each
output is also scored by ``metrics/scorecard.py`` against its source (and target):
preservation outside the edit region, fidelity inside it, global drift
(``EvalReport.scores``, one dict per row), and with a ``judge`` (``metrics/judge.py``) by it. Benchmark
rows (``qie eval-edits --bench``) have no target: PSNR and the fidelity metrics are then absent.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from ..data.images import load_mask, load_rgb
from .editor import EditRequest, Editor

log = logging.getLogger(__name__)


def psnr(a: Image.Image, b: Image.Image) -> float:
    """PSNR (dB) between two RGB images of the same size, 8-bit scale; 99 dB for identical images."""
    if a.size != b.size:
        raise ValueError(f"PSNR needs images of one size, got {a.size} and {b.size}")
    x = np.asarray(a.convert("RGB"), dtype=np.float64)
    y = np.asarray(b.convert("RGB"), dtype=np.float64)
    mse = float(np.mean((x - y) ** 2))
    return 99.0 if mse == 0 else float(10 * np.log10(255.0 ** 2 / mse))


@dataclass
class EvalCase:
    """One row's inputs, loaded: the first image is the one edited (every one is a reference)."""

    images: list[Image.Image]
    prompt: str
    target: Image.Image | None
    mask: Image.Image | None = None
    extra: dict = field(default_factory=dict)  # a benchmark row's fields (key, task_type, ...)


@dataclass
class EvalReport:
    psnr: list[float]  # to the target, of the rows that have one
    outputs: list[Image.Image] = field(repr=False)
    sub_outputs: list[Image.Image | None] = field(default_factory=list, repr=False)
    scores: list[dict[str, float]] = field(default_factory=list)  # the scorecard of each row
    cache: list = field(default_factory=list)  # each row's step-cache stats (``CacheStats``; None without a cache)

    @property
    def mean_psnr(self) -> float:
        return float(np.mean(self.psnr)) if self.psnr else float("nan")


def load_cases(metadata: str, base_dir: str | None = None, limit: int | None = None) -> list[EvalCase]:
    """Rows of a metadata file as :class:`EvalCase` (text-to-image rows are refused)."""
    from ..data.formats import read_rows

    rows = read_rows(metadata, base_dir)[:limit]
    if not rows:
        raise ValueError(f"{metadata} has no rows to evaluate")
    cases = []
    for row in rows:
        if not row.edit_images:
            raise ValueError(f"row {row.row_id} of {metadata} has no source image; evaluation needs edit rows")
        cases.append(EvalCase(images=[load_rgb(p) for p in row.edit_images], prompt=row.prompts[0],
                              target=load_rgb(row.target),
                              mask=load_mask(row.back_mask) if row.back_mask else None))
    return cases


def case_pixels(case: EvalCase, output: Image.Image):
    """``(source, output, target or None, region or None)`` as ``[1, C, H, W]`` in [0, 1] at the output's size: the
    case's source and target resized to it, its mask as the edit region (what the scorecard and a reward read)."""
    from ..metrics.image import to_pixels

    size = output.size
    source = case.images[0].convert("RGB").resize(size, Image.Resampling.LANCZOS)
    target = case.target.convert("RGB").resize(size, Image.Resampling.LANCZOS) if case.target is not None else None
    region = None
    if case.mask is not None:
        m = np.asarray(case.mask.convert("L").resize(size, Image.Resampling.NEAREST), dtype=np.float32) / 255.0
        region = torch.from_numpy((m > 0.5).astype(np.float32))[None, None]
    return to_pixels([source]), to_pixels([output]), to_pixels([target]) if target is not None else None, region


def score_case(case: EvalCase, output: Image.Image, lpips_model=None, pixels=None) -> dict[str, float]:
    """The scorecard of one output against its case's source (resized to the output) and target (``pixels``: the
    case's :func:`case_pixels`, when the caller has them already)."""
    from ..metrics.scorecard import score_batch

    src, out, tgt, region = pixels or case_pixels(case, output)
    return score_batch(src, out, tgt, region=region, lpips_model=lpips_model)[0]


def evaluate(editor: Editor, cases: Sequence[EvalCase], *, use_mask: bool = True, lpips_model=None, clip=None,
             judge=None, reward=None, column: str = "", **request_kwargs) -> EvalReport:
    """Edit every case with ``editor`` as it is (its LoRAs) and measure PSNR to the target.

    ``request_kwargs`` go to :class:`EditRequest` (steps, cfg, seed, lbm_steps, ...); the
    output has the target's size (without a target, the editor's size for the source).
    ``judge``: a ``metrics.judge.ScoringJudge`` whose scores join each row's, asked while the next rows are edited;
    ``reward``: a ``metrics.rewards.Reward`` (``--reward``), its value joins each row's as ``reward`` (its judge
    terms take the row's judge score, asked once; a row the judge did not score has no reward). Each row is
    turned into pixels once, for the scorecard and the reward. ``column`` names the rows in the judge's line.
    """
    rest, judge_weight = reward, 0.0
    if hasattr(reward, "split_judge"):
        rest, judge_weight = reward.split_judge()
    scores, outputs, subs, cards, pending, partial, cache = [], [], [], [], [], [], []
    for i, case in enumerate(cases):
        w, h = case.target.size if case.target is not None else (None, None)
        request = EditRequest(images=case.images, prompt=case.prompt, mask=case.mask if use_mask else None,
                              width=w, height=h, **request_kwargs)
        result = editor.edit(request)
        if case.target is not None:
            scores.append(psnr(result.image, case.target))
        outputs.append(result.image)
        subs.append(result.sub_image)
        cache.append(result.cache)
        pixels = case_pixels(case, result.image)
        cards.append(score_case(case, result.image, lpips_model, pixels))
        if clip is not None:  # prompt adherence (metrics/clip_direction.py), only with a local CLIP model
            from ..metrics.clip_direction import clip_direction

            cards[-1]["clip_direction"] = float(clip_direction(clip, [case.images[0]], [result.image], [case.prompt])[0])
        if judge is not None:
            pending.append(judge.submit(case.images[0], case.prompt, result.image, row_label(case, i, column)))
        if reward is not None:
            partial.append(reward_of(rest, case, result.image, pixels) if getattr(rest, "terms", True) else 0.0)
    for card, verdict in zip(cards, pending):  # an absent answer adds nothing (metrics/judge.py)
        card.update(verdict.result().scores)
    missed = judge.take_unscored() if judge is not None else []
    if missed:
        from ..metrics.judge import unscored_line

        log.warning("%s", unscored_line(f"--judge ({column or 'rows'})", missed, len(pending)))
    for card, value in zip(cards, partial):
        if not judge_weight:
            card["reward"] = value
        elif "judge" in card:
            card["reward"] = value + judge_weight * card["judge"]
    return EvalReport(psnr=scores, outputs=outputs, sub_outputs=subs, scores=cards, cache=cache)


def row_label(case: EvalCase, index: int, column: str = "") -> str:
    """How a row is named in a log line: ``column`` and the benchmark key, else its position and instruction."""
    key = case.extra.get("key")
    name = f"row {key}" if key is not None else f"row {index} ({case.prompt[:40]!r})"
    return f"{column} {name}" if column else name


def reward_of(reward, case: EvalCase, output: Image.Image, pixels=None) -> float:
    """``reward`` of one edit (``metrics/rewards.py``), at the output's size, with the row's mask and target
    (``pixels``: the case's :func:`case_pixels`, when the caller has them already)."""
    from ..metrics.rewards import RewardBatch

    src, out, tgt, region = pixels or case_pixels(case, output)
    return float(reward(RewardBatch(source=src, output=out, instructions=[case.prompt],
                                    keys=[str(case.extra.get("key", case.prompt))], target=tgt, mask=region))[0])


def compare_grid(cases: Sequence[EvalCase], columns: Sequence[Sequence[Image.Image | None]]) -> Image.Image:
    """One row per case: every reference in order, then each column's image (``None`` skipped), then the target
    (when the row has one), each panel at the first output's height (``data.images.side_by_side``, as the
    validation strips)."""
    from ..data.images import side_by_side

    height = next(c[i] for c in columns for i in range(len(cases)) if c[i] is not None).height
    strips = [side_by_side(list(case.images) + [c[i] for c in columns if c[i] is not None]
                           + ([case.target] if case.target is not None else []), height)
              for i, case in enumerate(cases)]
    grid = Image.new("RGB", (max(s.width for s in strips), len(strips) * height), "white")
    for y, strip in enumerate(strips):
        grid.paste(strip, (0, y * height))
    return grid
