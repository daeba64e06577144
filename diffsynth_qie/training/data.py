"""Phase-2 data: cache entries as training samples, real batches, resumable iteration.

Pieces, in the order the trainer builds them (:func:`build_training_data`):

- one :class:`~diffsynth_qie.cache.store.CacheStore` per ``--cache_dir``, each its own
  dataset (named by the entries' recorded dataset, or ``NAME=DIR``), concatenated into
  one :class:`CacheDataset`;
- :class:`~diffsynth_qie.data.sampling.BucketBatchSampler` over the dataset's
  :class:`~diffsynth_qie.data.buckets.SampleInfo` s: batches bucketed by image layout /
  token count (``--batch_size`` or ``--max_tokens_per_batch``), optionally weighted over
  datasets and source-image counts; it logs each epoch's padding fraction and realised
  mix (rank 0). Every rank computes the same global batch list and takes its own share,
  so the DataLoader is *not* handed to ``accelerator.prepare`` (which would re-shard it);
- :func:`iterate_batches`: the endless stream of micro-batches with the position after
  each one, which the checkpoint stores.

Every random choice is a pure function of ``(seed, epoch, entry)``, never of a
process-global RNG or of how many batches came before:

- CFG dropout (train this sample with the cached empty-prompt embedding) and the
  choice among prompt alternatives (``instruction`` / ``instruction_cn``) in
  :class:`CacheDataset`;
- which samples an epoch draws and how they are batched and ordered (the sampler).

So a run resumed at ``(epoch, batch)`` sees exactly the batches an uninterrupted run
would, with any number of DataLoader workers. Anything with ``epoch_batches(epoch) ->
list[list[int]]`` can stand in for the sampler (the trainer uses
:class:`~diffsynth_qie.data.sampling.BucketBatchSampler`).
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Iterator, Optional, Sequence

import torch

from ..cache.store import CacheStore
from ..data.sampling import BucketBatchSampler, SampleInfo, SamplingConfig, sample_infos_from_store

log = logging.getLogger(__name__)

# Keys whose values are tensors (or lists of tensors, or None) moved to the DiT's device/dtype.
TENSOR_KEYS = ("target_latents", "edit_latents", "prompt_emb", "empty_prompt_emb", "back_mask", "ref_gt_latents",
               "sub_noise", "sub_noise_ref_gt", "lbm_source_latents", "rejected_latents")


def sample_rng(seed: int, epoch: int, index: "int | str", purpose: str) -> random.Random:
    """A private RNG for one decision about one entry in one epoch (string seeds hash with SHA-512)."""
    return random.Random(f"{seed}/{epoch}/{index}/{purpose}")


@dataclass(frozen=True)
class SampleKey:
    """What a batch sampler yields per sample: the dataset position and the epoch it is drawn in."""

    index: int
    epoch: int


@dataclass(frozen=True)
class CachePart:
    """One cache in the training set: its store, the entries trained on, an optional dataset name.

    ``name`` (from ``--cache_dir NAME=DIR``) overrides the dataset name the entries
    hold (the one ``qie cache`` recorded).
    """

    store: CacheStore
    indices: tuple[int, ...]
    name: Optional[str] = None


class CacheDataset(torch.utils.data.Dataset):
    """Samples from one or several :class:`CacheStore` s, as dicts of tensors.

    ``CacheDataset(store, indices)`` reads one store (a subset given by ``indices``);
    :meth:`from_parts` concatenates several (one per ``--cache_dir``): dataset
    position ``p`` is the ``p``-th entry of the parts in order.

    ``dataset[SampleKey(p, epoch)]`` loads the entry at position ``p`` and picks its
    prompt: with probability ``cfg_dropout`` the cached empty-prompt embedding
    (``dropped``), otherwise one of its prompt alternatives uniformly. Plain
    ``dataset[p]`` means epoch 0. The choice depends on ``(seed, epoch, entry)``
    only; an entry of the first part is keyed by its store index, of part ``k > 0``
    by ``"k:index"`` (so the first cache alone behaves as a single-store dataset).
    """

    def __init__(self, store: CacheStore, indices: Optional[Sequence[int]] = None, seed: int = 0,
                 cfg_dropout: float = 0.0, name: Optional[str] = None):
        chosen = range(len(store)) if indices is None else indices
        self._init([CachePart(store, tuple(int(i) for i in chosen), name)], seed, cfg_dropout)

    @classmethod
    def from_parts(cls, parts: Sequence[CachePart], seed: int = 0, cfg_dropout: float = 0.0) -> "CacheDataset":
        self = cls.__new__(cls)
        self._init(list(parts), seed, cfg_dropout)
        return self

    def _init(self, parts: list[CachePart], seed: int, cfg_dropout: float) -> None:
        assert parts, "a dataset needs at least one cache"
        self.parts = parts
        self.items = [(k, i) for k, part in enumerate(parts) for i in part.indices]  # position -> (part, entry)
        self.seed = seed
        self.cfg_dropout = cfg_dropout

    def __len__(self) -> int:
        return len(self.items)

    def meta(self, position: int):
        k, i = self.items[position]
        return self.parts[k].store.meta(i)

    def dataset_name(self, position: int) -> str:
        k, i = self.items[position]
        return self.parts[k].name or self.parts[k].store.meta(i).dataset

    def sample_infos(self) -> list[SampleInfo]:
        """What the batch sampler needs per position (``SampleInfo.index`` = dataset position); no tensor reads."""
        infos: list[SampleInfo] = []
        for part in self.parts:
            infos += sample_infos_from_store(part.store, part.indices, offset=len(infos), dataset=part.name)
        return infos

    def __getitem__(self, key: SampleKey | int) -> dict:
        if not isinstance(key, SampleKey):
            key = SampleKey(int(key), 0)
        part_index, store_index = self.items[key.index]
        part = self.parts[part_index]
        entry = part.store.load(store_index, epoch=key.epoch)
        rng_key = store_index if part_index == 0 else f"{part_index}:{store_index}"
        dropped = self.cfg_dropout > 0 and sample_rng(self.seed, key.epoch, rng_key, "cfg").random() < self.cfg_dropout
        if dropped:
            prompt_index, prompt = -1, entry.empty_prompt_emb
        else:
            prompt_index = sample_rng(self.seed, key.epoch, rng_key, "prompt").randrange(len(entry.prompt_embs))
            prompt = entry.prompt_embs[prompt_index]
        return {
            "index": store_index,
            "position": key.index,
            "dataset": part.name or entry.dataset,
            "entry_id": entry.entry_id,
            "inverse": entry.inverse,
            "prompt_index": prompt_index,
            "dropped": dropped,
            "prompt_emb": prompt,
            "prompt_text": prompt_text(part.store, store_index, prompt_index),  # (a reward's instruction)
            "prompt_extras": entry.extras_of(prompt_index),  # the family's prompt tensors (Family.prompt_tensors)
            "empty_prompt_emb": entry.empty_prompt_emb,
            "empty_prompt_extras": entry.extras_of(-1),  # (a CFG pass's negative: --loss dmd's teacher)
            "target_latents": entry.target_latents,
            "edit_latents": list(entry.edit_latents),
            "back_mask": entry.back_mask,
            "ref_gt_latents": entry.ref_gt_latents,
            "sub_noise": entry.sub_noise,
            "sub_noise_ref_gt": entry.sub_noise_ref_gt,
            "lbm_source_latents": entry.lbm_source_latents,
            "rejected_latents": entry.rejected_latents,  # a preference row's rejected output (--loss dpo)
        }


def prompt_text(store, index: int, prompt_index: int) -> str:
    """The text of a cached row's prompt (``""`` for the dropped one or a store that keeps none)."""
    prompts = getattr(store.meta(index), "prompts", None) or []
    return prompts[prompt_index] if 0 <= prompt_index < len(prompts) else ""


def collate(samples: list[dict]) -> dict:
    """Dict of per-sample lists (shapes may differ; ``dit_forward`` pads when they do)."""
    return {k: [s[k] for s in samples] for k in samples[0]}


@dataclass(frozen=True)
class DataPosition:
    """Where the stream of micro-batches stands: the next batch is ``epoch_batches(epoch)[batch]``."""

    epoch: int = 0
    batch: int = 0

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    @classmethod
    def from_json(cls, d: dict) -> "DataPosition":
        return cls(epoch=int(d["epoch"]), batch=int(d["batch"]))


def iterate_batches(dataset: CacheDataset, sampler: BucketBatchSampler, start: DataPosition,
                    num_workers: int = 0) -> Iterator[tuple[dict, DataPosition]]:
    """Endless micro-batches from ``start`` on, each with the position *after* it (to checkpoint).

    A plain DataLoader over this rank's batches of each epoch: the sampler has already
    sharded them, so it must not go through ``accelerator.prepare``.
    """
    epoch, first = start.epoch, start.batch
    while True:
        batches = sampler.epoch_batches(epoch)
        if first < len(batches):
            keys = [[SampleKey(i, epoch) for i in b] for b in batches[first:]]
            loader = torch.utils.data.DataLoader(dataset, batch_sampler=keys, collate_fn=collate,
                                                 num_workers=num_workers)
            for j, batch in enumerate(loader, start=first):
                yield batch, DataPosition(epoch, j + 1) if j + 1 < len(batches) else DataPosition(epoch + 1, 0)
        epoch, first = epoch + 1, 0


def batch_image_tokens(batch: dict) -> tuple[int, int]:
    """``(real, padded)`` DiT image tokens of a collated batch (target + references, 2x2 patches).

    ``padded = len(batch) * max(real per sample)``: what ``models.forward.dit_forward``
    computes on (as ``data.buckets.padding_fraction`` counts it).
    """
    per_sample = [sum((int(t.shape[-2]) // 2) * (int(t.shape[-1]) // 2) for t in [target, *edits])
                  for target, edits in zip(batch["target_latents"], batch["edit_latents"])]
    return sum(per_sample), len(per_sample) * max(per_sample, default=0)


# --- the trainer's data -----------------------------------------------------------
def split_holdout(n: int, num_validation: int, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out validation indices), deterministic per seed."""
    if num_validation <= 0:
        return list(range(n)), []
    if num_validation >= n:
        raise ValueError(f"--num_validation {num_validation} would hold out all {n} cache entries; "
                         f"use at most {n - 1} (or --validate_every 0)")
    held = sorted(random.Random(f"{seed}/validation").sample(range(n), num_validation))
    return [i for i in range(n) if i not in set(held)], held


def parse_cache_spec(spec: str) -> tuple[Optional[str], str]:
    """``"NAME=DIR"`` -> ``(NAME, DIR)``, ``"DIR"`` -> ``(None, DIR)``.

    A value that is an existing directory stays a path even if it holds ``=``; a
    name is a non-empty string without ``/``.
    """
    name, sep, path = spec.partition("=")
    if not sep or Path(spec).is_dir() or not name or "/" in name or "\\" in name:
        return None, spec
    if not path:
        raise ValueError(f"--cache_dir {spec!r}: no directory after {name + '='!r}; use NAME=DIR or DIR")
    return name, path


def open_cache(cache_dir: str, preset) -> CacheStore:
    """Open one cache and check it was encoded for ``preset``'s prompt template."""
    store = CacheStore.open(cache_dir)
    if len(store) == 0:
        raise ValueError(f"cache {cache_dir} has no entries; check `qie cache`'s skipped.jsonl")
    cached = store.manifest.get("preset")
    if store.family != preset.family:
        raise ValueError(f"cache {cache_dir} was encoded for {store.family} (preset {cached!r}), but --model "
                         f"{preset.name} is {preset.family}: the two families' latents and prompt embeddings do not "
                         f"mix; re-run `qie cache --model {preset.name}` into another --cache_dir, or train with a "
                         f"{store.family} preset")
    multi = store.manifest.get("multi_image_prompt")
    if multi is not None and bool(multi) != preset.multi_image_prompt:
        raise ValueError(f"cache {cache_dir} was encoded for preset {cached!r} with the "
                         f"{'multi' if multi else 'single'}-image prompt template, but --model {preset.name} uses the "
                         f"{'multi' if preset.multi_image_prompt else 'single'}-image one; re-run `qie cache --model "
                         f"{preset.name}` or train with a matching --model")
    if cached and cached != preset.name:
        log.warning("cache %s was encoded with preset %r; training preset %r", cache_dir, cached, preset.name)
    return store


def _open_caches(cache_dirs: "str | Sequence[str]", preset) -> tuple[list, list[CacheStore]]:
    cache_dirs = [cache_dirs] if isinstance(cache_dirs, str) else list(cache_dirs)
    if not cache_dirs:
        raise ValueError("no cache given; pass --cache_dir DIR (made by `qie cache`)")
    specs = [parse_cache_spec(c) for c in cache_dirs]
    seen: set = set()
    for name, d in specs:  # the same cache twice as the same dataset would silently count every sample twice
        if (name, Path(d).resolve()) in seen:
            raise ValueError(f"--cache_dir names {d} twice as {'dataset ' + repr(name) if name else 'one dataset'}; "
                             "give each cache once and weigh datasets with --dataset_weights NAME=W (or name the "
                             "copies apart, NAME=DIR)")
        seen.add((name, Path(d).resolve()))
    return specs, [open_cache(d, preset) for _, d in specs]


@dataclass
class TrainingData:
    """What :func:`build_training_data` returns."""

    dataset: CacheDataset
    sampler: BucketBatchSampler
    validation_store: CacheStore       # the first cache: held-out entries come from it
    validation_indices: list[int]


def build_training_data(cache_dirs: "str | Sequence[str]", preset, sampling: SamplingConfig, *, seed: int = 0,
                        cfg_dropout: float = 0.0, num_validation: int = 0, num_replicas: int = 1,
                        rank: int = 0, live=None) -> TrainingData:
    """Open every cache (``[NAME=]DIR``), hold out validation entries of the first, build dataset and sampler.

    Caches must come from the same encoders (equal ``encoder_fingerprint``). Caches whose
    entries have the same dataset name are sampled as one dataset (logged). ``live``: train on this
    ``cache.live.LiveStore`` (``--on_the_fly``) instead of caches.
    """
    if live is not None:
        specs, stores = [(None, str(live.config.dataset.dataset_metadata))], [live]
    else:
        specs, stores = _open_caches(cache_dirs, preset)
    fingerprints = {d: s.manifest.get("encoder_fingerprint") for (_, d), s in zip(specs, stores)}
    if len({f for f in fingerprints.values() if f}) > 1:
        raise ValueError(f"the caches were encoded by different text encoders / VAEs (encoder_fingerprint per "
                         f"cache: {fingerprints}); re-run `qie cache` with the same --model for all of them")
    train_idx, val_idx = split_holdout(len(stores[0]), num_validation, seed)
    parts = [CachePart(store, tuple(train_idx) if k == 0 else tuple(range(len(store))), name)
             for k, ((name, _), store) in enumerate(zip(specs, stores))]
    dataset = CacheDataset.from_parts(parts, seed=seed, cfg_dropout=cfg_dropout)
    owners: dict[str, list[str]] = {}
    for (name, d), part in zip(specs, parts):
        for ds in sorted({name or part.store.meta(i).dataset for i in part.indices}):
            owners.setdefault(ds, []).append(d)
    if len(specs) > 1 and rank == 0:
        log.info("training data: %s", "; ".join(f"dataset {ds!r} from {', '.join(ds_dirs)}"
                                               for ds, ds_dirs in owners.items()))
        shared = {ds: ds_dirs for ds, ds_dirs in owners.items() if len(ds_dirs) > 1}
        if shared:
            log.info("caches %s share a dataset name and are sampled as one dataset; name them apart with "
                     "--cache_dir NAME=DIR", shared)
    sampler = BucketBatchSampler(dataset.sample_infos(), sampling, num_replicas=num_replicas, rank=rank)
    return TrainingData(dataset=dataset, sampler=sampler, validation_store=stores[0],
                        validation_indices=val_idx)
