"""Where the pretrained tiny base lives, how it is recognised, and its shipped weights.

The recipe that trains it is ``training/pretrain_tiny.py`` (training code sits
above models/, so this module only stores, checks and installs results).

- A built directory is the tiny model's repo layout (``tiny/build.py``) whose
  ``tiny_model.json`` carries a ``pretrained`` record with the recipe fingerprint.
- The package ships the trained DiT and VAE (``assets/tiny_pretrained/``, about
  2 MB) with the fingerprint they were built from and the sha256 of the text encoder
  they were trained with. :func:`install_shipped` builds the random tiny model from
  seed 0, checks its text encoder is byte-identical to that one, and swaps in the
  shipped weights: seconds instead of minutes of training. On any mismatch (a
  changed recipe, a torch that initialises differently) it declines, and the caller
  trains instead.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .build import DIT_FILE, DIT_SIZES, INFO_FILE, TEXT_ENCODER_FILE, TEXT_SIZES, VAE_FILE, build_tiny, is_complete

log = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).parent / "assets" / "tiny_pretrained"
SHIPPED_INFO = "pretrained.json"
_SHIPPED_FILES = {"dit": (DIT_FILE, "transformer.safetensors"), "vae": (VAE_FILE, "vae.safetensors")}


def default_dir() -> Path:
    from ..models.load.loading import qie_home

    return qie_home() / "models" / "Qwen-Image-Edit-tiny-pretrained"


def fingerprint(recipe: dict) -> str:
    """sha256 (16 hex digits) of the recipe together with the model sizes it trains."""
    from .vae import WIDTHS, Z_DIM

    blob = {"recipe": recipe, "dit": {k: list(v) if isinstance(v, tuple) else v for k, v in DIT_SIZES.items()},
            "text": TEXT_SIZES, "vae": {"widths": list(WIDTHS), "z_dim": Z_DIM}}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def register() -> None:
    from .build import register_tiny_model_configs

    register_tiny_model_configs()


def info(model_dir: Path) -> dict:
    try:
        return json.loads((Path(model_dir) / INFO_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def is_pretrained(model_dir: str | os.PathLike, fp: str) -> bool:
    """True if ``model_dir`` is a complete tiny model pretrained with the recipe of fingerprint ``fp``."""
    return is_complete(model_dir) and info(Path(model_dir)).get("pretrained", {}).get("fingerprint") == fp


def mark_pretrained(model_dir: Path, fp: str, recipe: dict, seed: int, stats: dict) -> None:
    """Record the pretraining in ``tiny_model.json`` (written last: marks the build complete)."""
    from ..utils.atomic import atomic_write_json

    data = info(model_dir)
    data["pretrained"] = {"fingerprint": fp, "seed": seed, "recipe": recipe, "stats": stats,
                          "text_encoder_sha256": sha256_file(Path(model_dir) / TEXT_ENCODER_FILE)}
    atomic_write_json(Path(model_dir) / INFO_FILE, data)


def shipped_info() -> dict:
    try:
        return json.loads((SHIPPED_DIR / SHIPPED_INFO).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_shipped(model_dir: str | os.PathLike, dest: Path = SHIPPED_DIR) -> Path:
    """Copy a pretrained build's DiT and VAE (and its record) to ``dest`` (the package's shipped copy)."""
    from ..utils.atomic import atomic_write_json

    model_dir = Path(model_dir)
    record = info(model_dir).get("pretrained")
    if not record:
        raise ValueError(f"{model_dir} holds no pretrained tiny base; build it with `qie make-tiny --pretrained`")
    dest.mkdir(parents=True, exist_ok=True)
    for rel, name in _SHIPPED_FILES.values():
        shutil.copyfile(model_dir / rel, dest / name)
    atomic_write_json(dest / SHIPPED_INFO, record)
    return dest


def build_atomically(out_dir: str | os.PathLike, build: Callable[[Path], object]) -> Path:
    """Run ``build(tmp)`` in a temporary sibling of ``out_dir`` and rename it into place."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        build(tmp)
        if out_dir.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale.", dir=out_dir.parent))
            os.replace(out_dir, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    register()
    return out_dir


def install_shipped(out_dir: str | os.PathLike, fp: str) -> bool:
    """Install the shipped weights into ``out_dir`` if they match ``fp``; False (nothing written) if not."""
    record = shipped_info()
    if record.get("fingerprint") != fp:
        log.info("the shipped pretrained tiny base is from another recipe (%s, want %s): training instead",
                 record.get("fingerprint"), fp)
        return False
    def assemble(tmp: Path) -> None:
        build_tiny(tmp, seed=record.get("seed", 0))
        if sha256_file(tmp / TEXT_ENCODER_FILE) != record.get("text_encoder_sha256"):
            raise _Mismatch
        for rel, name in _SHIPPED_FILES.values():
            shutil.copyfile(SHIPPED_DIR / name, tmp / rel)
        mark_pretrained(tmp, fp, record["recipe"], record.get("seed", 0), record.get("stats", {}))

    try:
        build_atomically(out_dir, assemble)
    except _Mismatch:
        log.info("this torch builds a different random text encoder than the shipped base was trained with: "
                 "training the base instead")
        return False
    log.info("pretrained tiny base installed from the shipped weights in %s", out_dir)
    return True


class _Mismatch(Exception):
    pass
