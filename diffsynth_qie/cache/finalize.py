"""The end of a ``qie cache`` run: rank 0 merges every rank's report (``parts/rank-*.json``) into
``skipped.jsonl`` and ``manifest.json`` (``shards.finalize_store``), after checking that the reports come from
one run and that not too many rows were bad."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from ..data.rows import SkippedRow, check_bad_fraction, write_skipped
from ..utils.dir_lock import CacheLock
from . import shards, store
from .config import CacheConfig
from .ranks import rank_report_path

log = logging.getLogger(__name__)


def run_key(config: CacheConfig, settings: dict) -> str:
    """Identifies one logical cache run across ranks: same metadata file, dataset options and settings."""
    import hashlib

    from ..data.images import image_bytes_hash

    payload = {"settings": settings, "metadata": image_bytes_hash(config.dataset.dataset_metadata),
               "dataset": dataclasses.asdict(config.dataset), "fields": dataclasses.asdict(config.fields)}
    payload["dataset"].pop("max_bad_fraction", None)
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def manifest_fields(config: CacheConfig, settings: dict) -> dict:
    from ..models.presets import get_preset

    return {
        "preset": settings["preset"],
        "family": get_preset(settings["preset"]).family,
        "encoder_fingerprint": settings["encoder_fingerprint"],
        "resize": {"max_pixels": settings["max_pixels"], "edit_max_pixels": settings["edit_max_pixels"],
                   "divisor": settings["divisor"]},
        "dtype": settings["dtype"],
        "multi_image_prompt": settings["multi_image_prompt"], "auto_mask": settings.get("auto_mask"),
        "metadata": str(config.dataset.dataset_metadata),
        "dataset_base": config.dataset.dataset_base,
    }


def finalize_cache(cache_dir: str | os.PathLike, world_size: int, lock_timeout: float = 0.0) -> dict:
    """Merge every rank's report into ``skipped.jsonl`` and ``manifest.json`` (rank 0, after all ranks).

    Raises ValueError if a rank's report is missing or belongs to another run (a
    different metadata file, model or settings), if too many rows are bad, or if
    another run holds the directory's lock.
    """
    lock = CacheLock(cache_dir)
    lock.acquire(lock_timeout)
    try:
        return finalize_reports(Path(cache_dir), world_size)
    finally:
        lock.release()


def finalize_reports(cache_dir: Path, world_size: int) -> dict:
    reports = []
    for r in range(world_size):
        path = rank_report_path(cache_dir, r, world_size)
        if not path.is_file():
            raise ValueError(f"rank {r} of {world_size} has not finished caching into {cache_dir} ({path} missing); "
                             "run every rank (accelerate launch does), then finalise")
        reports.append(json.loads(path.read_text()))
    if len({rep["run_key"] for rep in reports}) != 1:
        raise ValueError(f"the rank reports in {cache_dir / store.PARTS_DIR} come from different runs (metadata, "
                         "model or resize settings differ); re-run `qie cache` with the same arguments on every rank")
    skipped = [SkippedRow(**s) for rep in reports for s in rep["skipped"]]
    skipped_path = write_skipped(cache_dir / store.SKIPPED_NAME, skipped)
    n_total = sum(rep["num_rows"] for rep in reports)
    check_bad_fraction(n_total, skipped, reports[0]["max_bad_fraction"], reports[0]["metadata"], skipped_path)
    wanted = sorted((tuple(e) for rep in reports for e in rep["entries"]), key=lambda e: e[0])
    manifest = shards.finalize_store(cache_dir, [(e[1], e[2]) for e in wanted],
                                    {**reports[0]["manifest_fields"], "num_rows": n_total, "num_skipped": len(skipped)})
    for r in range(world_size):
        rank_report_path(cache_dir, r, world_size).unlink(missing_ok=True)
    log.info("cache %s: %d entries in %d shards, %d rows skipped", cache_dir, len(manifest["entries"]),
             len(manifest["shards"]), len(skipped))
    return manifest
