"""One writer per directory: an exclusive ``flock`` on a lock file inside it.

Two ``qie cache`` runs into the same directory would each delete the other's shards when
finalising; two ``qie train`` runs into one ``--output_dir`` would replace each other's loss
log, checkpoints and LoRA. A run holds the lock from before its first write to its end; the
operating system releases it when the process ends, also on a crash or a kill, so a stale
lock file never blocks the next run. The file records the holder (pid, host, start time) for
the message a second run shows. Under ``accelerate launch`` only rank 0 takes it, for all
ranks of its run. A directory the run cannot write to (permissions, a read-only mount) is
one ``ValueError`` naming it.

``flock`` is advisory and local: it does not exclude a run on another machine
writing through a network file system that does not support it.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from .atomic import default_mode


class UnwritableDirectory(ValueError):
    """The run cannot write into its directory (permissions, a read-only mount): one line naming it."""


class DirLock:
    """Exclusive lock on a directory (a context manager; see the module docstring). ``command`` and ``flag``
    name the run and the option that picks the directory, for the messages."""

    name = ".qie-lock.json"
    command, flag = "qie", "another directory"

    def __init__(self, directory: str | os.PathLike):
        self.cache_dir = Path(directory)
        self.path = self.cache_dir / self.name
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout: float = 0.0, poll: float = 0.5) -> None:
        """Take the lock, waiting up to ``timeout`` seconds for another run to finish.

        Raises ValueError naming the directory and the holder when it stays taken.
        """
        assert self._fd is None, "lock already held"
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, default_mode())
        except (PermissionError, OSError) as e:
            if not isinstance(e, PermissionError) and e.errno != errno.EROFS:
                raise
            why = "it is on a read-only file system" if e.errno == errno.EROFS else "permission denied"
            raise UnwritableDirectory(f"`{self.command}` cannot write into {self.cache_dir} ({why}); choose a "
                                      f"writable {self.flag}") from None
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
                        f"another `{self.command}` run ({who}) is writing into {self.cache_dir}{waited}; wait for it "
                        f"to finish{self.wait_hint}, or use another {self.flag}") from None
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

    def acquire_for_ranks(self, accelerator) -> "DirLock":
        """Rank 0 takes the lock for the whole run; every rank raises the same ValueError if it is taken."""
        error = None
        if accelerator.is_main_process:
            try:
                self.acquire()
            except ValueError as e:
                error = str(e)
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            error = broadcast_object_list([error])[0]
        if error:
            raise ValueError(error)
        return self

    wait_hint = ""

    def __enter__(self) -> "DirLock":
        if not self.held:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class CacheLock(DirLock):
    name, command, flag = ".qie-cache-lock.json", "qie cache", "--cache_dir"
    wait_hint = " (or pass --lock_timeout SECONDS to wait)"


class UITempLock(DirLock):
    """The web UI's temp folder (uploads, results served for download): one running UI empties and uses it."""

    name, command, flag = ".qie-ui-lock.json", "app_gradio.py", "--temp_dir"


class TrainLock(DirLock):
    name, command, flag = ".qie-train-lock.json", "qie train", "--output_dir"
