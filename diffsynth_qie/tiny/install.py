"""Installing a locally built model, whichever tiny family it is (``build.py``'s Edit model, ``qwen21.py``'s
2.1): the atomic build into its directory, and the registration of its weight files with DiffSynth."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..utils.atomic import default_mode

log = logging.getLogger(__name__)


def ensure_built(out_dir: str | os.PathLike, seed: int | None, build, complete, replaceable, what: str) -> Path:
    """``build.ensure_tiny`` for any locally built model: ``build(dir, seed=)`` writes it, ``complete(dir, seed=)``
    says a directory holds a finished build, ``replaceable(dir)`` that it holds nothing else."""
    out_dir = Path(out_dir)
    if not replaceable(out_dir):
        raise ValueError(f"{out_dir} exists and holds files that are not part of a {what}; "
                         "refusing to replace it — pass an empty or new directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    os.chmod(tmp, default_mode(directory=True))  # mkdtemp makes it 0700; the final dir should look like a normal one
    try:
        build(tmp, seed=0 if seed is None else seed)
        if out_dir.exists():
            if complete(out_dir, seed=seed):  # another process finished first
                return out_dir
            # Move the old one aside first: os.replace can't replace a non-empty directory.
            stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale.", dir=out_dir.parent))
            os.replace(out_dir, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not complete(out_dir, seed=seed):  # lost a race to a concurrent builder: fine if done
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("%s ready in %s", what, out_dir)
    return out_dir


def model_config(module, model_class: str, model_name: str, **extra_kwargs) -> dict:
    """A ``MODEL_CONFIGS`` entry for ``module``'s weight file: DiffSynth finds it by the hash of its key names and
    shapes, and builds ``model_class(**extra_kwargs)`` for it."""
    from diffsynth.core.loader import hash_state_dict_keys

    return {"model_hash": hash_state_dict_keys(module.state_dict()), "model_name": model_name,
            "model_class": model_class, "extra_kwargs": extra_kwargs}


def register_model_configs(entries, parents: dict[str, str]) -> None:
    """Append ``entries`` to DiffSynth's ``MODEL_CONFIGS`` list object (idempotent), and give each of our
    subclasses (``parents``: ours -> DiffSynth's class) its parent's VRAM-management module map."""
    from diffsynth.configs import MODEL_CONFIGS, VRAM_MANAGEMENT_MODULE_MAPS

    known = {(c["model_hash"], c["model_class"]) for c in MODEL_CONFIGS}
    for entry in entries:
        if (entry["model_hash"], entry["model_class"]) not in known:
            MODEL_CONFIGS.append(dict(entry))
    for ours, parent in parents.items():
        if ours not in VRAM_MANAGEMENT_MODULE_MAPS and parent in VRAM_MANAGEMENT_MODULE_MAPS:
            VRAM_MANAGEMENT_MODULE_MAPS[ours] = VRAM_MANAGEMENT_MODULE_MAPS[parent]
