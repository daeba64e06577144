"""Bringing a result back whole: its settings into the widgets and its files (image, mask, reference images) into
the editor, so that nothing of the edit shown before is left behind. For a history click and for a dropped PNG."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from . import history as hist
from .results import EditSettings, read_extras, read_settings
from .uploads import UIError


def _inside(path: Any, root: Path) -> str | None:
    """``path`` when it is a file under ``root`` (a PNG's text names files; only the UI's own are read back)."""
    if not path:
        return None
    p = Path(str(path))
    try:
        return str(p) if p.is_file() and p.resolve().is_relative_to(root.resolve()) else None
    except OSError:
        return None


def files_of(files: dict, root: Path) -> dict:
    """{"image", "mask", "references"} of a record, each kept only when it is a file under ``root``."""
    refs = [r for r in (_inside(r, root) for r in files.get("references") or []) if r]
    return {"image": _inside(files.get("image"), root), "mask": _inside(files.get("mask"), root), "references": refs}


def widget_values(settings: EditSettings, known_loras: list[str]) -> dict[str, Any]:
    """{setting name: value} of every restored setting. The restored mask file is the paint and mask file before
    invert and grow, so the restored invert and grow give the result's mask again."""
    entry = hist.HistoryEntry(image="", before="", settings=settings)
    return dict(zip(hist.RESTORED, hist.restore(entry, known_loras)))


def from_png(path: str | Path, root: Path) -> tuple[EditSettings, dict]:
    """The settings and the (still present, UI-owned) input files of a PNG this project wrote."""
    try:
        settings = read_settings(path)
        files, _ = read_extras(path)
    except (OSError, ValueError, TypeError) as exc:
        raise UIError(f"{Path(str(path)).name} is not a readable PNG ({exc}); drop a result PNG of this UI") from None
    if settings is None:
        raise UIError(f"{Path(str(path)).name} carries no diffsynth-qie settings; drop a PNG this UI or "
                      "`qie edit` made")
    return settings, files_of(files, root)
