"""Which family a DiT's weight files belong to, read from their safetensors headers (no tensor is read), so a
``--model_dir`` of the other family is named in our words before DiffSynth's "Cannot detect the model type".

Qwen-Image-Edit's DiT is dual-stream: its blocks hold a text stream (``txt_mlp``, ``attn.add_q_proj``).
Qwen-Image-2.1's is single-stream, with one shared ``modulation`` at the top.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from ..family import EDIT, QWEN21, Family


def _keys(paths: Iterable[str]) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for p in paths:
        if Path(p).is_file() and str(p).endswith(".safetensors"):
            with safe_open(str(p), "pt") as f:
                keys.update(f.keys())
    return keys


def dit_family(paths: Iterable[str]) -> Optional[Family]:
    """The family of the DiT in ``paths`` (its .safetensors files), or None when the headers do not say."""
    try:
        keys = _keys(paths)
    except Exception:  # noqa: BLE001 - an unreadable file is the loader's to report
        return None
    if any(".txt_mlp." in k or ".attn.add_q_proj." in k for k in keys):
        return EDIT
    if "modulation.1.weight" in keys or any(k.startswith("modulation.") for k in keys):
        return QWEN21
    return None


def check_dit_family(paths: Iterable[str], preset, family: Family, where: str) -> None:
    """ValueError when the DiT files are of another family than ``preset``'s."""
    found = dit_family(paths)
    if found is not None and found.name != family.name:
        tiny = getattr(preset, "is_tiny", False)
        others = ("tiny-2.1" if tiny else "2.1") if found is QWEN21 else ("tiny" if tiny else "2511")
        raise ValueError(f"{where} holds a {found.label} DiT, but --model {preset.name} is {family.label}; pass a "
                         f"--model of its family (e.g. --model {others}) or a --model_dir of {family.label}")
