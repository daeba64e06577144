"""Cheap integrity checks of finished files: truncation and unreadable headers, without
loading any tensor (used to tell a damaged checkpoint from an intact one)."""
from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Optional


def safetensors_problem(path: Path) -> Optional[str]:
    """A safetensors file's header is readable and the file holds every byte it describes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is truncated ({size} bytes)"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"{path} is truncated (header of {n} bytes, file of {size})"
            header = json.loads(f.read(n))
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, ValueError) as e:
        return f"{path} has an unreadable header ({e})"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, KeyError, TypeError, IndexError, ValueError) as e:
        return f"{path} has an unreadable header (not a safetensors header: {type(e).__name__}: {e})"
    if 8 + n + end > size:
        return f"{path} is truncated ({size} of {8 + n + end} bytes)"
    return None


def state_file_problem(path: Path) -> Optional[str]:
    """An accelerate/torch state file is non-empty and, if a zip (torch.save), not truncated."""
    size = path.stat().st_size
    if size == 0:
        return f"{path} is empty"
    with open(path, "rb") as f:
        is_zip = f.read(2) == b"PK"
    if is_zip and not zipfile.is_zipfile(path):
        return f"{path} is truncated"
    if path.suffix == ".safetensors":
        return safetensors_problem(path)
    return None
