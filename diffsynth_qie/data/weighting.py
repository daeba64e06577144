"""Weighted multi-dataset sampling: which samples an epoch draws, and how often.

Flags (FireRed's ``train_data_weights`` / ``train_src_img_num_weights``)::

    --dataset_weights "a=0.5,b=1.2"         datasets not named are excluded
    --src_img_num_weights "0=1,1=1,2=1,3=0" by number of source images (0 = text-to-image);
                                            counts not named are excluded

Exact formula. Let ``D`` be the set of weighted dimensions: ``dataset`` if
``--dataset_weights`` is given, ``num_sources`` if ``--src_img_num_weights`` is.
A sample ``i``'s *group* ``G(i)`` is the set of eligible samples that agree with
``i`` on every dimension in ``D``. Then

    p_i = W_dataset(d_i) * W_src(s_i) / |G(i)|      (normalised to sum to 1)

with ``W = 1`` for a dimension that is not weighted and ``W = 0`` (excluded) for a
name/count the flag does not list. Within a group samples are drawn uniformly, and
each non-empty group ``g`` is drawn with probability ``∝ W_dataset(g) * W_src(g)``
whatever its size. Consequences:

- with both flags, ``P(dataset = d) ∝ W_dataset(d) * sum of W_src(s)`` over the source
  counts ``s`` present in ``d``; when every dataset has every weighted source count
  (a full grid) both realised marginals follow the weights exactly;
- with only ``--dataset_weights``, datasets follow their weights and source counts
  keep their natural proportions inside each dataset (and vice versa).

:func:`expected_mix` computes the mix these probabilities imply, whatever the support.
An epoch draws ``samples_per_epoch`` samples with replacement (default: the number of
eligible samples). Pure standard library (no torch).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .buckets import InfoLookup, SampleInfo, info_lookup

log = logging.getLogger(__name__)

_SYNTAX = "comma-separated KEY=WEIGHT pairs"


def _parse_pairs(text: str, flag: str, example: str) -> list[tuple[str, float]]:
    pairs: list[tuple[str, float]] = []
    seen: set[str] = set()
    for item in text.split(","):
        item = item.strip()
        key, sep, value = item.rpartition("=")
        key, value = key.strip(), value.strip()
        if not item or not sep or not key or not value:
            raise ValueError(f"{flag}: bad entry {item!r} in {text!r}; expected {_SYNTAX}, e.g. {example!r}")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"{flag}: weight {value!r} of {key!r} is not a number; expected {_SYNTAX}, "
                             f"e.g. {example!r}") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{flag}: weight of {key!r} must be a finite number >= 0 (0 excludes it), got {value}")
        if key in seen:
            raise ValueError(f"{flag}: {key!r} is given twice in {text!r}; give each key once")
        seen.add(key)
        pairs.append((key, weight))
    return pairs


def parse_dataset_weights(text: Optional[str], known: Iterable[str]) -> Optional[dict[str, float]]:
    """``"a=0.5,b=1.2"`` -> ``{"a": 0.5, "b": 1.2}``; None/empty -> None (no dataset weighting).

    ``known`` are the dataset names the data has; naming any other is an error.
    """
    if text is None or not text.strip():
        return None
    known = sorted(set(known))
    weights = dict(_parse_pairs(text, "--dataset_weights", "a=0.5,b=1.2"))
    unknown = sorted(set(weights) - set(known))
    if unknown:
        raise ValueError(f"--dataset_weights names unknown dataset(s) {unknown}; the training data has "
                         f"datasets {known} (a dataset's name is set by `qie cache --dataset_name`, "
                         "default: its metadata file's directory)")
    return weights


def parse_src_img_num_weights(text: Optional[str]) -> Optional[dict[int, float]]:
    """``"0=1,1=1,2=1,3=0"`` -> ``{0: 1.0, 1: 1.0, 2: 1.0, 3: 0.0}``; None/empty -> None."""
    if text is None or not text.strip():
        return None
    out: dict[int, float] = {}
    for key, weight in _parse_pairs(text, "--src_img_num_weights", "0=1,1=1,2=1,3=0"):
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"--src_img_num_weights: key {key!r} is not a number of source images "
                             "(0 = text-to-image, 1, 2, ...)")
        if int(key) in out:
            raise ValueError(f"--src_img_num_weights: {int(key)} source image(s) given twice in {text!r}")
        out[int(key)] = weight
    return out


def sample_weights(infos: Sequence[SampleInfo], dataset_weights: Optional[dict[str, float]],
                   src_weights: Optional[dict[int, float]]) -> list[float]:
    """Unnormalised draw probability ``p_i`` per sample (0 = excluded); formula in the module docstring.

    Logs what the weights exclude. Raises ``ValueError`` when nothing is left.
    """
    def group_of(s: SampleInfo) -> tuple:
        return (s.dataset if dataset_weights is not None else None,
                s.num_sources if src_weights is not None else None)

    def base(s: SampleInfo) -> float:
        wd = 1.0 if dataset_weights is None else dataset_weights.get(s.dataset, 0.0)
        ws = 1.0 if src_weights is None else src_weights.get(s.num_sources, 0.0)
        return wd * ws

    if dataset_weights is not None:
        present = _counts(s.dataset for s in infos)
        excluded = {d: n for d, n in present.items() if dataset_weights.get(d, 0.0) == 0}
        if excluded:
            log.info("--dataset_weights excludes dataset(s) (not named or weight 0): %s",
                     ", ".join(f"{d} ({n} samples)" for d, n in sorted(excluded.items())))
    if src_weights is not None:
        present = _counts(s.num_sources for s in infos)
        excluded = {k: n for k, n in present.items() if src_weights.get(k, 0.0) == 0}
        if excluded:
            log.info("--src_img_num_weights excludes samples with (not named or weight 0): %s",
                     ", ".join(f"{k} source image(s) ({n} samples)" for k, n in sorted(excluded.items())))
        absent = sorted(k for k, w in src_weights.items() if w > 0 and k not in present)
        if absent:
            log.warning("--src_img_num_weights gives weight to %s source image(s), but no sample has that many; "
                        "those weights are ignored", absent)
    group_sizes = _counts(group_of(s) for s in infos if base(s) > 0)
    weights = [base(s) / group_sizes[group_of(s)] if base(s) > 0 else 0.0 for s in infos]
    if not any(w > 0 for w in weights):
        raise ValueError("the sampling weights exclude every sample: check --dataset_weights and "
                         f"--src_img_num_weights against the data (datasets {sorted(_counts(s.dataset for s in infos))}, "
                         f"source image counts {sorted(_counts(s.num_sources for s in infos))})")
    return weights


def _counts(keys: Iterable) -> dict:
    out: dict = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return out


@dataclass(frozen=True)
class Mix:
    """Share of samples per dataset and per number of source images (each sums to 1)."""

    samples: int
    datasets: dict[str, float]
    sources: dict[int, float]

    def describe(self) -> str:
        ds = ", ".join(f"{k}={v:.3f}" for k, v in sorted(self.datasets.items()))
        src = ", ".join(f"{k}={v:.3f}" for k, v in sorted(self.sources.items()))
        return f"datasets {ds}; source images {src} ({self.samples} samples)"


def _mix(pairs: Iterable[tuple[SampleInfo, float]], samples: int) -> Mix:
    ds: dict[str, float] = {}
    src: dict[int, float] = {}
    total = 0.0
    for s, w in pairs:
        ds[s.dataset] = ds.get(s.dataset, 0.0) + w
        src[s.num_sources] = src.get(s.num_sources, 0.0) + w
        total += w
    if total == 0:
        return Mix(samples, {}, {})
    return Mix(samples, {k: v / total for k, v in ds.items()}, {k: v / total for k, v in src.items()})


def realised_mix(batches: Sequence[Sequence[int]], infos: InfoLookup) -> Mix:
    """The mix of the samples in ``batches`` (repeats count every time)."""
    lookup = info_lookup(infos)
    n = sum(len(b) for b in batches)
    return _mix(((lookup[i], 1.0) for b in batches for i in b), n)


def expected_mix(infos: Sequence[SampleInfo], weights: Sequence[float], samples: int = 0) -> Mix:
    """The mix a draw with per-sample probabilities ``∝ weights`` has in expectation."""
    return _mix(zip(infos, weights), samples)
