"""Where a pretrained tiny base lives, how it is recognised, and its shipped weights.

Two bases, one record each (:class:`TinyBase`): the tiny Qwen-Image-Edit's (:data:`EDIT_BASE`) and the tiny
Qwen-Image-2.1's (:data:`QWEN21_BASE`); every function takes the record (the Edit base by default). The
recipe that trains them is ``training/pretrain_tiny.py`` (training code sits above models/, so this module
only stores, checks and installs results).

- A built directory is the tiny model's repo layout (``tiny/build.py``) whose
  ``tiny_model.json`` carries a ``pretrained`` record with the recipe fingerprint.
- The package ships the trained DiT and VAE (``assets/tiny_pretrained/``, about
  2 MB; the 2.1 base's in ``assets/tiny_pretrained21/``) with the fingerprint they were built from and the sha256 of the text encoder
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import build as edit_tiny, qwen21 as tiny21
from .vae import TinyConvQwenImageVAE
from .vae21 import CHANNELS as VAE21_CHANNELS, TinyConvQwenImage21VAE

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
SHIPPED_INFO = "pretrained.json"


@dataclass(frozen=True)
class TinyBase:
    """One pretrained tiny base: its preset, where it is installed and shipped, its random model's build."""

    preset: str                    # the preset it is used with (``--model``)
    dir_name: str                  # its directory under ``$QIE_HOME/models``
    shipped_dir: Path              # the package's copy of its trained weights
    files: dict                    # component -> (file in the model's layout, shipped file name)
    text_encoder_file: str         # the random text encoder it was trained with (checked on install)
    info_file: str                 # the build record it is marked in
    build: Callable                # build(dir, seed=): the random tiny model it starts from
    complete: Callable             # complete(dir): a finished build of that model
    sizes: Callable[[], dict]      # the model sizes the recipe trains (part of the fingerprint)
    register: Callable[[], None]   # its weight files' MODEL_CONFIGS entries
    conv_vae: Callable             # the plain-conv VAE class the recipe trains in the random VAE's place
    vae_channels: int              # the image channels that VAE takes (3: RGB, 4: RGBA)


def _edit_sizes() -> dict:
    from .vae import WIDTHS, Z_DIM

    return {"dit": {k: list(v) if isinstance(v, tuple) else v for k, v in edit_tiny.DIT_SIZES.items()},
            "text": edit_tiny.TEXT_SIZES, "vae": {"widths": list(WIDTHS), "z_dim": Z_DIM}}


def _qwen21_sizes() -> dict:
    from .vae21 import WIDTHS, Z_DIM

    return {"family": "qwen-image-2.1", "dit": tiny21.DIT_KWARGS, "text": tiny21.TEXT_CONFIG,
            "vision": tiny21.VISION_CONFIG, "vae": {"widths": list(WIDTHS), "z_dim": Z_DIM}}


EDIT_BASE = TinyBase(
    preset="tiny", dir_name="Qwen-Image-Edit-tiny-pretrained", shipped_dir=ASSETS / "tiny_pretrained",
    files={"dit": (edit_tiny.DIT_FILE, "transformer.safetensors"), "vae": (edit_tiny.VAE_FILE, "vae.safetensors")},
    text_encoder_file=edit_tiny.TEXT_ENCODER_FILE, info_file=edit_tiny.INFO_FILE, build=edit_tiny.build_tiny,
    complete=edit_tiny.is_complete, sizes=_edit_sizes, register=edit_tiny.register_tiny_model_configs,
    conv_vae=TinyConvQwenImageVAE, vae_channels=3)
QWEN21_BASE = TinyBase(
    preset="tiny-2.1", dir_name="Qwen-Image-2.1-tiny-pretrained", shipped_dir=ASSETS / "tiny_pretrained21",
    files={"dit": (tiny21.DIT_FILE, "transformer.safetensors"), "vae": (tiny21.VAE_FILE, "vae.safetensors")},
    text_encoder_file=tiny21.TEXT_ENCODER_FILE, info_file=tiny21.INFO_FILE, build=tiny21.build_tiny21,
    complete=tiny21.is_complete21, sizes=_qwen21_sizes, register=tiny21.register_tiny21_model_configs,
    conv_vae=TinyConvQwenImage21VAE, vae_channels=VAE21_CHANNELS)
BASES = {b.preset: b for b in (EDIT_BASE, QWEN21_BASE)}
SHIPPED_DIR = EDIT_BASE.shipped_dir


def base_for(preset: str) -> TinyBase:
    """The pretrained base of a tiny preset, or a ValueError naming the presets that have one."""
    if preset not in BASES:
        raise ValueError(f"--model {preset} has no pretrained tiny base; choose one of {', '.join(BASES)}")
    return BASES[preset]


def default_dir(base: TinyBase = EDIT_BASE) -> Path:
    from ..models.load.loading import qie_home

    return qie_home() / "models" / base.dir_name


def fingerprint(recipe: dict, base: TinyBase = EDIT_BASE) -> str:
    """sha256 (16 hex digits) of the recipe together with the model sizes it trains."""
    blob = {"recipe": recipe, **base.sizes()}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def register(base: TinyBase = EDIT_BASE) -> None:
    base.register()


def info(model_dir: Path) -> dict:
    """A build's record (``tiny_model.json``; both tiny families use that name)."""
    try:
        return json.loads((Path(model_dir) / EDIT_BASE.info_file).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def is_pretrained(model_dir: str | os.PathLike, fp: str, base: TinyBase = EDIT_BASE) -> bool:
    """True if ``model_dir`` is a complete tiny model pretrained with the recipe of fingerprint ``fp``."""
    return base.complete(model_dir) and info(Path(model_dir)).get("pretrained", {}).get("fingerprint") == fp


def mark_pretrained(model_dir: Path, fp: str, recipe: dict, seed: int, stats: dict,
                    base: TinyBase = EDIT_BASE) -> None:
    """Record the pretraining in ``tiny_model.json`` (written last: marks the build complete)."""
    from ..utils.atomic import atomic_write_json

    data = info(model_dir)
    data["pretrained"] = {"fingerprint": fp, "seed": seed, "recipe": recipe, "stats": stats,
                          "text_encoder_sha256": sha256_file(Path(model_dir) / base.text_encoder_file)}
    atomic_write_json(Path(model_dir) / base.info_file, data)


def shipped_info(base: TinyBase = EDIT_BASE) -> dict:
    try:
        return json.loads((base.shipped_dir / SHIPPED_INFO).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_shipped(model_dir: str | os.PathLike, dest: Path | None = None, base: TinyBase = EDIT_BASE) -> Path:
    """Copy a pretrained build's DiT and VAE (and its record) to ``dest`` (the package's shipped copy)."""
    from ..utils.atomic import atomic_write_json

    model_dir, dest = Path(model_dir), base.shipped_dir if dest is None else Path(dest)
    record = info(model_dir).get("pretrained")
    if not record:
        raise ValueError(f"{model_dir} holds no pretrained tiny base; build it with "
                         f"`qie make-tiny --model {base.preset} --pretrained`")
    dest.mkdir(parents=True, exist_ok=True)
    for rel, name in base.files.values():
        shutil.copyfile(model_dir / rel, dest / name)
    atomic_write_json(dest / SHIPPED_INFO, record)
    return dest


def build_atomically(out_dir: str | os.PathLike, build: Callable[[Path], object], base: TinyBase = EDIT_BASE) -> Path:
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
    base.register()
    return out_dir


def install_shipped(out_dir: str | os.PathLike, fp: str, base: TinyBase = EDIT_BASE) -> bool:
    """Install the shipped weights into ``out_dir`` if they match ``fp``; False (nothing written) if not."""
    record = shipped_info(base)
    if record.get("fingerprint") != fp:
        log.info("the shipped pretrained tiny base is from another recipe (%s, want %s): training instead",
                 record.get("fingerprint"), fp)
        return False
    def assemble(tmp: Path) -> None:
        base.build(tmp, seed=record.get("seed", 0))
        if sha256_file(tmp / base.text_encoder_file) != record.get("text_encoder_sha256"):
            raise _Mismatch
        for rel, name in base.files.values():
            shutil.copyfile(base.shipped_dir / name, tmp / rel)
        mark_pretrained(tmp, fp, record["recipe"], record.get("seed", 0), record.get("stats", {}), base)

    try:
        build_atomically(out_dir, assemble, base)
    except _Mismatch:
        log.info("this torch builds a different random text encoder than the shipped base was trained with: "
                 "training the base instead")
        return False
    log.info("pretrained tiny base installed from the shipped weights in %s", out_dir)
    return True


class _Mismatch(Exception):
    pass
