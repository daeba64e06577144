"""Check that a directory is one directory for every rank of a run (shared storage across nodes).

A multi-node run writes its cache and checkpoints from every rank into ``CACHE_DIR`` / ``OUTPUT_DIR``,
and rank 0 finalises them (the cache manifest, checkpoint renames). On a disk local to each node that
fails late and obscurely; this check fails at start, naming the directory.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def marker_name() -> str:
    """One name per launch, the same on every rank (the rendezvous' own identifiers)."""
    parts = [os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")]
    return ".qie-shared-check-" + "-".join(p.replace("/", "_") for p in parts if p)


def check_shared_dir(directory: str | os.PathLike, is_main: bool, barrier: Callable[[], None],
                     what: str = "--output_dir", name: str | None = None) -> None:
    """Rank 0 writes a marker into ``directory``; after ``barrier()`` every rank must see it. Collective."""
    path = Path(directory) / (name or marker_name())
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("written by rank 0\n")
    barrier()
    seen = path.is_file()
    barrier()
    if is_main:
        path.unlink(missing_ok=True)
    if not seen:
        raise ValueError(f"{what} {directory} is not shared with rank 0: this rank cannot see the file rank 0 just "
                         "wrote there. A multi-node run needs its cache and output directories on storage every "
                         "node mounts at the same path (NFS, Lustre, ...); set CACHE_DIR / OUTPUT_DIR to one")
