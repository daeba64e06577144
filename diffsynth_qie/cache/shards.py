"""Writing the phase-1 cache: per-rank shards, resume scanning and finalisation.

The on-disk layout and the reader are in ``store.py``. Every file is written
atomically (``utils.atomic``) and every listing ignores temp files of killed writes,
so a crash at any moment leaves either the previous finished cache or the new one,
plus finished shards that the next run reuses.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ..utils.atomic import atomic_save, atomic_write_json, finished_files, is_temp_name, temp_leftovers
from .store import (FORMAT_VERSION, MANIFEST_NAME, PARTS_DIR, SHARDS_DIR, SHARED_PATTERN, CacheEntry, EntryMeta,
                    lbm_source_mode, sidecar_name)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def check_finite(row_id: str, tensors: dict[str, "torch.Tensor"]) -> None:
    """Refuse to write NaN/Inf (typically fp16 overflow or a broken checkpoint)."""
    import torch

    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"row {row_id!r}: cached tensor {name!r} contains NaN/Inf; check the input images and "
                f"the encoder weights, or cache with --dtype float32")


class ShardWriter:
    """Buffers one rank's entries and writes them ``shard_size`` at a time.

    Order per flush: new white latents (``parts/``), then the shard tensors, then its
    sidecar; each file atomically. A sidecar therefore only exists next to a complete
    shard whose white latents are on disk, so an interrupted run loses at most the
    entries still buffered.
    """

    def __init__(self, cache_dir: str | os.PathLike, rank: int, shard_size: int, known_shared: Iterable[str] = ()):
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        self.cache_dir = Path(cache_dir)
        self.rank = rank
        self.shard_size = shard_size
        self.token = f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"
        self._seq = 0
        self._entries: list[tuple[CacheEntry, EntryMeta]] = []
        self._known_shared = set(known_shared)
        self._pending_shared: dict[str, torch.Tensor] = {}
        self.written: list[EntryMeta] = []

    def has_shared(self, key: str) -> bool:
        return key in self._known_shared or key in self._pending_shared

    def add_shared(self, key: str, tensor: "torch.Tensor") -> None:
        if not self.has_shared(key):
            check_finite(key, {key: tensor})
            self._pending_shared[key] = tensor

    def add(self, entry: CacheEntry, meta: EntryMeta) -> None:
        check_finite(meta.row_id, entry.own_tensors())
        for key in filter(None, [meta.sub_noise_key, meta.sub_noise_ref_gt_key]):
            assert self.has_shared(key), f"white latents {key} must be added before entries using them"
        self._entries.append((entry, meta))
        if len(self._entries) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self._pending_shared:
            part = self.cache_dir / PARTS_DIR / f"shared-r{self.rank:04d}-{self.token}-{self._seq:05d}.safetensors"
            tensors = {k: _storable(v) for k, v in self._pending_shared.items()}
            atomic_save(part, lambda tmp: save_file(tensors, str(tmp), metadata={"format_version": str(FORMAT_VERSION)}))
            self._known_shared |= set(self._pending_shared)
            self._pending_shared = {}
        if not self._entries:
            return
        name = f"r{self.rank:04d}-{self.token}-{self._seq:05d}.safetensors"
        self._seq += 1
        tensors: dict[str, torch.Tensor] = {}
        metas = []
        for k, (entry, meta) in enumerate(self._entries):
            meta = dataclasses.replace(meta, shard=name, key=f"e{k:05d}", lbm_source=lbm_source_mode(entry))
            for tname, t in entry.own_tensors().items():
                tensors[f"{meta.key}/{tname}"] = _storable(t)
            metas.append(meta)
        shard_dir = self.cache_dir / SHARDS_DIR
        atomic_save(shard_dir / name, lambda tmp: save_file(tensors, str(tmp), metadata={"format_version": str(FORMAT_VERSION)}))
        atomic_write_json(shard_dir / sidecar_name(name), {
            "format_version": FORMAT_VERSION, "shard": name, "entries": [m.to_json() for m in metas]})
        self.written.extend(metas)
        self._entries = []


def _storable(t: "torch.Tensor") -> "torch.Tensor":
    # clone: slices of a batched VAE output share storage, which save_file refuses
    return t.detach().to("cpu").contiguous().clone()


def scan_shards(cache_dir: str | os.PathLike) -> list[EntryMeta]:
    """Every entry of every complete shard on disk (finalised or not) with the current
    format version: what a resumed run may reuse. Shards of another version are ignored
    (and removed by the next ``finalize_store``)."""
    shard_dir = Path(cache_dir) / SHARDS_DIR
    out: list[EntryMeta] = []
    for sidecar in finished_files(shard_dir, "*.json"):
        try:
            data = json.loads(sidecar.read_text())
            if data.get("format_version") != FORMAT_VERSION or not (shard_dir / str(data.get("shard", ""))).is_file():
                continue
            metas = [EntryMeta.from_json(e) for e in data["entries"]]
        except (OSError, ValueError, AttributeError, KeyError, TypeError):  # damaged: its rows are encoded again
            log.warning("ignoring unreadable shard sidecar %s", sidecar)
            continue
        out.extend(metas)
    return out


def _shared_sources(cache_dir: Path) -> list[Path]:
    """Every finished white-latent file: the manifest's, other versions, unmerged parts."""
    return finished_files(cache_dir, SHARED_PATTERN) + finished_files(cache_dir / PARTS_DIR, "shared-*.safetensors")


def known_shared_keys(cache_dir: str | os.PathLike) -> set[str]:
    """White-latent keys already on disk (shared files and unmerged parts)."""
    from safetensors import safe_open

    keys: set[str] = set()
    for path in _shared_sources(Path(cache_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys |= set(f.keys())
    return keys


def _content_name(tensors: dict[str, "torch.Tensor"]) -> str:
    """``shared-<hash>.safetensors`` from the keys, shapes, dtypes and bytes of ``tensors``."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous().view(-1)
        h.update(f"{k}:{tuple(tensors[k].shape)}:{t.dtype}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return f"shared-{h.hexdigest()[:16]}.safetensors"


def finalize_store(cache_dir: str | os.PathLike, wanted: list[tuple[str, str]], manifest_fields: dict,
                   missing: list[str] = ()) -> dict:
    """Make ``cache_dir`` a finished store holding exactly ``wanted`` (entry_id, content_hash), in that order.

    Run by one process (rank 0) after every rank has written its shards. Picks, for each
    wanted entry, a shard entry with the same hash; rewrites shards that also hold
    stale entries (compaction, new names); merges the white latents the chosen entries
    use into shared.safetensors; writes manifest.json (atomically, last); then deletes
    everything the manifest does not reference. A crash at any point leaves either the
    old manifest with its files or the new one.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    cache_dir = Path(cache_dir)
    shard_dir = cache_dir / SHARDS_DIR
    candidates: dict[tuple[str, str], EntryMeta] = {}
    for m in scan_shards(cache_dir):
        candidates.setdefault((m.entry_id, m.content_hash), m)
    chosen: list[EntryMeta] = []
    absent = list(missing)
    for entry_id, h in wanted:
        m = candidates.get((entry_id, h))
        if m is None:
            absent.append(entry_id)
        else:
            chosen.append(m)
    by_shard: dict[str, list[EntryMeta]] = {}
    for m in chosen:
        by_shard.setdefault(m.shard, []).append(m)

    # compaction: a shard keeps its file only if every entry in it is chosen
    shard_sizes: dict[str, int] = {}
    for sidecar in finished_files(shard_dir, "*.json"):
        try:
            data = json.loads(sidecar.read_text())
            shard_sizes[data["shard"]] = len(data["entries"])
        except (OSError, ValueError, KeyError, TypeError):  # damaged: scan_shards ignored it too
            pass
    final_meta: dict[tuple[str, str], EntryMeta] = {}
    token = f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"
    for n, (shard, metas) in enumerate(sorted(by_shard.items())):
        if shard_sizes.get(shard) == len(metas):
            final_meta.update({(m.entry_id, m.content_hash): m for m in metas})
            continue
        name = f"c-{token}-{n:05d}.safetensors"
        tensors, new_metas = {}, []
        with safe_open(str(shard_dir / shard), framework="pt", device="cpu") as f:
            for k, m in enumerate(metas):
                nm = dataclasses.replace(m, shard=name, key=f"e{k:05d}")
                for old_key in f.keys():
                    if old_key.startswith(m.key + "/"):
                        tensors[nm.key + old_key[len(m.key):]] = f.get_tensor(old_key)
                new_metas.append(nm)
        atomic_save(shard_dir / name, lambda tmp: save_file(tensors, str(tmp), metadata={"format_version": str(FORMAT_VERSION)}))
        atomic_write_json(shard_dir / sidecar_name(name), {
            "format_version": FORMAT_VERSION, "shard": name, "entries": [m.to_json() for m in new_metas]})
        final_meta.update({(m.entry_id, m.content_hash): m for m in new_metas})
        log.info("compacted shard %s: kept %d of %d entries", shard, len(metas), shard_sizes.get(shard, 0))
    chosen = [final_meta[(m.entry_id, m.content_hash)] for m in chosen]

    # shared white latents: only the sizes still referenced
    needed = {k for m in chosen for k in (m.sub_noise_key, m.sub_noise_ref_gt_key) if k}
    shared: dict[str, torch.Tensor] = {}
    for path in _shared_sources(cache_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for k in f.keys():
                if k in needed and k not in shared:
                    shared[k] = f.get_tensor(k)
    lacking = needed - set(shared)
    assert not lacking, f"white latents {sorted(lacking)} referenced but not on disk"
    # A new name per content: the file the current manifest reads stays until the new manifest is written.
    shared_file = _content_name(shared)
    if not (cache_dir / shared_file).is_file():
        atomic_save(cache_dir / shared_file,
                    lambda tmp: save_file(shared, str(tmp), metadata={"format_version": str(FORMAT_VERSION)}))

    shards = sorted({m.shard for m in chosen})
    manifest = {
        **manifest_fields,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "shared": shared_file,
        "shards": shards,
        "entries": [{"id": m.entry_id, "row_id": m.row_id, "hash": m.content_hash, "shard": m.shard} for m in chosen],
        "missing": absent,
    }
    atomic_write_json(cache_dir / MANIFEST_NAME, manifest)

    keep = set(shards) | {sidecar_name(s) for s in shards}
    removed = 0
    for path in shard_dir.iterdir() if shard_dir.is_dir() else []:  # temp files of killed writes too
        if path.name in keep:
            continue
        if path.is_dir() and not path.is_symlink():  # a killed write's temp directory; a folder of someone else's
            if is_temp_name(path.name):
                shutil.rmtree(path, ignore_errors=True)
            else:
                log.warning("leaving the folder %s alone (not part of the cache)", path)
            continue
        path.unlink(missing_ok=True)
        removed += path.suffix == ".safetensors"
    old_shared = [p for p in finished_files(cache_dir, SHARED_PATTERN) if p.name != shared_file]
    for path in old_shared + finished_files(cache_dir / PARTS_DIR, "shared-*.safetensors") + temp_leftovers(
            cache_dir) + temp_leftovers(cache_dir / PARTS_DIR):  # merged white latents, temp files of killed writes
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_file():
            path.unlink(missing_ok=True)
    if removed:
        log.info("removed %d stale shard file(s)", removed)
    if absent:
        log.warning("cache is missing %d row(s) (e.g. %s)", len(absent), absent[:3])
    return manifest
