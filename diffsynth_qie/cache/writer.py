"""Phase 1 of split training: run the text encoder and the VAE once per row into the cache.

Why not DiffSynth's ``sft:data_process``: it pickles whole input dicts, freezes
training flags into them and has no resume. Here each rank encodes its share of
rows (row ``i`` goes to rank ``i % world_size``) into safetensors shards
(``shards.ShardWriter``), skipping rows whose content hash is already cached, and
rank 0 finalises (``shards.finalize_store``): stale entries dropped, shards
compacted, ``manifest.json`` written last. One run per directory: the run holds
the directory's lock (``utils/dir_lock.py``) throughout; a finished cache on a
read-only mount is checked instead of written (:func:`_check_read_only`).

Which rows this rank takes, and the lock, are in ``ranks.py``; how a row becomes tensors (image sizing,
prompt encoding) is in ``encode.py``; the merge of every rank's report into the manifest in ``finalize.py``.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from ..data.rows import EditRow, check_bad_fraction, write_skipped
from ..utils.atomic import atomic_write_json
from ..utils.dir_lock import UnwritableDirectory
from ..utils.shared_dir import check_shared_dir
from . import shards, store
from .config import CacheConfig, CacheSummary
from .encode import encode_prepared, entry_meta, prefetch, prepare_row, white_key
from .finalize import finalize_cache, finalize_reports, manifest_fields, run_key
from .fingerprint import FileHasher, read_hash_memo, row_content_hash, write_hash_memo
from .ranks import Dist, RankRows, dist_context, drop_long_prompts, lock_dir, rank_report_path, rank_rows
from .settings import cache_settings, light_pipeline, load_encoders
from .shards import ShardWriter
from .store import EntryMeta

__all__ = ["CacheConfig", "CacheSummary", "cache_settings", "finalize_cache", "write_cache"]

log = logging.getLogger(__name__)


def _encode_rows(pipe, config: CacheConfig, preset, todo: list[tuple[EditRow, str]], writer: ShardWriter,
                 show_progress: bool, on_entry: Callable[[EntryMeta], None] | None) -> None:
    """Decode (threads, ahead) and encode (this thread) each row, queueing entries into ``writer``."""
    from tqdm import tqdm

    from ..models.family_ops import ops_for

    ops = ops_for(preset.family)
    ds = config.dataset
    base = Path(ds.dataset_base) if ds.dataset_base else Path(ds.dataset_metadata).parent
    hash_of = {r.row_id: h for r, h in todo}
    bar = tqdm(total=len(todo), unit="row", desc="qie cache", disable=not show_progress or not todo,
               dynamic_ncols=True)
    try:
        for prep in prefetch(lambda rh: prepare_row(rh[0], config, ops), todo, config.num_workers):
            entry = encode_prepared(pipe, prep, preset.multi_image_prompt, ops)
            sub_key = white_key(pipe, writer, prep.target.size, ops)
            sub_ref = white_key(pipe, writer, prep.ref_gt.size, ops) if prep.ref_gt is not None else None
            meta = entry_meta(prep, entry, hash_of[prep.row.row_id], sub_key, sub_ref, base, ops.family.patch)
            writer.add(entry, meta)
            bar.update(1)
            if on_entry is not None:
                on_entry(meta)
    finally:
        bar.close()
        writer.flush()  # keep every finished entry, also when interrupted


def write_cache(config: CacheConfig, pipe=None, rank: int | None = None, world_size: int | None = None, *,
                finalize: bool | None = None, on_entry: Callable[[EntryMeta], None] | None = None) -> CacheSummary:
    """Cache this rank's share of the dataset into ``config.cache_dir``; rank 0 then finalises.

    ``rank``/``world_size`` default to the launcher's (``accelerate launch``; 0/1 when
    not launched distributed). ``pipe`` (text encoder + VAE) is loaded from the preset
    if not given. ``finalize`` defaults to ``rank == 0``; it runs after a barrier and
    needs every rank's report (``parts/rank-*.json``), so when ranks run one after
    another without a process group, run rank 0 last or call :func:`finalize_cache`.
    ``on_entry(meta)`` runs after each computed entry is queued for writing.
    """
    t0 = time.perf_counter()
    dist = dist_context(rank, world_size)
    rank, world_size = dist.rank, dist.world_size
    if not config.cache_dir:
        raise ValueError("no cache directory given; pass --cache_dir DIR")
    if not config.dataset.dataset_metadata:
        raise ValueError("no dataset given; pass --dataset_metadata FILE (e.g. from `qie make-demo-data`)")
    if config.shard_size < 1:
        raise ValueError(f"--shard_size must be >= 1, got {config.shard_size}")
    if config.divisor < 16 or config.divisor % 16:  # the DiT's 2x2 patches of the VAE's 8x latents
        raise ValueError(f"--divisor {config.divisor}: image sides must be multiples of 16 (the VAE's 8x times the "
                         "DiT's 2x2 patch); use 16, 32, 64, ...")
    if not Path(config.dataset.dataset_metadata).is_file():  # before anything is created in --cache_dir
        raise FileNotFoundError(f"metadata file not found: {config.dataset.dataset_metadata} (--dataset_metadata)")
    cache_dir = Path(config.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    if dist.state is not None:  # launched ranks; rank 0 finalises every rank's shards: one directory for all
        check_shared_dir(cache_dir, rank == 0, dist.barrier, what="--cache_dir")
    try:
        lock = lock_dir(cache_dir, dist, config.lock_timeout)
    except UnwritableDirectory as e:
        return _check_read_only(config, pipe, dist, cache_dir, e, t0)
    try:
        return _write_locked(config, pipe, dist, cache_dir, finalize, on_entry, t0)
    finally:  # after the last barrier on success: no rank writes any more
        lock.release()


def _write_locked(config: CacheConfig, pipe, dist: Dist, cache_dir: Path, finalize: bool | None,
                  on_entry: Callable[[EntryMeta], None] | None, t0: float) -> CacheSummary:
    from ..models.presets import get_preset

    rank, world_size = dist.rank, dist.world_size
    preset = get_preset(getattr(pipe, "qie_preset", None) or config.model)
    ds = config.dataset
    report_path = rank_report_path(cache_dir, rank, world_size)
    report_path.unlink(missing_ok=True)  # a stale report must not vouch for this run

    share = rank_rows(config, preset, rank, world_size)
    if world_size == 1:  # fail before encoding anything; with several ranks rank 0 checks the total
        write_skipped(cache_dir / store.SKIPPED_NAME, share.skipped)
        check_bad_fraction(share.n_total, share.skipped, ds.max_bad_fraction, ds.dataset_metadata,
                           cache_dir / store.SKIPPED_NAME)

    # Without a pipeline given, the encoders load only when a row needs encoding: the settings and the prompt
    # lengths come from the model's files and tokenizer alone (a relaunch over an unchanged dataset loads nothing).
    settings, hashes, todo, pipe = _todo(config, pipe, dist, cache_dir, preset, share)
    log.info("rank %d/%d: %d rows, %d already cached, %d to encode, %d skipped",
             rank, world_size, len(share.good), len(share.good) - len(todo), len(todo), len(share.skipped))

    writer = ShardWriter(cache_dir, rank, config.shard_size, known_shared=shards.known_shared_keys(cache_dir))
    t_enc = time.perf_counter()
    _encode_rows(pipe, config, preset, todo, writer, show_progress=rank == 0, on_entry=on_entry)
    enc_s = time.perf_counter() - t_enc
    if todo:
        log.info("rank %d: encoded %d rows in %.1f s (%.2f rows/s)", rank, len(todo), enc_s, len(todo) / max(enc_s, 1e-9))

    atomic_write_json(report_path, {
        "format_version": store.FORMAT_VERSION,
        "run_key": run_key(config, settings),
        "rank": rank, "world_size": world_size, "num_rows": share.n_total,
        "entries": [[share.index_of[r.row_id], r.row_id, h] for r, h in zip(share.good, hashes)],
        "skipped": [s.to_json() for s in share.skipped],
        "metadata": str(ds.dataset_metadata),
        "max_bad_fraction": ds.max_bad_fraction,
        "manifest_fields": manifest_fields(config, settings),
    })
    dist.barrier()  # every rank's shards and report are on disk
    manifest = None
    if finalize if finalize is not None else rank == 0:
        manifest = finalize_reports(cache_dir, world_size)
    dist.barrier()  # nobody returns before the manifest exists
    return CacheSummary(rank=rank, world_size=world_size, rows=len(share.good), computed=len(todo),
                        reused=len(share.good) - len(todo), skipped=len(share.skipped),
                        seconds=time.perf_counter() - t0, encode_seconds=enc_s, manifest=manifest)


def _todo(config: CacheConfig, pipe, dist: Dist, cache_dir: Path, preset, share: RankRows, writable: bool = True):
    """This rank's cache settings, row content hashes and the rows still to encode, with the pipeline that
    encodes them (loaded here when rows need it and ``writable``; never for a read-only check)."""
    light = pipe if pipe is not None else light_pipeline(config, dist.device)
    drop_long_prompts(share, light, config.max_prompt_tokens)
    hasher = FileHasher(known=read_hash_memo(cache_dir, dist.rank))
    have = {(m.entry_id, m.content_hash) for m in shards.scan_shards(cache_dir)}
    while True:
        settings = cache_settings(config, preset, light)
        hashes = list(prefetch(lambda r: row_content_hash(r, settings, hasher), share.good, config.num_workers))
        todo = [(r, h) for r, h in zip(share.good, hashes) if (r.row_id, h) not in have]
        if pipe is None and todo and writable:
            pipe = load_encoders(config, dist.device)
            if cache_settings(config, preset, pipe) != settings:  # the files did not tell: hash with the loaded one
                light = pipe
                continue
        break
    if writable:
        write_hash_memo(cache_dir, dist.rank, hasher)
    return settings, hashes, todo, pipe


def _check_read_only(config: CacheConfig, pipe, dist: Dist, cache_dir: Path, error: UnwritableDirectory,
                     t0: float) -> CacheSummary:
    """A directory this run cannot write (a finished cache on a read-only mount, another user's): fine when its
    manifest already holds exactly this dataset's rows with these settings, since nothing would be written;
    otherwise ``error`` with what is missing. One process only (ranks would need to agree on the answer)."""
    from ..models.presets import get_preset

    manifest_path = cache_dir / store.MANIFEST_NAME
    if dist.world_size > 1 or not manifest_path.is_file():
        raise error
    preset = get_preset(getattr(pipe, "qie_preset", None) or config.model)
    share = rank_rows(config, preset, 0, 1)
    settings, hashes, todo, _ = _todo(config, pipe, dist, cache_dir, preset, share, writable=False)
    manifest = store.read_cache_json(manifest_path, ("entries",))
    cached = {(e.get("id"), e.get("hash")) for e in manifest["entries"]}
    wanted = {(r.row_id, h) for r, h in zip(share.good, hashes)}
    if todo or cached != wanted or manifest.get("encoder_fingerprint") != settings["encoder_fingerprint"]:
        raise UnwritableDirectory(f"{error}: the cache there is not up to date for {config.dataset.dataset_metadata} "
                                  f"({len(todo)} row(s) to encode, {len(cached ^ wanted)} entries differ)")
    log.info("cache %s is read-only and already complete for this dataset (%d entries); nothing to write",
             cache_dir, len(cached))
    return CacheSummary(rank=0, world_size=1, rows=len(share.good), computed=0, reused=len(share.good),
                        skipped=len(share.skipped), seconds=time.perf_counter() - t0, encode_seconds=0.0,
                        manifest=None)
