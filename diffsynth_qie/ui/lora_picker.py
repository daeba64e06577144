"""The UI's LoRA picker: which files are listed, how a picked name is resolved, and what each label says.

- **Listing** (:func:`list_loras`): LoRA files under the LoRA folder, by header (cache
  shards and a checkpoint's raw ``trainable.safetensors`` are left out).
- **Containment** (:func:`resolve_lora`): the browser only ever sends a *name relative
  to the LoRA folder*; absolute paths, ``..`` components and symlinks whose target leaves
  the folder are refused, so a crafted request cannot make the server read another file.
- **Labels** (:func:`lora_info`, :meth:`LoraInfo.label`): what training wrote in the
  file's metadata (loss, preset, rank, step), so a user picks a LoRA by what it is, the
  UI can switch to the LBM sampler for an LBM LoRA, and a preset mismatch is flagged.
- **One look** (:class:`LoraFolder`): the folder as one click sees it; each file's header (its keys and
  metadata) is read once, whatever the click asks of it (list, labels, schedules, what it was trained on).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from .uploads import UIError

NO_LORA = "(none)"
LORA_SUFFIX = ".safetensors"


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def list_loras(lora_dir: str | os.PathLike) -> list[str]:
    """The LoRA files under ``lora_dir`` (recursive), as sorted POSIX paths relative to it.

    Hidden files and folders are skipped (atomic writes leave ``.name.XXXX.tmp.safetensors``
    while saving). Symlinks are listed only if their target stays inside the folder,
    so everything listed is also accepted by :func:`resolve_lora`. Only files whose header names
    LoRA pairs are listed (not cache shards), and not a checkpoint's ``trainable.safetensors`` (the raw
    training tensors; the checkpoint's ``lora.safetensors`` beside it is the loadable LoRA).
    """
    return LoraFolder(lora_dir).names()


def resolve_lora(lora_dir: str | os.PathLike, name: str | None) -> Path | None:
    """The real path of the LoRA ``name`` (relative to ``lora_dir``), or None for "no LoRA".

    Refuses (UIError) absolute paths, drive letters, ``..`` components, names that are
    not ``.safetensors``, and anything whose resolved path leaves ``lora_dir``
    (symlinks included) — the picker must not become a way to read other files.
    """
    if name is None or not str(name).strip() or name == NO_LORA:
        return None
    name = str(name).strip()
    shown = name if len(name) <= 120 else name[:117] + "..."
    posix = PurePosixPath(name.replace("\\", "/"))
    if "\x00" in name or posix.is_absolute() or PureWindowsPath(name).drive or PureWindowsPath(name).is_absolute():
        raise UIError(f"LoRA {shown!r} is not a name inside the LoRA folder; pick one from the list")
    if ".." in posix.parts:
        raise UIError(f"LoRA {shown!r} points outside the LoRA folder ('..'); pick one from the list")
    if posix.suffix != LORA_SUFFIX:
        raise UIError(f"LoRA {shown!r} is not a {LORA_SUFFIX} file; pick one from the list")
    root = Path(lora_dir).expanduser().resolve()
    try:
        real = (root / posix).resolve(strict=True)
    except (OSError, RuntimeError):
        raise UIError(f"LoRA {shown!r} no longer exists; press the refresh button and pick again") from None
    if not _inside(real, root):
        raise UIError(f"LoRA {shown!r} links outside the LoRA folder; refusing to load it")
    if not real.is_file():
        raise UIError(f"LoRA {shown!r} is not a file; pick one from the list")
    return real


# --- what a LoRA file says about itself ----------------------------------------------------
def _plain(value: str | None):
    """A metadata value as training stored it (JSON-encoded non-strings), decoded when it is JSON."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value


@dataclass(frozen=True)
class LoraInfo:
    """The training facts of one LoRA file (None where its metadata does not say)."""

    name: str                  # relative to the LoRA folder
    loss: str | None = None    # "sft" (flow matching) or "lbm"
    preset: str | None = None  # the model preset it was trained on
    rank: int | None = None
    step: int | None = None    # the training step it was saved at
    lightning: bool = False
    family: str | None = None  # the model family of ``preset``

    @property
    def is_lbm(self) -> bool:
        return bool(self.loss) and str(self.loss).startswith("lbm")

    def mismatch(self, model: str) -> str | None:
        """A warning when the LoRA was trained on another preset of this family (it loads; results may be off)."""
        from ..models.presets import get_preset

        try:
            trained, serving = get_preset(str(self.preset)).name, get_preset(model).name
        except ValueError:  # no preset recorded, or one this build does not know
            return None
        if trained == serving:
            return None
        return f"`{self.name}` was trained on **{trained}**, but this UI serves **{serving}**: expect weaker edits"

    def label(self, model: str) -> str:
        """The picker's text, e.g. ``run1/lora.safetensors · LBM · 2511 · rank 16 · step 800``."""
        parts = [self.name]
        if self.lightning:
            parts.append("Lightning")
        elif self.loss:
            parts.append("LBM" if self.is_lbm else "flow matching")
        if self.preset:
            parts.append(str(self.preset))
        if self.rank:
            parts.append(f"rank {self.rank}")
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.mismatch(model):
            parts.append("⚠ other model")
        return " · ".join(parts)


def lora_info(root: str | os.PathLike, name: str) -> LoraInfo:
    """The metadata of ``root/name`` (header only; an unreadable header gives a bare :class:`LoraInfo`)."""
    return LoraFolder(root).info(name)


class LoraFolder:
    """The LoRA folder as one look sees it: each file's header (whether it names LoRA pairs, its metadata) is
    read on first use and kept, so listing, labels and what a picked LoRA declares read it once."""

    def __init__(self, lora_dir: str | os.PathLike):
        self.lora_dir = str(lora_dir)
        self.root = Path(lora_dir).expanduser()
        self._headers: dict[str, tuple[bool, dict[str, str]]] = {}
        self._names: list[str] | None = None

    def _header(self, name: str) -> tuple[bool, dict[str, str]]:
        if name not in self._headers:
            from ..lora.formats import lora_header

            self._headers[name] = lora_header(self.root / name)
        return self._headers[name]

    def metadata(self, name: str) -> dict[str, str]:
        """The header metadata of the file ``name`` ({} when it has none or cannot be read)."""
        return self._header(name)[1]

    def names(self) -> list[str]:
        """:func:`list_loras` of this folder."""
        if self._names is None:
            self._names = self._listed()
        return list(self._names)

    def _listed(self) -> list[str]:
        from ..training.checkpoint import TRAINABLE_NAME

        if not self.root.is_dir():
            return []
        root = self.root.resolve()
        found = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith(".") or not name.endswith(LORA_SUFFIX):
                    continue
                path = Path(dirpath) / name
                try:
                    real = path.resolve(strict=True)
                except (OSError, RuntimeError):  # dangling or looping symlink
                    continue
                relative = path.relative_to(root).as_posix()
                if _inside(real, root) and real.is_file() and name != TRAINABLE_NAME and self._header(relative)[0]:
                    found.append(relative)
        return sorted(found)

    def info(self, name: str) -> LoraInfo:
        """The training facts of the file ``name`` (a bare :class:`LoraInfo` when its header says nothing)."""
        from ..lora.manager import lora_family
        from ..models.samplers.lightning import is_lightning_lora

        meta = self.metadata(name)
        rank, step = _plain(meta.get("rank")), _plain(meta.get("step"))
        return LoraInfo(name=name, loss=_plain(meta.get("loss")), preset=_plain(meta.get("preset")),
                        rank=rank if isinstance(rank, int) else None, step=step if isinstance(step, int) else None,
                        lightning=is_lightning_lora(self.root / name, meta), family=lora_family(meta))

    def resolve(self, name: str | None) -> Path | None:
        """:func:`resolve_lora` in this folder."""
        return resolve_lora(self.lora_dir, name)
