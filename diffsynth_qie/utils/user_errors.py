"""Errors a user can cause from the outside (permissions, read-only mounts, missing paths, unreadable
images), told in one line that names the path and the fix. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import errno
import os
from typing import Optional

_FIXES = {
    errno.EACCES: "check its permissions, or choose a directory you can write to",
    errno.EPERM: "check its permissions, or choose a directory you can write to",
    errno.EROFS: "the file system is mounted read-only: choose a writable directory",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
    errno.EISDIR: "it is a directory: give a file path",
    errno.EEXIST: "it exists already: remove it or choose another path",
    errno.ENAMETOOLONG: "shorten the path",
    errno.ENOTEMPTY: "it is not empty: remove it or choose another path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
}


def os_error_line(exc: BaseException) -> Optional[str]:
    """One line for an :class:`OSError` a user's environment causes, or None (a bug: show the traceback)."""
    try:
        from PIL import UnidentifiedImageError
    except ImportError:  # pragma: no cover
        UnidentifiedImageError = ()
    if isinstance(exc, UnidentifiedImageError):
        return f"{exc}: not an image PIL can read (convert it to PNG or JPEG, or remove it from the dataset)"
    if not isinstance(exc, OSError) or exc.errno not in _FIXES:
        return None
    where = exc.filename or ""
    if exc.filename2:
        where = f"{where} -> {exc.filename2}"
    reason = exc.strerror or os.strerror(exc.errno)
    return f"{reason}: {where or '(no path given)'}; {_FIXES[exc.errno]}"
