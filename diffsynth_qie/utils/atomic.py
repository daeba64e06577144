"""Atomic writes: write to a temp file in the same directory, fsync, then rename.

A reader (or a resumed run) therefore never sees a half-written cache shard,
checkpoint or image: either the old file or the complete new one.

Temp files are named ``.<stem>.<random>.tmp<suffix>`` (hidden, and recognisable by
:func:`is_temp_name`); every directory listing of finished files goes through
:func:`finished_files`, so a leftover of a killed write is never taken for a result.
Finished files get the permissions the umask gives any new file (``0o666 & ~umask``),
whatever the library that wrote them chose. A full disk ends in :class:`DiskFullError`
naming the directory, with the partial file removed.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

TEMP_MARK = ".tmp"
# .<stem>.<mkstemp random>.tmp<suffix>  (see atomic_path)
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
    """Yield a temp path next to ``path``; on success rename it over ``path``.

    The temp name keeps the final suffix so libraries that infer the format from
    the extension (PIL, safetensors) still work.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f"{TEMP_MARK}{path.suffix}", dir=path.parent)
        os.close(fd)
        tmp_path = Path(tmp)
        yield tmp_path
        # mkstemp makes 0600 and some writers (safetensors) recreate the file: set the usual mode last
        os.chmod(tmp_path, default_mode())
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except Exception as e:
        if is_disk_full(e) and not isinstance(e, DiskFullError):
            if tmp_path is not None:
                tmp_path.unlink(missing_ok=True)
            raise DiskFullError(path) from None
        raise
    finally:
        if tmp_path is not None and tmp_path.exists():
            tmp_path.unlink()


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
