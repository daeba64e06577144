"""The phase-1 embedding cache on disk: the contract between `qie cache` and `qie train`.

Why our own format: DiffSynth's split training pickles whole input dicts
(including PIL images and *caching-time* training flags) and reads them with
``weights_only=False``. This cache holds tensors only (safetensors) plus JSON,
never pickles, and never stores a training-time flag (``zero_cond_t``, gradient
checkpointing, CFG dropout...): those are decided by the trainer.

Layout of ``<cache_dir>``::

    manifest.json            written last, atomically, by rank 0 when a run finishes
    shared-<hash>.safetensors   size-keyed white-image latents: "sub_noise/<H>x<W>" (pixel size);
                             named by content and listed in the manifest ("shared"), so a new
                             version never overwrites the one the current manifest reads
    shards/<name>.safetensors   tensors of up to ``shard_size`` entries
    shards/<name>.json          sidecar: EntryMeta of each entry in that shard
    skipped.jsonl            rows rejected by validation, one JSON object per line
    parts/                   work in progress of unfinished runs (per-rank reports,
                             white latents not yet merged); empty after finalisation
    file_hashes/rank-N.json  each image file's (size, mtime ns, content hash) as rank N last saw
                             it: a relaunch re-reads only files whose size or mtime changed

``manifest.json``::

    {"format_version": 1, "preset": "2511", "encoder_fingerprint": "...",
     "resize": {"max_pixels": ..., "edit_max_pixels": ..., "divisor": 16},
     "dtype": "bfloat16", "created": "...", "metadata": "<path>",
     "shared": "shared-<hash>.safetensors", "shards": ["<name>.safetensors", ...],
     "entries": [{"id": ..., "row_id": ..., "hash": ..., "shard": ...}, ...],  # metadata order
     "missing": [row ids with no entry], "num_skipped": N}

Inside a shard every tensor key is ``<EntryMeta.key>/<name>`` with names
``prompt_emb.<k>``, ``prompt_mask.<k>`` (one per prompt alternative),
``empty_prompt_emb``, ``empty_prompt_mask``, ``target_latents``,
``edit_latents.<j>``, and optionally ``back_mask``, ``ref_gt_latents``,
``lbm_source_latents``, ``rejected_latents`` (a preference row's rejected output at the target's size, listed
by ``rejected_shape``; an optional key, so caches without it read as before and format_version stays 1). Shapes have no batch dimension (the trainer's collate
adds it): prompt embeddings ``[L, D]`` with masks ``[L]`` (int64, unpadded so all
ones; kept so the trainer can pad and mask uniformly), latents ``[16, h, w]`` with
``h, w`` = pixel size / 8, ``back_mask`` ``[1, h, w]`` float32 in [0, 1] (area
average, so partly covered latent pixels are fractional).

The model family (manifest ``"family"``) decides the latents' channels and scale (Qwen-Image-2.1: ``[64, h, w]``
with ``h, w`` = pixel size / 16, one DiT token each) and the tensors each prompt has beside its embedding, one
per name of its ``Family.prompt_tensors``, stored as ``prompt_<name>.<k>`` / ``empty_prompt_<name>`` and listed
in each entry's ``prompt_tensors`` (2.1: ``pad``, the references' slot mask ``[L]``, bool: which positions the
reference latents fill). A cache of one family is refused for the other.

Readers: ``CacheStore.open(cache_dir)`` then ``len``, ``entry_ids``, ``meta(i)``
(no tensor I/O) and ``load(i) -> CacheEntry`` (opens the shard lazily with
``safe_open``; safe in DataLoader workers, nothing is held open across calls).

Writers (``cache/shards.py``, driven by ``cache/writer.py``): ``ShardWriter`` per
rank, ``scan_shards`` for resume, ``finalize_store`` on rank 0 at the end.

Temp files of unfinished writes (``utils.atomic``) are never listed as cache files:
every listing goes through ``utils.atomic.finished_files``.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from .entry import (LBM_EDIT0, LBM_NONE, LBM_OWN, CacheEntry, EntryMeta, lbm_source_mode,  # noqa: F401 (re-exported)
                    sub_noise_key)

if TYPE_CHECKING:  # torch is imported lazily so `qie --help` stays fast
    import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARED_NAME = "shared.safetensors"  # caches written before the white latents were content-named
SHARED_PATTERN = "shared*.safetensors"
SHARDS_DIR = "shards"
PARTS_DIR = "parts"
SKIPPED_NAME = "skipped.jsonl"

# ----------------------------------------------------------------------------- reading


class CacheStore:
    """Read-only view of a finalised cache directory. Cheap to pickle into DataLoader workers
    (holds only paths and JSON-derived metadata; shards are opened per ``load``)."""

    def __init__(self, cache_dir: Path, manifest: dict, metas: list[EntryMeta]):
        self.cache_dir = Path(cache_dir)
        self.manifest = manifest
        self._metas = metas
        self._index = {m.entry_id: i for i, m in enumerate(metas)}
        self._shared: dict[str, torch.Tensor] = {}
        self._shared_pid = -1

    @classmethod
    def open(cls, cache_dir: str | os.PathLike) -> "CacheStore":
        cache_dir = Path(cache_dir)
        path = cache_dir / MANIFEST_NAME
        if not path.is_file():
            raise ValueError(
                f"{cache_dir} holds no finished cache ({MANIFEST_NAME} missing): run `qie cache --cache_dir "
                f"{cache_dir} ...` (an interrupted run resumes where it stopped)")
        manifest = read_cache_json(path, ("format_version", "shards", "entries"))
        check_format_version(manifest.get("format_version"), path)
        by_shard: dict[str, dict[str, EntryMeta]] = {}
        needed = [cache_dir / shared_name(manifest)] if manifest["entries"] else []
        for shard in manifest["shards"]:
            needed += [cache_dir / SHARDS_DIR / shard, cache_dir / SHARDS_DIR / sidecar_name(shard)]
        for file in needed:
            if not file.is_file():
                raise ValueError(f"{cache_dir}: {file.relative_to(cache_dir)}, listed in {MANIFEST_NAME}, is missing; "
                                 f"re-run `qie cache` with the same --cache_dir to repair it")
        for shard in manifest["shards"]:
            sidecar = cache_dir / SHARDS_DIR / sidecar_name(shard)
            data = read_cache_json(sidecar, ("format_version", "entries"))
            check_format_version(data.get("format_version"), sidecar)
            by_shard[shard] = {e["entry_id"]: EntryMeta.from_json(e) for e in data["entries"]}
        metas = [by_shard[e["shard"]][e["id"]] for e in manifest["entries"]]
        if manifest.get("missing"):
            log.warning("cache %s lacks %d row(s) of its metadata (e.g. %s); re-run `qie cache` to complete it",
                        cache_dir, len(manifest["missing"]), manifest["missing"][:3])
        return cls(cache_dir, manifest, metas)

    # -- cheap metadata
    def __len__(self) -> int:
        return len(self._metas)

    @property
    def entry_ids(self) -> list[str]:
        return [m.entry_id for m in self._metas]

    @property
    def family(self) -> str:
        """The model family the cache was encoded for (caches from before families are Qwen-Image-Edit's)."""
        return self.manifest.get("family", "qwen-image-edit")

    @property
    def preset(self) -> str:
        return self.manifest["preset"]

    @property
    def encoder_fingerprint(self) -> str:
        return self.manifest["encoder_fingerprint"]

    def index_of(self, entry_id: str) -> int:
        return self._index[entry_id]

    def meta(self, i: int) -> EntryMeta:
        return self._metas[i]

    # -- tensors
    def shared(self, key: str) -> "torch.Tensor":
        """A tensor from the shared white-latent file (kept in memory per process: a few sizes only)."""
        from safetensors import safe_open

        if self._shared_pid != os.getpid():  # a forked worker must not share a parent's handles
            self._shared, self._shared_pid = {}, os.getpid()
        if key not in self._shared:
            with safe_open(str(self.cache_dir / shared_name(self.manifest)), framework="pt", device="cpu") as f:
                self._shared[key] = f.get_tensor(key)
        return self._shared[key]

    def load(self, i: int, epoch: Optional[int] = None) -> CacheEntry:
        """Entry ``i`` (``epoch`` is for stores that change per epoch, ``live.LiveStore``; a cache holds one
        encoding per row)."""
        from safetensors import safe_open

        m = self._metas[i]
        with safe_open(str(self.cache_dir / SHARDS_DIR / m.shard), framework="pt", device="cpu") as f:
            def get(name: str):
                return f.get_tensor(f"{m.key}/{name}")

            edit = [get(f"edit_latents.{j}") for j in range(m.n_edit)]
            lbm = None
            if m.lbm_source == LBM_EDIT0:
                lbm = edit[0]
            elif m.lbm_source == LBM_OWN:
                lbm = get("lbm_source_latents")
            entry = CacheEntry(
                entry_id=m.entry_id, row_id=m.row_id, dataset=m.dataset, inverse=m.inverse,
                prompt_embs=[get(f"prompt_emb.{k}") for k in range(m.n_prompts)],
                prompt_masks=[get(f"prompt_mask.{k}") for k in range(m.n_prompts)],
                empty_prompt_emb=get("empty_prompt_emb"), empty_prompt_mask=get("empty_prompt_mask"),
                target_latents=get("target_latents"), edit_latents=edit,
                sub_noise=self.shared(m.sub_noise_key),
                back_mask=get("back_mask") if m.has_back_mask else None,
                ref_gt_latents=get("ref_gt_latents") if m.has_ref_gt else None,
                sub_noise_ref_gt=self.shared(m.sub_noise_ref_gt_key) if m.sub_noise_ref_gt_key else None,
                lbm_source_latents=lbm,
                prompt_extras=[{name: get(f"prompt_{name}.{k}") for name in m.prompt_tensors}
                               for k in range(m.n_prompts)],
                empty_prompt_extras={name: get(f"empty_prompt_{name}") for name in m.prompt_tensors},
                rejected_latents=get("rejected_latents") if m.has_rejected else None,
            )
        return entry


def read_cache_json(path: Path, fields: tuple[str, ...]) -> dict:
    """A cache JSON file (manifest or shard sidecar) as a dict holding ``fields``, or ValueError
    naming the file and the repair (such a file was damaged after it was written, e.g. by a copy)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        problem = f"is not readable JSON ({e})"
    else:
        if not isinstance(data, dict):
            problem = "is not a JSON object"
        else:
            missing = [f for f in fields if f not in data]
            if not missing:
                return data
            problem = f"lacks {', '.join(missing)}"
    raise ValueError(f"{path} {problem}; the cache is damaged: re-run `qie cache` with the same --cache_dir "
                     "to rebuild it (entries whose shards are intact are reused)")


def check_format_version(version: Any, path: Path) -> None:
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path}: cache format_version {version!r}, but this diffsynth-qie reads format_version "
            f"{FORMAT_VERSION}; re-run `qie cache` with the same --cache_dir (it rebuilds the old entries)")


def shared_name(manifest: dict) -> str:
    """File name of the white latents a manifest reads."""
    return manifest.get("shared", SHARED_NAME)


def sidecar_name(shard: str) -> str:
    return shard[: -len(".safetensors")] + ".json"
