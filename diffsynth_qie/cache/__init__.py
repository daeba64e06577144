"""Phase 1 of split training: the embedding cache (text encoder + VAE outputs per row).

``store`` defines the on-disk contract read by the trainer (``CacheStore``,
``CacheEntry``, ``EntryMeta``); ``writer`` fills it (``CacheConfig`` from ``config``,
``write_cache``), encoding rows with ``encode`` and writing them with ``shards``,
one run per directory (``lock``); ``fingerprint`` hashes inputs and encoder weights
so reruns resume and recompute only what changed.
"""
from .store import FORMAT_VERSION, CacheEntry, CacheStore, EntryMeta

__all__ = ["FORMAT_VERSION", "CacheEntry", "CacheStore", "EntryMeta"]
