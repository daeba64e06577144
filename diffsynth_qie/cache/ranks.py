"""Who caches what in a ``qie cache`` run: this process's rank (:class:`Dist`), the directory's lock held for
the run, and this rank's share of the metadata rows (row ``i`` goes to rank ``i % world_size``), validated."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..data.formats import read_rows
from ..models.presets import family_of
from ..data.rows import EditRow, SkippedRow, log_skip, validate_rows
from ..utils.dir_lock import CacheLock
from . import store
from .config import CacheConfig
from .settings import skip_long_prompts

# ----------------------------------------------------------------------------- distribution


@dataclass
class Dist:
    """This process's place in the run. ``state`` is accelerate's ``PartialState`` when the
    ranks of this run share a process group, else None (one process, or ranks run one
    after another with explicit ``rank``/``world_size``)."""

    rank: int
    world_size: int
    device: Any = None
    state: Any = None

    def barrier(self) -> None:
        if self.state is not None:
            self.state.wait_for_everyone()

    def from_rank0(self, value):
        """``value`` as rank 0 has it, on every rank."""
        if self.state is None:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]


def dist_context(rank: int | None, world_size: int | None) -> Dist:
    """Launched distributed (``WORLD_SIZE`` > 1, as ``accelerate launch``/torchrun set it):
    accelerate's ``PartialState``, as the trainer's Accelerator uses it (gloo on a
    CPU-only machine). Otherwise rank 0 of 1. Explicit ``rank``/``world_size`` win.
    """
    dist = Dist(0, 1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch
        from accelerate import PartialState

        launched = PartialState(cpu=not torch.cuda.is_available())
        dist.device = launched.device
        if rank is None and world_size is None:
            rank, world_size = launched.process_index, launched.num_processes
        if world_size == launched.num_processes > 1:
            dist.state = launched
    dist.rank = 0 if rank is None else rank
    dist.world_size = 1 if world_size is None else world_size
    if not 0 <= dist.rank < dist.world_size:
        raise ValueError(f"rank {dist.rank} is outside world_size {dist.world_size}")
    return dist


def lock_dir(cache_dir: Path, dist: Dist, timeout: float) -> CacheLock:
    """The directory's lock: taken by rank 0 for the whole run when the ranks share a process
    group, else by this process. Every rank raises the same ValueError if it is taken."""
    lock = CacheLock(cache_dir)
    error = None
    if dist.state is None or dist.rank == 0:
        try:
            lock.acquire(timeout)
        except ValueError as e:  # (UnwritableDirectory too: rank 0 keeps its type for the read-only check)
            error = e
    message = dist.from_rank0(None if error is None else str(error))
    if message:
        lock.release()
        raise error if error is not None else ValueError(message)
    return lock


def rank_report_path(cache_dir: Path, rank: int, world_size: int) -> Path:
    return cache_dir / store.PARTS_DIR / f"rank-{rank:04d}-of-{world_size:04d}.json"


# ----------------------------------------------------------------------------- this rank's rows


@dataclass
class RankRows:
    """This rank's share of the metadata after validation."""

    good: list[EditRow]
    skipped: list[SkippedRow]
    index_of: dict[str, int]  # row id -> position in the metadata (manifest order)
    n_total: int  # rows this rank accounts for in the bad-row fraction


def rank_rows(config: CacheConfig, preset, rank: int, world_size: int) -> RankRows:
    """Read the metadata, take rows ``i % world_size == rank`` and validate them. Rows that
    fail to parse are reported by rank 0 only (every rank parses the same file)."""
    ds = config.dataset
    parse_skipped: list[SkippedRow] = []
    rows = read_rows(ds.dataset_metadata, ds.dataset_base, dataset_name=ds.dataset_name, fields=config.fields,
                     disable_inverse=ds.disable_inverse, t2i_mode=ds.t2i_mode, skipped=parse_skipped)
    mine = [(i, r) for i, r in enumerate(rows) if i % world_size == rank]
    good, skipped = validate_rows([r for _, r in mine], check_images=config.check_images)
    if not preset.multi_image_prompt:
        for r in [r for r in good if r.num_sources > 1]:
            s = SkippedRow(r.row_id, "edit_images", None,
                           f"preset {preset.name} takes one reference image, the row has {r.num_sources}; "
                           "use the 2509 or 2511 preset for several")
            log_skip(s)
            skipped.append(s)
        good = [r for r in good if r.num_sources <= 1]
    limit = family_of(preset).max_references  # (DiffSynth fails later on more, or truncates)
    for r in [r for r in good if r.num_sources > limit]:
        s = SkippedRow(r.row_id, "edit_images", None, f"{r.num_sources} reference images, but {preset.name} takes at "
                       f"most {limit}; split the row or keep {limit} references")
        log_skip(s)
        skipped.append(s)
    good = [r for r in good if r.num_sources <= limit]
    if rank != 0:
        parse_skipped = []
    return RankRows(good=good, skipped=parse_skipped + skipped, index_of={r.row_id: i for i, r in mine},
                     n_total=len(mine) + len(parse_skipped))


def drop_long_prompts(share: RankRows, pipe, max_tokens: int) -> None:
    """Move rows with a prompt over ``max_tokens`` tokens from ``share.good`` to ``share.skipped``."""
    share.good, skipped = skip_long_prompts(share.good, pipe, max_tokens)
    share.skipped.extend(skipped)
