"""The training batch sampler: bucketed real batches, weighted datasets, ranks, resume.

Per epoch, every rank computes the same global batch list from ``(seed, epoch)``:

1. *draw* — unweighted (no weight flag): every sample once, shuffled. Weighted
   (``--dataset_weights`` and/or ``--src_img_num_weights``): ``samples_per_epoch``
   draws with replacement, probabilities as in :mod:`.weighting`;
2. *bucket* — cut into batches by layout / token count (:mod:`.buckets`), shuffle
   the batches;
3. *even out* — make the count a multiple of the world size: repeat the first
   batches (default; logged "repeated k batches to even ranks") or, with
   ``--drop_last``, drop the last ones (logged with the number of samples lost);
4. rank ``r`` takes batches ``r, r+W, r+2W, ...``.

Each epoch (rank 0) logs the batch count, the padding fraction and the realised mix.
The draw and the batch order use separate RNG streams, so changing ``batch_size``
changes the batches but not which samples an epoch draws.

Usage in the trainer::

    infos = sample_infos_from_store(store, dataset.indices)      # index = dataset position
    sampler = BucketBatchSampler(infos, cfg, num_replicas=W, rank=r)
    sampler.load_state_dict(ckpt["sampler"])                        # when resuming
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    for epoch in range(sampler.epoch, num_epochs):
        sampler.set_epoch(epoch)                                    # keeps a resumed position
        for batch in loader: ...

It implements the batch-sampler protocol that ``DataLoader(batch_sampler=...)``
uses (``__iter__`` of index lists, ``__len__``) without subclassing
``torch.utils.data.Sampler``, so importing it (and :class:`SamplingConfig`, which
``qie train --help`` needs) does not import torch. DataLoader prefetching runs ahead
of the training step: for an exact resume record the position the *loop* reached
(``epoch``, batches consumed) and pass that to :meth:`load_state_dict`, or use
:meth:`epoch_batches` directly as ``training/data.py`` does.
"""
from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from ..utils.config_cli import cli_help as _help
from .buckets import (BUCKET_POLICIES, BucketPolicy, SampleInfo, batch_cost, build_batches, even_out, info_lookup,
                      padding_fraction)
from .weighting import (Mix, expected_mix, parse_dataset_weights, parse_src_img_num_weights, realised_mix,
                        sample_weights)

log = logging.getLogger(__name__)

__all__ = ["SamplingConfig", "BucketBatchSampler", "SampleInfo", "sample_infos_from_store", "padding_fraction",
           "realised_mix", "expected_mix", "Mix", "parse_dataset_weights", "parse_src_img_num_weights"]


@dataclass
class SamplingConfig:
    """Batching and sampling: buckets by image size, token budget, weighted datasets.

    ``batch_size`` and ``seed`` have no flags of their own (``cli=False``): ``qie
    train`` already has ``--batch_size`` and ``--seed`` (TrainConfig), and
    ``dataclass_from_args`` reads their values from the same namespace.
    """

    batch_size: int = field(default=1, metadata=_help("samples per batch (ignored with --max_tokens_per_batch)",
                                                     cli=False))
    max_tokens_per_batch: Optional[int] = field(default=None, metadata=_help(
        "token budget per batch instead of --batch_size: samples are added while batch size x longest "
        "sample's image tokens (target + references, 1 token per 2x2 latent pixels) stays within it; "
        "a single larger sample gets a batch of its own (warned)", metavar="TOKENS", unbounded=True))
    bucket_policy: BucketPolicy = field(default="auto", metadata=_help(
        "auto: batches of equal image layouts, leftovers grouped by token count; exact: equal layouts only "
        "(no padding, some short batches); tokens: grouped by token count only"))
    dataset_weights: Optional[str] = field(default=None, metadata=_help(
        "sample datasets by weight, e.g. \"a=0.5,b=1.2\"; datasets not named are excluded. Draws with "
        "replacement; P(group) ∝ weight whatever the group's size", metavar="NAME=W,..."))
    src_img_num_weights: Optional[str] = field(default=None, metadata=_help(
        "sample by number of source images, e.g. \"0=1,1=1,2=1,3=0\" (0 = text-to-image); counts not "
        "named are excluded", metavar="N=W,..."))
    samples_per_epoch: Optional[int] = field(default=None, metadata=_help(
        "weighted sampling: draws per epoch (default: the number of eligible samples)", metavar="N", unbounded=True))
    drop_last: bool = field(default=False, metadata=_help(
        "when the batches do not split evenly over processes, drop the last ones (logged) instead of "
        "repeating the first ones (logged)"))
    seed: int = field(default=0, metadata=_help("seed of the data order", cli=False))

    @property
    def weighted(self) -> bool:
        return bool((self.dataset_weights or "").strip() or (self.src_img_num_weights or "").strip())

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad flag."""
        if self.batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {self.batch_size}")
        if self.max_tokens_per_batch is not None and self.max_tokens_per_batch < 1:
            raise ValueError(f"--max_tokens_per_batch must be >= 1, got {self.max_tokens_per_batch}")
        if self.bucket_policy not in BUCKET_POLICIES:
            raise ValueError(f"--bucket_policy {self.bucket_policy!r} is not one of {list(BUCKET_POLICIES)}")
        if self.samples_per_epoch is not None:
            if self.samples_per_epoch < 1:
                raise ValueError(f"--samples_per_epoch must be >= 1, got {self.samples_per_epoch}")
            if not self.weighted:
                raise ValueError("--samples_per_epoch applies to weighted sampling only; add --dataset_weights "
                                 "or --src_img_num_weights, or drop it (an unweighted epoch is every sample once)")


def sample_infos_from_store(store, indices: Optional[Sequence[int]] = None, offset: int = 0,
                            dataset: Optional[str] = None) -> list[SampleInfo]:
    """:class:`SampleInfo` of a ``CacheStore``'s entries from ``store.meta`` (no tensor reads).

    ``indices`` selects store entries (default: all). The info of ``indices[k]`` gets
    ``index = offset + k`` — the position a ``CacheDataset(store, indices)`` takes, so
    the sampler's batches index that dataset directly (``offset`` places several
    stores in one concatenated dataset). ``dataset`` overrides the entries' dataset
    name (e.g. one name per cache directory).
    """
    chosen = range(len(store)) if indices is None else indices
    infos = []
    for k, i in enumerate(chosen):
        m = store.meta(i)
        infos.append(SampleInfo(
            index=offset + k, dataset=dataset or m.dataset, num_sources=m.n_edit,
            target_hw=(int(m.target_shape[-2]), int(m.target_shape[-1])), tokens=int(m.image_tokens),
            ref_hw=tuple((int(s[-2]), int(s[-1])) for s in m.edit_shapes)))
    return infos


class BucketBatchSampler:
    """Deterministic bucketed batches per ``(seed, epoch)``, this rank's share, resumable.

    Position: ``epoch`` and the number of this rank's batches of that epoch already
    handed out. Iteration yields the rest of the current epoch; running to the end
    moves to ``(epoch + 1, 0)``. ``set_epoch(e)`` with another epoch starts ``e`` at
    batch 0; with the current epoch it keeps the position (so a resumed run may call
    it). ``len()`` is the number of batches the next iteration yields.
    """

    def __init__(self, infos: Sequence[SampleInfo], config: SamplingConfig, num_replicas: int = 1, rank: int = 0):
        config.validate()
        if not infos:
            raise ValueError("no training samples (the cache is empty or all entries are held out for validation)")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} of {num_replicas} processes is not a valid rank")
        indices = [s.index for s in infos]
        if len(set(indices)) != len(indices):
            raise ValueError("SampleInfo.index values must be unique")
        self.infos = list(infos)
        self.config = config
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self._consumed = 0
        self._cached: Optional[tuple[int, list[list[int]]]] = None
        self._lookup = info_lookup(self.infos)

        self.eligible: list[SampleInfo] = self.infos
        self._cum_weights: Optional[list[float]] = None
        if config.weighted:
            ds_w = parse_dataset_weights(config.dataset_weights, (s.dataset for s in self.infos))
            src_w = parse_src_img_num_weights(config.src_img_num_weights)
            weights = sample_weights(self.infos, ds_w, src_w)
            pairs = [(s, w) for s, w in zip(self.infos, weights) if w > 0]
            self.eligible = [s for s, _ in pairs]
            self._cum_weights = list(itertools.accumulate(w for _, w in pairs))
            self.samples_per_epoch = config.samples_per_epoch or len(self.eligible)
            self.expected = expected_mix(self.eligible, [w for _, w in pairs], self.samples_per_epoch)
            if rank == 0:
                log.info("weighted sampling: %d of %d samples eligible, %d draws per epoch; expected mix: %s",
                         len(self.eligible), len(self.infos), self.samples_per_epoch, self.expected.describe())
        else:
            self.samples_per_epoch = len(self.infos)
            self.expected = expected_mix(self.infos, [1.0] * len(self.infos), len(self.infos))
        if config.max_tokens_per_batch is not None and config.batch_size != 1 and rank == 0:
            log.info("--max_tokens_per_batch %d sets the batch sizes; --batch_size %d is ignored",
                     config.max_tokens_per_batch, config.batch_size)

    # -- the epoch's batches
    def global_batches(self, epoch: int) -> list[list[int]]:
        """Every rank's batches of ``epoch`` in order, evened out: rank r's are ``[r::num_replicas]``."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        cfg = self.config
        draw_rng = random.Random(f"{cfg.seed}/{epoch}/draw")
        if self._cum_weights is not None:
            drawn = draw_rng.choices(self.eligible, cum_weights=self._cum_weights, k=self.samples_per_epoch)
        else:
            drawn = list(self.eligible)
            draw_rng.shuffle(drawn)
        batches = build_batches(drawn, random.Random(f"{cfg.seed}/{epoch}/batches"), cfg.batch_size,
                                cfg.max_tokens_per_batch, cfg.bucket_policy)
        built = len(batches)
        batches, repeated, dropped = even_out(batches, self.num_replicas, cfg.drop_last)
        if not batches:
            raise ValueError(f"--drop_last leaves no batches: {built} batch(es) per epoch for {self.num_replicas} "
                             "processes; use fewer processes, a smaller batch or no --drop_last")
        if self.rank == 0:
            self._report(epoch, batches, built, repeated, dropped, len(drawn))
        self._cached = (epoch, batches)
        return batches

    def _report(self, epoch: int, batches: list[list[int]], built: int, repeated: int, dropped: int,
                drawn: int) -> None:
        if repeated:
            log.info("epoch %d: %d batches do not split evenly over %d processes: repeated %d batches to even ranks",
                     epoch, built, self.num_replicas, repeated)
        if dropped:
            lost = drawn - sum(len(b) for b in batches)
            log.warning("epoch %d: --drop_last dropped %d of %d batches (%d samples) so %d processes get equal "
                        "shares", epoch, dropped, built, lost, self.num_replicas)
        budget = self.config.max_tokens_per_batch
        if budget is not None:
            over = [b for b in batches if batch_cost(b, self._lookup) > budget]
            if over:
                log.warning("epoch %d: %d sample(s) exceed --max_tokens_per_batch %d on their own (e.g. index %d "
                            "with %d tokens); each is a batch of its own", epoch, len(over), budget, over[0][0],
                            self._lookup[over[0][0]].tokens)
        log.info("epoch %d: %d batches (%d per process), padding %.1f%% of image tokens; mix: %s", epoch,
                 len(batches), len(batches) // self.num_replicas, 100 * padding_fraction(batches, self._lookup),
                 realised_mix(batches, self._lookup).describe())

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch`` (the interface ``training/data.py`` iterates)."""
        return self.global_batches(epoch)[self.rank::self.num_replicas]

    # -- torch batch-sampler protocol
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._consumed = epoch, 0

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        batches = self.epoch_batches(epoch)
        while self.epoch == epoch and self._consumed < len(batches):
            self._consumed += 1
            yield list(batches[self._consumed - 1])
        if self.epoch == epoch:
            self.epoch, self._consumed = epoch + 1, 0

    def __len__(self) -> int:
        return len(self.epoch_batches(self.epoch)) - self._consumed

    # -- resume
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self._consumed, "seed": self.config.seed,
                "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state`` (``epoch``, ``batch`` = this rank's batches consumed in it)."""
        for key in ("seed", "num_replicas"):
            ours = self.config.seed if key == "seed" else self.num_replicas
            if key in state and state[key] != ours:
                raise ValueError(f"sampler state was saved with {key}={state[key]}, this run has {key}={ours}; "
                                 f"resume with the same --seed and number of processes (the batch order depends on both)")
        epoch, batch = int(state["epoch"]), int(state["batch"])
        total = len(self.epoch_batches(epoch))
        if not 0 <= batch <= total:
            raise ValueError(f"sampler state batch {batch} is outside epoch {epoch}'s {total} batches; "
                             "the data or sampling flags changed since the checkpoint")
        self.epoch, self._consumed = epoch, batch
