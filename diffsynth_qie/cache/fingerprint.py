"""Content hashes that decide whether a cached entry is still valid.

A cache entry is reused only when its hash matches the row's current hash, so the
hash covers everything the cached tensors depend on: the bytes of every file the
row reads (target, sources, mask, ref_gt), the prompt alternatives, the resize
settings, the preset, the stored dtype and a fingerprint of the encoder weights
(text encoder, VAE, tokenizer/processor settings). Change any of these and the row
is recomputed; nothing else is.

``weights_fingerprint`` identifies weight files cheaply (headers, sizes, samples);
``encoder_fingerprint`` applies it to the files a pipeline was loaded from.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from ..data.images import image_bytes_hash
from ..data.rows import EditRow
from ..utils.atomic import atomic_write_json

log = logging.getLogger(__name__)


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")).hexdigest()


HASH_MEMO_VERSION = 1


class FileHasher:
    """``image_bytes_hash`` memoised per path (inverse rows and shared references read the
    same files). Thread-safe enough for a thread pool: a race only hashes a file twice.

    With ``known`` (a previous run's :meth:`memo`), a file whose size and modification time
    (ns) are unchanged keeps its recorded hash without being read again: a relaunch over a
    large unchanged dataset does not re-read every image (rsync/cp -p keep mtimes; a file
    rewritten in place gets a new mtime and is hashed again)."""

    def __init__(self, hash_fn: Callable[[str | os.PathLike], str] | None = None,
                 known: Mapping[str, Any] | None = None):
        self._hash_fn = hash_fn or image_bytes_hash
        self._memo: dict[str, str] = {}
        self._stat: dict[str, list] = {}
        self._known = dict(known or {})
        self._read: set[str] = set()  # files actually read (a set: threads may hash one path at once)

    @property
    def hashed(self) -> int:
        """How many distinct files were read (the rest came from the record of the last run)."""
        return len(self._read)

    def __call__(self, path: str | os.PathLike) -> str:
        key = str(path)
        if key not in self._memo:
            st = os.stat(path)
            stat = [st.st_size, st.st_mtime_ns]
            known = self._known.get(key)
            if known is not None and list(known[:2]) == stat:
                self._memo[key] = known[2]
            else:
                self._memo[key] = self._hash_fn(path)
                self._read.add(key)
            self._stat[key] = stat
        return self._memo[key]

    def memo(self) -> dict[str, Any]:
        """``{path: [size, mtime_ns, hash]}`` of every file hashed or reused, for the next run."""
        return {k: [*self._stat[k], v] for k, v in self._memo.items() if k in self._stat}


def row_content_hash(row: EditRow, settings: Mapping[str, Any], file_hash: Callable[[Path], str]) -> str:
    """sha256 over the row's file bytes, prompts, identity fields and the cache ``settings``."""
    payload = {
        "settings": dict(settings),
        "row_id": row.row_id,
        "dataset": row.dataset,
        "inverse": row.inverse,
        "prompts": list(row.prompts),
        "files": {name: file_hash(path) for name, path in row.image_paths().items()},
    }
    return _sha(payload)


def encoder_fingerprint(pipe) -> str:
    """Fingerprint of what turns pixels and text into cached tensors: text encoder, VAE,
    tokenizer and processor.

    Uses the files the loader recorded (``pipe.qie_model_paths``, fingerprinted by
    :func:`weights_fingerprint` from safetensors headers and sizes, so the
    same model in another directory gives the same value). For a pipeline built some
    other way it hashes the modules' parameters (name, shape, dtype and two sums each:
    cheap even for the 7B encoder on a GPU), the vocabulary size and the processor's
    image settings.
    """
    paths = getattr(pipe, "qie_model_paths", None) or {}
    parts: dict[str, Any] = {}
    for name in ("text_encoder", "vae", "tokenizer", "processor"):
        local = paths.get(name)
        if isinstance(local, list) and local:
            parts[name] = weights_fingerprint(local)
        elif name in ("text_encoder", "vae"):
            parts[name] = _module_fingerprint(getattr(pipe, name, None))
        elif name == "tokenizer":
            tok = getattr(pipe, "tokenizer", None)
            parts[name] = len(tok) if tok is not None else None
        else:
            image_proc = getattr(getattr(pipe, "processor", None), "image_processor", None)
            parts[name] = image_proc.to_dict() if image_proc is not None else None
    return _sha(parts)


def _module_fingerprint(module) -> str | None:
    import torch

    if module is None:
        return None
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in module.state_dict().items():
            t64 = t.detach().double()
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t64.sum().item():.6e}:{(t64 * t64).sum().item():.6e}".encode())
    return h.hexdigest()


# --- fingerprints ----------------------------------------------------------------
_FULL_READ_LIMIT = 16 * 1024 * 1024
_SAMPLE_BYTES = 64 * 1024


def weights_fingerprint(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> str:
    """Cheap content fingerprint of weight files: sha256 over safetensors headers, sizes and samples.

    A safetensors header lists every tensor's name, dtype, shape and byte offsets, so
    with the file size it changes whenever weights are re-exported, re-sharded or
    converted; three 64 KiB samples of the tensor data (start, middle, end) tell
    apart checkpoints with the same layout (e.g. two fine-tunes) — all without
    reading gigabytes. Folders are walked; small other files (tokenizer JSON) are
    hashed whole. A file counts with its name and its folder's name
    (``transformer/...``), not where that folder is, so the same model in two places
    has the same fingerprint; the order of ``paths`` doesn't matter.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[tuple[str, Path]] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files += [(str(f.relative_to(p.parent)), f) for f in sorted(p.rglob("*")) if f.is_file()]
        elif p.is_file():
            files.append((f"{p.parent.name}/{p.name}", p))  # "transformer/x" vs "vae/x"
        else:
            raise FileNotFoundError(f"cannot fingerprint {p}: no such file or directory")
    entries = sorted((name, _file_digest(f)) for name, f in files)  # order of ``paths`` doesn't matter
    return hashlib.sha256("\n".join(f"{n}\0{d}" for n, d in entries).encode()).hexdigest()


def _file_digest(f: Path) -> str:
    digest = hashlib.sha256()
    size = f.stat().st_size
    digest.update(f"{size}\0".encode())
    with open(f, "rb") as fh:
        if size <= 2 * _SAMPLE_BYTES or (f.suffix != ".safetensors" and size <= _FULL_READ_LIMIT):
            digest.update(fh.read())
            return digest.hexdigest()
        start = 0
        if f.suffix == ".safetensors":
            head = fh.read(8)
            start = 8 + int.from_bytes(head, "little")
            digest.update(head + fh.read(max(min(start, size) - 8, 0)))
        for offset in (start, (start + size) // 2, size - _SAMPLE_BYTES):
            fh.seek(max(min(offset, size - _SAMPLE_BYTES), 0))
            digest.update(fh.read(_SAMPLE_BYTES))
    return digest.hexdigest()


# --- the per-rank record of image hashes (a relaunch re-reads no unchanged image) ---------------------
def hash_memo_path(cache_dir: Path, rank: int) -> Path:
    return cache_dir / "file_hashes" / f"rank-{rank}.json"


def read_hash_memo(cache_dir: Path, rank: int) -> dict:
    """The (size, mtime) -> hash records of this rank's last run (empty when missing or unreadable)."""
    try:
        data = json.loads(hash_memo_path(cache_dir, rank).read_text())
    except (OSError, ValueError):
        return {}
    return data.get("files", {}) if data.get("format_version") == HASH_MEMO_VERSION else {}


def write_hash_memo(cache_dir: Path, rank: int, hasher: FileHasher) -> None:
    path = hash_memo_path(cache_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"format_version": HASH_MEMO_VERSION, "files": hasher.memo()})
    except OSError as e:  # only a speed-up for the next run; never a reason to stop this one
        log.warning("could not record the image hashes in %s (%s); the next run hashes every image again", path, e)
    log.info("rank %d: %d image file(s) hashed, %d unchanged (same size and mtime)", rank, hasher.hashed,
             len(hasher.memo()) - hasher.hashed)
