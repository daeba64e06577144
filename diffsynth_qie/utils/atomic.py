"""Atomic writes: write to a temp file in the same directory, fsync, then rename.

A reader (or a resumed run) therefore never sees a half-written cache shard,
checkpoint or image: either the old file or the complete new one.

Temp entries are named ``.<stem>.<pid>-<random>.tmp`` (hidden, and recognisable by
:func:`is_temp_name`); every directory listing of finished files goes through
:func:`finished_files`, so a leftover of a killed write is never taken for a result, and
:func:`clean_leftovers` removes those of processes that no longer run.
Finished files get the permissions the umask gives any new file (``0o666 & ~umask``),
whatever the library that wrote them chose. A full disk ends in :class:`DiskFullError`
naming the directory, with the partial file removed.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)
TEMP_MARK = ".tmp"
# .<stem>.<pid>-<random>.tmp (see atomic_path); also .<stem>.<random>.tmp<suffix> of older versions
_TEMP_RE = re.compile(r"^\..+\.tmp(\.[^.]+)?$")
# What libraries that hide the OSError say when the disk is full: the C library's strerror,
# safetensors' Rust writer ("StorageFull", "os error 28"), torch's zip writer (a short write
# surfaces as "file write failed" or "[enforce fail at inline_container.cc] unexpected pos").
_NO_SPACE_TEXT = ("no space left on device", "storagefull", "os error 28", "code: 28", "enospc",
                  "file write failed", "unexpected pos")


class DiskFullError(OSError):
    """The disk (or quota) ran full while writing ``path``; the partial file was removed."""

    def __init__(self, path: str | os.PathLike, note: str = ""):
        self.path = Path(path)
        msg = (f"no space left on {self.path.parent} (while writing {self.path.name}); the partial file was "
               "removed and every file finished before it is complete and safe")
        super().__init__(errno.ENOSPC, msg + (f"; {note}" if note else "") + "; free some space and run again")

    def __str__(self) -> str:  # one line, without OSError's "[Errno 28]" prefix
        return self.strerror


def current_umask() -> int:
    """The process umask (reading it requires setting it; it is restored at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_mode(directory: bool = False) -> int:
    """Permissions a new file (or directory) gets from ``open``/``mkdir`` under the current umask."""
    return (0o777 if directory else 0o666) & ~current_umask()


def is_temp_name(name: str) -> bool:
    """True for the name of an unfinished atomic write (file or directory) of this package."""
    return _TEMP_RE.match(name) is not None


def finished_files(directory: str | os.PathLike, pattern: str = "*") -> list[Path]:
    """Sorted entries of ``directory`` matching ``pattern``, without temp files of unfinished
    writes; empty if the directory does not exist."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob(pattern) if not is_temp_name(p.name))


def temp_leftovers(directory: str | os.PathLike) -> list[Path]:
    """Temp files and directories of killed writes in ``directory`` (not recursive)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if is_temp_name(p.name))


def is_disk_full(exc: BaseException) -> bool:
    """True if ``exc`` (or an exception it was raised from) says the disk is full."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(exc).lower() for t in _NO_SPACE_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path for ``path``; on success rename it over ``path``.

    The temp file sits in a private temp directory next to ``path``
    (``.<stem>.<pid>-<random>.tmp/<name>``), so whatever a library writes beside it (safetensors' own
    ``.tmpXXXXXX``) is inside a directory this package owns: a killed write leaves one entry that
    :func:`is_temp_name` recognises and :func:`clean_leftovers` removes. The file keeps its final name
    so libraries that infer the format from the extension (PIL, safetensors) still work.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = tmp_path = None
    try:
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.stem}.{os.getpid()}-", suffix=TEMP_MARK, dir=path.parent))
        tmp_path = tmp_dir / path.name
        tmp_path.touch()
        yield tmp_path
        os.chmod(tmp_path, default_mode())  # some writers (safetensors) recreate the file: set the usual mode last
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except Exception as e:
        if is_disk_full(e) and not isinstance(e, DiskFullError):
            raise DiskFullError(path) from None
        raise
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)


_PID_RE = re.compile(r"^\..+\.(\d+)-[^.]*\.tmp(\.[^.]+)?$")
STALE_SECONDS = 3600  # a temp entry without a process id (older writers) is a leftover after an hour


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clean_leftovers(directory: str | os.PathLike) -> list[Path]:
    """Remove what killed writes left in ``directory`` (not recursive): temp entries of processes that no
    longer run on this machine, and unattributed ones older than :data:`STALE_SECONDS`. A live write of
    another process into the same directory is left alone. Returns what was removed."""
    removed = []
    for entry in temp_leftovers(directory):
        m = _PID_RE.match(entry.name)
        try:
            stale = (not _alive(int(m.group(1)))) if m else time.time() - entry.lstat().st_mtime > STALE_SECONDS
        except OSError:
            continue
        if not stale or (m and int(m.group(1)) == os.getpid()):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    if removed:
        log.info("removed %d leftover(s) of killed writes in %s", len(removed), directory)
    return removed


def check_output_file(path: str | os.PathLike, flag: str) -> None:
    """Refuse, before any work, an output file path that cannot be written: an existing directory, or a
    path below something that is a file. ``flag`` names the option for the message."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {path}: {parent} is a file, not a directory; choose another path")
            break


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def atomic_save(path: str | os.PathLike, save_fn: Callable[[Path], None]) -> None:
    """Call ``save_fn(tmp_path)`` and atomically move the result to ``path``."""
    with atomic_path(path) as tmp:
        save_fn(tmp)
