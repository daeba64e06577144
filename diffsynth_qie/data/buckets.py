"""Cut a stream of samples into batches whose image-token padding stays small.

Why: ``models/qwen_image_edit/forward.py`` pads every sample's image tokens (target + reference
images, one token per 2x2 latent patch) to the longest sample of its batch, so a
batch ``b`` costs ``len(b) * max(tokens)`` tokens of compute and wastes

    padding_fraction = 1 - sum(tokens) / sum_b(len(b) * max_b(tokens))

(aggregated over all batches, i.e. token-weighted, not a mean of per-batch ratios).
Only token counts matter for that waste; equal *layouts* additionally let the
forward skip padding and masks altogether.

Bucket policies (:data:`BucketPolicy`), given samples in a random order:

- ``exact``: one bucket per layout ``(target_hw, reference shapes)``; each bucket is
  cut into batches, the last one of a bucket may be short. Zero padding, but many
  small layouts give many short batches (fewer samples per step).
- ``tokens``: all samples sorted by token count (random order among equal counts) and
  cut into consecutive batches: neighbours have similar sizes, every batch is full.
- ``auto`` (default): ``exact`` first; the short remainder of every bucket is pooled
  and batched as in ``tokens``. Full buckets give padding-free batches and only the
  leftovers mix layouts, so every batch but at most one is full.

Batch size: ``batch_size`` samples per batch, or with ``max_tokens_per_batch`` a
token budget: samples are added while ``len(b) * max(tokens) <= budget`` (so
``batch_size`` is ignored). A single sample over the budget forms its own batch.

Pure standard library (no torch): the sampler's config is imported by ``qie --help``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Hashable, Literal, Mapping, Optional, Sequence, Union

BucketPolicy = Literal["auto", "exact", "tokens"]
BUCKET_POLICIES: tuple[str, ...] = ("auto", "exact", "tokens")


@dataclass(frozen=True)
class SampleInfo:
    """What the sampler needs to know about one training sample (no tensors).

    ``index`` is what the sampler yields for this sample (for the trainer: the
    position in its ``CacheDataset``). ``tokens`` counts DiT image tokens of the
    target plus all reference images (``sum(h * w / 4)`` over latent shapes).
    ``ref_hw`` (latent ``(h, w)`` per reference image) is optional; without it the
    exact bucket key falls back to ``(target_hw, num_sources, tokens)``.
    """

    index: int
    dataset: str
    num_sources: int
    target_hw: tuple[int, int]
    tokens: int
    ref_hw: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.num_sources < 0:
            raise ValueError(f"sample {self.index}: num_sources must be >= 0, got {self.num_sources}")
        if self.tokens < 1:
            raise ValueError(f"sample {self.index}: tokens must be >= 1, got {self.tokens}")
        if self.ref_hw and len(self.ref_hw) != self.num_sources:
            raise ValueError(f"sample {self.index}: {len(self.ref_hw)} reference shapes given for "
                             f"num_sources={self.num_sources}")

    @classmethod
    def from_shapes(cls, index: int, dataset: str, target_hw: tuple[int, int],
                    ref_hw: Sequence[tuple[int, int]] = ()) -> "SampleInfo":
        """Build from latent shapes; tokens as the DiT counts them (2x2 patches)."""
        shapes = [tuple(target_hw), *(tuple(s) for s in ref_hw)]
        tokens = sum((h // 2) * (w // 2) for h, w in shapes)
        return cls(index=index, dataset=dataset, num_sources=len(shapes) - 1, target_hw=shapes[0],
                   tokens=tokens, ref_hw=tuple(shapes[1:]))

    @property
    def layout(self) -> Hashable:
        """Exact bucket key: samples with equal layouts batch without any padding."""
        if self.ref_hw or self.num_sources == 0:
            return (self.target_hw, self.ref_hw)
        return (self.target_hw, self.num_sources, self.tokens)


InfoLookup = Union[Sequence[SampleInfo], Mapping[int, SampleInfo]]


def info_lookup(infos: InfoLookup) -> Mapping[int, SampleInfo]:
    """``{info.index: info}``; a sequence whose positions already equal the indices is used as is."""
    if isinstance(infos, Mapping):
        return infos
    if all(info.index == k for k, info in enumerate(infos)):
        return dict(enumerate(infos))
    return {info.index: info for info in infos}


def batch_cost(batch: Sequence[int], lookup: Mapping[int, SampleInfo]) -> int:
    """Tokens the padded batch occupies: ``len(batch) * max(tokens)``."""
    return len(batch) * max(lookup[i].tokens for i in batch) if batch else 0


def padding_fraction(batches: Sequence[Sequence[int]], infos: InfoLookup) -> float:
    """Share of padded image tokens over all ``batches`` (0 = no padding); see the module docstring."""
    lookup = info_lookup(infos)
    padded = sum(batch_cost(b, lookup) for b in batches)
    if padded == 0:
        return 0.0
    real = sum(lookup[i].tokens for b in batches for i in b)
    return 1.0 - real / padded


def _chunk(samples: Sequence[SampleInfo], batch_size: int, max_tokens: Optional[int]) -> list[list[SampleInfo]]:
    """Consecutive batches of ``samples`` in their order (by count, or greedily under the token budget)."""
    if max_tokens is None:
        return [list(samples[j:j + batch_size]) for j in range(0, len(samples), batch_size)]
    batches: list[list[SampleInfo]] = []
    current: list[SampleInfo] = []
    longest = 0
    for s in samples:
        if current and (len(current) + 1) * max(longest, s.tokens) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(s)
        longest = max(longest, s.tokens)
    if current:
        batches.append(current)
    return batches


def _is_full(batch: Sequence[SampleInfo], batch_size: int, max_tokens: Optional[int]) -> bool:
    if max_tokens is None:
        return len(batch) >= batch_size
    longest = max(s.tokens for s in batch)
    return (len(batch) + 1) * longest > max_tokens  # one more equal sample would not fit


def build_batches(samples: Sequence[SampleInfo], rng: random.Random, batch_size: int = 1,
                  max_tokens_per_batch: Optional[int] = None, policy: BucketPolicy = "auto") -> list[list[int]]:
    """Batches (lists of ``SampleInfo.index``) of ``samples``, in an order shuffled by ``rng``.

    ``samples`` should already be in a random order (it decides who shares a batch
    among equals); duplicates (draws with replacement) are kept. Every sample lands
    in exactly one batch.
    """
    assert batch_size >= 1 and (max_tokens_per_batch is None or max_tokens_per_batch >= 1)
    if policy not in BUCKET_POLICIES:
        raise ValueError(f"unknown bucket policy {policy!r}; choose one of {list(BUCKET_POLICIES)}")
    batches: list[list[SampleInfo]] = []
    pool: list[SampleInfo]
    if policy == "tokens":
        pool = list(samples)
    else:
        buckets: dict[Hashable, list[SampleInfo]] = {}
        for s in samples:  # insertion order follows the (random) sample order: same on every rank
            buckets.setdefault(s.layout, []).append(s)
        pool = []
        for members in buckets.values():
            chunks = _chunk(members, batch_size, max_tokens_per_batch)
            if policy == "auto" and not _is_full(chunks[-1], batch_size, max_tokens_per_batch):
                pool.extend(chunks.pop())
            batches.extend(chunks)
    if pool:
        pool.sort(key=lambda s: s.tokens)  # stable: ties keep their random order
        batches.extend(_chunk(pool, batch_size, max_tokens_per_batch))
    rng.shuffle(batches)
    return [[s.index for s in b] for b in batches]


def even_out(batches: list[list[int]], world_size: int, drop_last: bool) -> tuple[list[list[int]], int, int]:
    """Make the batch count a multiple of ``world_size`` so every rank runs as many steps.

    Returns ``(batches, repeated, dropped)``: with ``drop_last`` the last
    ``len % world_size`` batches are dropped, otherwise the first ones are repeated
    (cyclically when there are fewer batches than ranks). Rank ``r`` then takes
    ``batches[r::world_size]``.
    """
    assert world_size >= 1
    rest = len(batches) % world_size
    if rest == 0:
        return batches, 0, 0
    if drop_last:
        return batches[:len(batches) - rest], 0, rest
    extra = world_size - rest
    return batches + [batches[j % len(batches)] for j in range(extra)], extra, 0
