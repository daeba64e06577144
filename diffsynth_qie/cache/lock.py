"""One writer per cache directory: an exclusive ``flock`` on ``<cache_dir>/.qie-cache-lock.json``.

Two ``qie cache`` runs into the same directory would each delete the other's shards
when finalising. The run holds the lock from before its first write until its
manifest is written; the operating system releases it when the process ends, also
on a crash or a kill, so a stale lock file never blocks the next run. The file
records the holder (pid, host, start time) for the message a second run shows.
Under ``accelerate launch`` only rank 0 takes it, for all ranks of its run.

``flock`` is advisory and local: it does not exclude a run on another machine
writing through a network file system that does not support it.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from ..utils.atomic import default_mode

LOCK_NAME = ".qie-cache-lock.json"


class CacheLock:
    """Exclusive lock on a cache directory (a context manager; see the module docstring)."""

    def __init__(self, cache_dir: str | os.PathLike):
        self.cache_dir = Path(cache_dir)
        self.path = self.cache_dir / LOCK_NAME
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout: float = 0.0, poll: float = 0.5) -> None:
        """Take the lock, waiting up to ``timeout`` seconds for another run to finish.

        Raises ValueError naming the directory and the holder when it stays taken.
        """
        assert self._fd is None, "lock already held"
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, default_mode())
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = self.holder()
                    os.close(fd)
                    who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('since')}"
                           if holder else "another process")
                    waited = f" (waited {timeout:g} s)" if timeout > 0 else ""
                    raise ValueError(
                        f"another `qie cache` run ({who}) is writing into {self.cache_dir}{waited}; wait for it to "
                        f"finish (or pass --lock_timeout SECONDS to wait), or use another --cache_dir") from None
                time.sleep(poll)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd

    def holder(self) -> dict:
        """What the current holder wrote into the lock file ({} if unknown)."""
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)  # the file stays: deleting it would race with a waiter
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "CacheLock":
        if not self.held:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
