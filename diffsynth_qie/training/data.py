"""Phase-2 data: cache entries as training samples, a deterministic batch sampler, resumable iteration.

Every random choice is a pure function of ``(seed, epoch, entry)``, never of a
process-global RNG or of how many batches came before:

- CFG dropout (train this sample with the cached empty-prompt embedding) and the
  choice among prompt alternatives (``instruction`` / ``instruction_cn``) in
  :class:`CacheDataset`;
- the order of batches in :class:`GroupedBatchSampler`.

So a run resumed at ``(epoch, batch)`` sees exactly the batches an uninterrupted run
would, with any number of DataLoader workers. The sampler is its own small class so
issue 6's bucketing / weighted multi-dataset sampler can replace it: anything with
``epoch_batches(epoch) -> list[list[int]]`` works.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Hashable, Iterator, Optional, Sequence

import torch

from ..cache.store import CacheStore

log = logging.getLogger(__name__)

# Keys whose values are tensors (or lists of tensors, or None) moved to the DiT's device/dtype.
TENSOR_KEYS = ("target_latents", "edit_latents", "prompt_emb", "empty_prompt_emb", "back_mask", "ref_gt_latents",
               "sub_noise", "sub_noise_ref_gt", "lbm_source_latents")


def sample_rng(seed: int, epoch: int, index: int, purpose: str) -> random.Random:
    """A private RNG for one decision about one entry in one epoch (string seeds hash with SHA-512)."""
    return random.Random(f"{seed}/{epoch}/{index}/{purpose}")


@dataclass(frozen=True)
class SampleKey:
    """What a batch sampler yields per sample: the dataset position and the epoch it is drawn in."""

    index: int
    epoch: int


class CacheDataset(torch.utils.data.Dataset):
    """Samples from a :class:`CacheStore` (a subset given by ``indices``), as dicts of tensors.

    ``dataset[SampleKey(i, epoch)]`` loads entry ``indices[i]`` and picks its prompt:
    with probability ``cfg_dropout`` the cached empty-prompt embedding (``dropped``),
    otherwise one of its prompt alternatives uniformly. Plain ``dataset[i]`` means
    epoch 0.
    """

    def __init__(self, store: CacheStore, indices: Optional[Sequence[int]] = None, seed: int = 0,
                 cfg_dropout: float = 0.0):
        self.store = store
        self.indices = list(range(len(store))) if indices is None else list(indices)
        self.seed = seed
        self.cfg_dropout = cfg_dropout

    def __len__(self) -> int:
        return len(self.indices)

    def group_key(self, i: int) -> Hashable:
        """Samples with equal keys have equal image layouts (no padding when batched together)."""
        m = self.store.meta(self.indices[i])
        return (tuple(m.target_shape), tuple(tuple(s) for s in m.edit_shapes))

    def __getitem__(self, key: SampleKey | int) -> dict:
        if not isinstance(key, SampleKey):
            key = SampleKey(int(key), 0)
        store_index = self.indices[key.index]
        entry = self.store.load(store_index)
        dropped = self.cfg_dropout > 0 and sample_rng(self.seed, key.epoch, store_index, "cfg").random() < self.cfg_dropout
        if dropped:
            prompt_index, prompt = -1, entry.empty_prompt_emb
        else:
            prompt_index = sample_rng(self.seed, key.epoch, store_index, "prompt").randrange(len(entry.prompt_embs))
            prompt = entry.prompt_embs[prompt_index]
        return {
            "index": store_index,
            "entry_id": entry.entry_id,
            "prompt_index": prompt_index,
            "dropped": dropped,
            "prompt_emb": prompt,
            "empty_prompt_emb": entry.empty_prompt_emb,
            "target_latents": entry.target_latents,
            "edit_latents": list(entry.edit_latents),
            "back_mask": entry.back_mask,
            "ref_gt_latents": entry.ref_gt_latents,
            "sub_noise": entry.sub_noise,
            "sub_noise_ref_gt": entry.sub_noise_ref_gt,
            "lbm_source_latents": entry.lbm_source_latents,
        }


def collate(samples: list[dict]) -> dict:
    """Dict of per-sample lists (shapes may differ; ``dit_forward`` pads when they do)."""
    return {k: [s[k] for s in samples] for k in samples[0]}


class GroupedBatchSampler:
    """Deterministic, shape-grouped batches per ``(seed, epoch)``, sharded over ranks.

    Per epoch: shuffle the samples, group them by ``group_keys`` (equal image layouts),
    cut each group into batches of ``batch_size`` (the last one of a group may be
    smaller; nothing is dropped), shuffle the batches. With several ranks the batch
    list is padded by repeating its first batches to a multiple of ``num_replicas``
    (logged), and rank r takes batches ``r, r+W, ...`` — every rank runs the same
    number of steps and all ranks agree on the order.
    """

    def __init__(self, group_keys: Sequence[Hashable], batch_size: int, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not group_keys:
            raise ValueError("no training samples (the cache is empty or all entries are held out for validation)")
        assert 0 <= rank < num_replicas
        self.group_keys = list(group_keys)
        self.batch_size = batch_size
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self._warned = False

    def global_batches(self, epoch: int) -> list[list[int]]:
        """All ranks' batches of ``epoch`` in order (before sharding and padding)."""
        rng = random.Random(f"{self.seed}/{epoch}/batches")
        order = list(range(len(self.group_keys)))
        rng.shuffle(order)
        groups: dict[Hashable, list[int]] = {}
        for i in order:
            groups.setdefault(self.group_keys[i], []).append(i)
        batches = [members[j:j + self.batch_size]
                   for members in groups.values() for j in range(0, len(members), self.batch_size)]
        rng.shuffle(batches)
        return batches

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch``."""
        batches = self.global_batches(epoch)
        extra = (-len(batches)) % self.num_replicas
        if extra:
            if not self._warned:
                log.info("%d batches per epoch do not split evenly over %d processes: %d batch(es) repeated per epoch",
                         len(batches), self.num_replicas, extra)
                self._warned = True
            batches = batches + [batches[i % len(batches)] for i in range(extra)]
        return batches[self.rank::self.num_replicas]

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self.epoch_batches(0))


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


def iterate_batches(dataset: CacheDataset, sampler: GroupedBatchSampler, start: DataPosition,
                    num_workers: int = 0) -> Iterator[tuple[dict, DataPosition]]:
    """Endless micro-batches from ``start`` on, each with the position *after* it (to checkpoint)."""
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
