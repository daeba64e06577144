"""Rewards for reward tuning: one number per edit, higher is better, from a ``--reward`` spec.

A spec is a comma-separated weighted sum of terms, ``NAME[:WEIGHT]`` (weight 1 when left out)::

    preserve:0.5,fidelity:1.0           # two scorecard terms
    preserve,mypkg.rewards:blue_circle:2    # a user's function (module:function), weight 2
    jsonl:scores.jsonl                  # precomputed scores, one {"key": ..., "reward": ...} per line

=============  =====================================================================================
term           what (per row, higher is better)
=============  =====================================================================================
``preserve``   SSIM of the output against the source outside the edit region (the scorecard's
               ``preserve_ssim``, in [0, 1]): an edit that drifts from its source loses it
``fidelity``   SSIM of the output against the target inside the edit region (``edit_ssim``)
``drift``      minus the global shift in pixels (``shift_px``)
``colour``     minus the mean colour change outside the region (``colour_cast``)
``judge``      a judge's score (``metrics/judge.py``: EditScore, an OpenAI-compatible endpoint), 0-10
MODULE:FN      ``FN(batch: RewardBatch) -> sequence of B floats`` from an importable module
``jsonl:PATH`` the ``reward`` of the line whose ``key`` is the row's key
=============  =====================================================================================

Every term is checked on every call: a value that is not finite, a result that is not one number per row, or a
term that raises, raises :class:`RewardFailed` (a ``ValueError``: one line naming the term; the traceback is
logged at debug level). The ``judge`` term scores a batch's rows together (``--judge_workers`` at once); rows the
judge could not score count as the mean of the scored ones up to ``max_failed`` of the batch, past that it
raises rather than reward on partial scores. :func:`call_reward` bounds a call in time. :func:`parse_reward`
resolves everything up front (the module imported, the file read, the judge present), so a missing reward model
fails before any rollout. A reward runs in another process with :class:`ProcessReward` (the spec is re-parsed
there; the batch travels as arrays).
"""
from __future__ import annotations

import importlib
import json
import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

Tensor = torch.Tensor
log = logging.getLogger(__name__)


class RewardFailed(ValueError):
    """A reward that could not score a batch: one line naming the term and why (the run stops)."""


@dataclass
class RewardBatch:
    """What a reward sees: ``[B, 3, H, W]`` in [0, 1] (``target`` and ``mask`` [B, 1, H, W] may be None)."""

    source: Tensor
    output: Tensor
    instructions: Sequence[str]
    keys: Sequence[str] = ()
    target: Optional[Tensor] = None
    mask: Optional[Tensor] = None

    def __len__(self) -> int:
        return int(self.output.shape[0])


def _scorecard_term(metric: str, sign: float, needs_target: bool = False) -> Callable[[RewardBatch], list[float]]:
    def term(batch: RewardBatch) -> list[float]:
        from .scorecard import score_batch

        if needs_target and batch.target is None:
            raise ValueError(f"reward term {metric!r} compares with the target: these rows have none; use "
                             "'preserve' or a judge for rows without targets")
        rows = score_batch(batch.source, batch.output, batch.target, region=batch.mask)
        return [sign * row.get(metric, float("nan")) for row in rows]

    return term


BUILTIN: dict[str, Callable[[], Callable[[RewardBatch], list[float]]]] = {
    "preserve": lambda: _scorecard_term("preserve_ssim", 1.0),
    "fidelity": lambda: _scorecard_term("edit_ssim", 1.0, needs_target=True),
    "drift": lambda: _scorecard_term("shift_px", -1.0),
    "colour": lambda: _scorecard_term("colour_cast", -1.0),
}


def _judge_term(judge, max_failed: float = 0.0) -> Callable[[RewardBatch], list[float]]:
    """A judge's ``judge`` score per row, the rows asked together; unscored rows take the mean of the scored ones
    while they are at most ``max_failed`` of the batch, else :class:`RewardFailed`."""
    from PIL import Image

    def to_pil(x: Tensor) -> Image.Image:
        return Image.fromarray((x.clamp(0, 1).permute(1, 2, 0) * 255).round().byte().cpu().numpy())

    def term(batch: RewardBatch) -> list[float]:
        from .judge import JudgeDown, Verdict

        keys = list(batch.keys) or [""] * len(batch)
        items = [(to_pil(batch.source[i]), batch.instructions[i], to_pil(batch.output[i]), f"{keys[i]} #{i}")
                 for i in range(len(batch))]
        try:
            verdicts = judge.assess_many(items) if hasattr(judge, "assess_many") else \
                [Verdict(judge.score(*item[:3])) for item in items]  # (a judge with score() alone)
        except JudgeDown as e:  # a reward judge is never left out: the run stops
            raise RewardFailed(f"the reward {e.what}: the run stops rather than train without its rewards; start the "
                               "judge and resume") from None
        values = [v.scores.get("judge") for v in verdicts]
        failed = [i for i, v in enumerate(values) if v is None]
        if not failed:
            return values
        why = verdicts[failed[-1]].why
        if len(failed) > max_failed * len(values) or len(failed) == len(values):
            raise RewardFailed(f"the reward judge could not score {len(failed)} of {len(values)} rollouts of "
                               f"{keys[failed[0]] or 'a row'} (the last: {why}); more than --reward_judge_max_failed "
                               f"{max_failed:g} of them, so the run stops rather than reward on partial scores")
        mean = sum(v for v in values if v is not None) / (len(values) - len(failed))
        log.warning("reward judge: %d of %d rollouts of %s got no score (%s); they count as the mean of the others, "
                    "%.3f", len(failed), len(values), keys[failed[0]] or "a row", why, mean)
        return [mean if v is None else v for v in values]

    return term


def _jsonl_term(path: str) -> Callable[[RewardBatch], list[float]]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--reward jsonl:{path}: no such file; give a JSONL with one {{\"key\", \"reward\"}} per line")
    table = {}
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                table[str(row["key"])] = float(row["reward"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--reward jsonl:{path} line {n}: {e}; each line needs \"key\" and a numeric "
                                 "\"reward\"") from None

    def term(batch: RewardBatch) -> list[float]:
        missing = [k for k in batch.keys if str(k) not in table]
        if missing or len(batch.keys) != len(batch):
            raise ValueError(f"--reward jsonl:{path} has no score for {missing[:3] or 'rows without keys'}")
        return [table[str(k)] for k in batch.keys]

    return term


def _function_term(ref: str) -> Callable[[RewardBatch], list[float]]:
    module, _, name = ref.rpartition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--reward {ref}: cannot load {name!r} from module {module!r} ({e}); give an importable "
                         "module:function, or one of " + ", ".join([*BUILTIN, "judge", "jsonl:PATH"])) from None
    if not callable(fn):
        raise ValueError(f"--reward {ref}: {name} is not a function")
    return fn


@dataclass
class Reward:
    """A weighted sum of terms; ``reward(batch)`` returns a float tensor ``[B]``."""

    spec: str
    terms: list[tuple[str, float, Callable[[RewardBatch], Sequence[float]]]] = field(default_factory=list)

    def __call__(self, batch: RewardBatch) -> Tensor:
        total = torch.zeros(len(batch), dtype=torch.float64)
        for name, weight, term in self.terms:
            try:
                values = term(batch)
                values = torch.as_tensor(values.detach().cpu() if isinstance(values, Tensor) else list(values),
                                         dtype=torch.float64).reshape(-1)
            except RewardFailed:
                raise
            except Exception as e:  # a user's function, a judge that stopped: one line, the traceback at debug
                log.debug("reward term %r raised", name, exc_info=True)
                raise RewardFailed(f"reward term {name!r} raised {type(e).__name__}: {e}") from e
            if values.numel() != len(batch):
                raise RewardFailed(f"reward term {name!r} returned {values.numel()} values for {len(batch)} rows; "
                                   "it must return one number per row")
            if not torch.isfinite(values).all():
                bad = [i for i, v in enumerate(values.tolist()) if not math.isfinite(v)]
                hint = " (is a scorecard region empty?)" if name in BUILTIN else ""
                raise RewardFailed(f"reward term {name!r} returned a non-finite value for rows {bad[:5]}; a reward "
                                   f"must be a finite number for every row{hint}")
            total += weight * values
        return total.float()

    def split_judge(self) -> tuple["Reward", float]:
        """(this reward without its ``judge`` terms, their summed weight): a caller that has the judge's score of
        a row adds ``weight · score`` itself instead of asking the judge again."""
        rest = [t for t in self.terms if t[0] != "judge"]
        return Reward(self.spec, rest), sum(w for n, w, _ in self.terms if n == "judge")


def call_reward(reward: Callable[[RewardBatch], Tensor], batch: RewardBatch, timeout: Optional[float],
                what: str = "the reward") -> Tensor:
    """``reward(batch)``, given at most ``timeout`` seconds (None: no limit): past them :class:`RewardFailed`
    (the call is left running on a daemon thread, which does not hold the process at exit); any exception of
    the reward comes back as :class:`RewardFailed`."""
    if timeout is None:
        return reward(batch)
    result: dict = {}

    def run():
        try:
            result["value"] = reward(batch)
        except BaseException as e:  # handed to the caller
            result["error"] = e

    worker = threading.Thread(target=run, name="reward", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardFailed(f"{what} took more than --reward_timeout {timeout:g} s; make it faster or raise the limit")
    if "error" in result:
        error = result["error"]
        if isinstance(error, RewardFailed):
            raise error
        log.debug("the reward raised", exc_info=error)
        raise RewardFailed(f"{what} raised {type(error).__name__}: {error}") from error
    return result["value"]


def probe(reward: Reward) -> None:
    """Call each scorecard and function term of ``reward`` once on a small made-up batch (two 64 px rows with a
    target and a mask), so a term that returns NaN or the wrong shape is refused before any rollout starts."""
    g = torch.Generator().manual_seed(0)
    source = torch.rand(2, 3, 64, 64, generator=g)
    mask = torch.zeros(2, 1, 64, 64)
    mask[..., 16:48, 16:48] = 1
    output = (source + 0.1 * mask * torch.rand(2, 3, 64, 64, generator=g)).clamp(0, 1)
    batch = RewardBatch(source=source, output=output, instructions=["make it blue"] * 2, keys=["probe-0", "probe-1"],
                        target=output.flip(0), mask=mask)
    kept = [t for t in reward.terms if t[0] in BUILTIN or (":" in t[0] and not t[0].startswith("jsonl:"))]
    Reward(reward.spec, kept)(batch)


def parse_reward(spec: str, judge=None, judge_flag: str = "--reward_judge", max_failed: float = 0.0) -> Reward:
    """Resolve a ``--reward`` spec (see the module docstring); every term is loaded now. ``judge``: the judge of a
    ``judge`` term (``judge_flag`` names its flag), ``max_failed`` its share of unscored rows allowed."""
    if not spec or not spec.strip():
        raise ValueError("--reward is empty; give e.g. 'preserve:0.5,fidelity:1.0'")
    reward = Reward(spec)
    for raw in spec.split(","):
        raw = raw.strip()
        name, _, tail = raw.rpartition(":")
        try:
            weight = float(tail)
        except ValueError:
            name, weight = raw, 1.0
        if not name or not math.isfinite(weight):
            raise ValueError(f"--reward term {raw!r}: write NAME or NAME:WEIGHT with a finite weight")
        if name in BUILTIN:
            term = BUILTIN[name]()
        elif name == "judge":
            if judge is None:
                raise ValueError(f"--reward judge needs a judge: pass {judge_flag} (an OpenAI-compatible URL#MODEL or "
                                 "a local EditScore directory)")
            term = _judge_term(judge, max_failed)
        elif name.startswith("jsonl:"):
            term = _jsonl_term(name[len("jsonl:"):])
        elif ":" in name:
            term = _function_term(name)
        else:
            raise ValueError(f"--reward term {name!r} is unknown; choose from {', '.join(BUILTIN)}, judge, "
                             "jsonl:PATH or module:function")
        reward.terms.append((name, weight, term))
    return reward


def _score_in_worker(spec: str, arrays: dict, instructions: list, keys: list) -> list[float]:
    tensors = {k: None if v is None else torch.from_numpy(v) for k, v in arrays.items()}
    return parse_reward(spec)(RewardBatch(instructions=instructions, keys=keys, **tensors)).tolist()


class ProcessReward:
    """A reward computed in a worker process (e.g. one that needs its own GPU): the spec is parsed once here,
    to fail early, and again in the worker; batches travel as arrays."""

    def __init__(self, spec: str):
        from concurrent.futures import ProcessPoolExecutor
        import multiprocessing

        parse_reward(spec)
        self.spec = spec
        self.pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))

    def __call__(self, batch: RewardBatch) -> Tensor:
        arrays = {k: None if getattr(batch, k) is None else getattr(batch, k).detach().cpu().numpy()
                  for k in ("source", "output", "target", "mask")}
        values = self.pool.submit(_score_in_worker, self.spec, arrays, list(batch.instructions),
                                  list(batch.keys)).result()
        return torch.tensor(values, dtype=torch.float32)

    def close(self) -> None:
        self.pool.shutdown()
