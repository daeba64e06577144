"""The DiT's weight files on disk: one file or shards with an index, read header-first.

A Qwen-Image(-Edit) repository keeps the DiT as
``transformer/diffusion_pytorch_model-0000N-of-0000M.safetensors`` plus
``transformer/diffusion_pytorch_model.safetensors.index.json`` (``{"metadata": {"total_size": ...},
"weight_map": {key: file}}``); the tiny model keeps one
``transformer/diffusion_pytorch_model.safetensors``. ``qie merge-lora`` and ``qie extract-lora``
read them one shard at a time through ``safetensors.safe_open``, so only one shard's tensors
are ever in memory.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ...utils.atomic import finished_files

DIT_SUBDIR = "transformer"
DIT_STEM = "diffusion_pytorch_model"
INDEX_NAME = f"{DIT_STEM}.safetensors.index.json"


@dataclass
class DitFiles:
    """The DiT's shard files (in order), where each key lives, and each key's shape."""

    folder: Path
    files: list[Path]
    key_file: dict[str, str]            # key -> file name
    shapes: dict[str, tuple[int, ...]]  # key -> shape (from the headers; no tensor is read)
    dtypes: dict[str, str]              # key -> safetensors dtype name ("BF16", "F32", ...)
    indexed: bool                       # an index.json lists the shards

    def keys_of(self, name: str) -> list[str]:
        return [k for k, f in self.key_file.items() if f == name]


def _read_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    from safetensors import safe_open

    shapes, dtypes = {}, {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                shapes[key] = tuple(sl.get_shape())
                dtypes[key] = sl.get_dtype()
    except Exception as e:  # safetensors raises its own error types for damaged headers
        raise ValueError(f"DiT weight file {path} is not a readable safetensors file ({e}); "
                         "re-download it") from e
    return shapes, dtypes


def dit_folder(base: str | os.PathLike) -> Path:
    """``base/transformer`` for a model directory, or ``base`` itself when it holds the DiT files."""
    base = Path(base)
    if not base.is_dir():
        raise ValueError(f"model directory {base} does not exist; give a directory in the model "
                         "repository's layout (with transformer/) or a preset name")
    for folder in (base / DIT_SUBDIR, base):
        if finished_files(folder, f"{DIT_STEM}*.safetensors"):
            return folder
    raise ValueError(f"{base} holds no DiT weights: expected {base / DIT_SUBDIR / (DIT_STEM + '*.safetensors')}")


def read_dit_files(folder: str | os.PathLike) -> DitFiles:
    """Index the DiT files in ``folder`` (the ``transformer/`` directory)."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        names = list(dict.fromkeys(sorted(weight_map.values())))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"{index} lists shard(s) missing from {folder}: {', '.join(missing)}; "
                             "the download is incomplete")
        files = [folder / n for n in names]
    else:
        files = finished_files(folder, f"{DIT_STEM}*.safetensors")
        if len(files) != 1:
            raise ValueError(f"{folder} holds {len(files)} DiT files but no {INDEX_NAME}; "
                             "keep one file or add the index")
    key_file, shapes, dtypes = {}, {}, {}
    for path in files:
        s, d = _read_header(path)
        for key in s:
            if key in key_file:
                raise ValueError(f"key {key} is in both {key_file[key]} and {path.name}")
            key_file[key] = path.name
        shapes.update(s)
        dtypes.update(d)
    return DitFiles(folder=folder, files=files, key_file=key_file, shapes=shapes, dtypes=dtypes,
                    indexed=index.is_file())


def resolve_dit(base: str | os.PathLike) -> DitFiles:
    """A model directory, a ``transformer/`` directory, or a preset name whose DiT is downloaded."""
    if not Path(base).exists() and "/" not in str(base):
        from .loading import resolve_model_configs
        from ..presets import PRESETS

        if str(base) in PRESETS:
            config = resolve_model_configs(str(base), components=("dit",)).configs()["dit"]
            path = getattr(config, "path", None)
            if not path:
                raise ValueError(f"preset {base}'s DiT is not downloaded; download it or give its directory")
            first = Path(path[0] if isinstance(path, list) else path)
            return read_dit_files(first.parent)
    return read_dit_files(dit_folder(base))
