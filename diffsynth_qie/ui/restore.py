"""Bringing a result back whole: its settings into the widgets and its files (image, mask, reference images) into
the editor, so that nothing of the edit shown before is left behind. For a history click and for a dropped PNG.

A PNG's text is the browser's to craft: its settings pass Generate's own checks (``results.read_settings``), and its
files come back only when they are this tab's (:func:`tab_files`: its history's and what the UI gave it), so a
PNG naming another tab's input restores the settings alone. A LoRA no longer in the folder is said, not claimed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from . import history as hist
from .results import EditSettings, read_extras, read_settings
from .uploads import UIError


def _inside(path: Any, root: Path, allowed: set[str] | None = None) -> str | None:
    """``path`` when it is a file under ``root`` (a PNG's text names files; only the UI's own are read back) and,
    with ``allowed`` (resolved paths), one of those."""
    if not path:
        return None
    p = Path(str(path))
    try:
        real = p.resolve()
        return str(p) if p.is_file() and real.is_relative_to(root.resolve()) and (
            allowed is None or str(real) in allowed) else None
    except OSError:
        return None


def files_of(files: dict, root: Path, allowed: set[str] | None = None) -> dict:
    """{"image", "mask", "references"} of a record, each kept only when it is a file under ``root`` (and, with
    ``allowed``, one of those files), and "withheld": whether a named image was left out for ``allowed``."""
    refs = [r for r in (_inside(r, root, allowed) for r in files.get("references") or []) if r]
    image = _inside(files.get("image"), root, allowed)
    return {"image": image, "mask": _inside(files.get("mask"), root, allowed), "references": refs,
            "withheld": image is None and allowed is not None and _inside(files.get("image"), root) is not None}


def tab_files(history: list, given: frozenset[str]) -> set[str]:
    """The files a browser tab may get back from a dropped PNG: those of its history's entries (a history click
    brings them back too) and those the UI gave its editor; resolved paths."""
    named = [*given, *(f for e in history or [] for f in (e.image, e.input, e.mask, e.mask_source, *e.references))]
    return {str(Path(f).resolve()) for f in named if f}


def missing_loras(settings: EditSettings, known_loras: list[str]) -> str:
    """What a restore cannot bring back of the LoRAs (a file no longer in the LoRA folder: none is picked)."""
    gone = [f"{label} {name} is not in the LoRA folder: none is picked" for label, name in
            (("LoRA", settings.lora), ("second LoRA", settings.lora2)) if name and name not in known_loras]
    return "; ".join(gone)


def widget_values(settings: EditSettings, known_loras: list[str]) -> dict[str, Any]:
    """{setting name: value} of every restored setting. The restored mask file is the paint and mask file before
    invert and grow, so the restored invert and grow give the result's mask again."""
    entry = hist.HistoryEntry(image="", before="", settings=settings)
    return dict(zip(hist.RESTORED, hist.restore(entry, known_loras)))


def from_png(path: str | Path, root: Path, allowed: set[str] | None = None) -> tuple[EditSettings, dict]:
    """The settings and the (still present, UI-owned; with ``allowed``, this tab's: :func:`tab_files`) input files
    of a PNG this project wrote."""
    try:
        settings = read_settings(path)
        files, _ = read_extras(path)
    except UIError as exc:  # a value Generate's own check refuses
        raise UIError(f"{Path(str(path)).name} holds a setting this UI cannot restore: {exc}; drop a result PNG "
                      "of this UI") from None
    except (OSError, ValueError, TypeError) as exc:
        raise UIError(f"{Path(str(path)).name} is not a readable PNG ({exc}); drop a result PNG of this UI") from None
    if settings is None:
        raise UIError(f"{Path(str(path)).name} carries no diffsynth-qie settings; drop a PNG this UI or "
                      "`qie edit` made")
    return settings, files_of(files, root, allowed)
