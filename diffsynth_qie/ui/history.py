"""The session history: every result of this browser tab, newest first, with what it was made with.

Held in a ``gr.State`` (one list per tab, never shared between users). Clicking an
entry restores its settings to the widgets (:func:`restore`) and shows it again;
"Edit this result" loads it into the editor (:func:`editor_value`), the chained
editing Qwen-Image-Edit is used for.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .results import EditSettings, read_extras, read_settings
from .settings import RESTORED

log = logging.getLogger(__name__)

MAX_ENTRIES = 48


@dataclass(frozen=True)
class HistoryEntry:
    image: str                    # the result's PNG (settings in its text chunks)
    before: str                   # the input at the output's size (the slider's left side)
    settings: EditSettings
    sub_image: str | None = None  # LBM's sub-stream result
    mask: str | None = None       # the mask the result was made with (white = edited)
    command: str = ""             # the `qie edit` command that repeats it
    input: str | None = None      # the image edited, at its own size
    references: tuple[str, ...] = ()  # the extra reference images
    mask_source: str | None = None    # the paint and mask file before invert and grow (what a restore puts back)

    @property
    def caption(self) -> str:
        """What tells entries apart first (seed, sampler, LoRA), then the prompt."""
        s = self.settings
        head = f"seed {s.seed} · {s.sampler()}" + (f" · {s.lora}" if s.lora else "")
        prompt = s.prompt if len(s.prompt) <= 40 else s.prompt[:39] + "…"
        return f"{head} · {prompt}"


def add(history: list[HistoryEntry] | None, entries: list[HistoryEntry]) -> list[HistoryEntry]:
    """A new list: ``entries`` (in order) before the older ones, at most :data:`MAX_ENTRIES`."""
    return [*entries, *(history or [])][:MAX_ENTRIES]


def gallery(history: list[HistoryEntry] | None) -> list[tuple[str, str]]:
    """The history gallery's value: (image, caption), newest first."""
    return [(e.image, e.caption) for e in history or []]


def restore(entry: HistoryEntry, known_loras: list[str]) -> tuple:
    """The widget values of ``entry``, in the order of ``settings.RESTORED`` (the rows of ``SETTINGS`` a history
    click restores). A LoRA no longer in the folder becomes "none"."""
    from .lora_picker import NO_LORA

    s = entry.settings
    values = {name: getattr(s, name) for name in RESTORED}
    for key in ("lora", "lora2"):
        values[key] = values[key] if values[key] in known_loras else NO_LORA
    return tuple(values[name] for name in RESTORED)


def editor_value(image: str) -> dict:
    """An image editor value holding ``image`` as the background and no paint."""
    return {"background": image, "layers": [], "composite": image}


def load_saved(folder: str | Path, limit: int = MAX_ENTRIES) -> list[HistoryEntry]:
    """The results saved under ``folder`` (one subfolder per Generate, as ``ui/outputs.py`` writes them), newest
    first: the history after a restart or a page reload. Files that are not ours are skipped."""
    root = Path(folder)
    if not root.is_dir():
        return []
    entries: list[HistoryEntry] = []
    for run in sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.name, reverse=True):
        pngs = sorted((p for p in run.glob("*.png") if p.stem.startswith("edit") and not p.stem.endswith("_sub")),
                      key=lambda p: p.stat().st_mtime)
        befores = sorted(run.glob("before-*.png"))
        for png in pngs:
            try:
                settings = read_settings(png)
                files, command = read_extras(png)
            except (OSError, ValueError, TypeError) as exc:
                log.warning("history: skipped %s (%s)", png, exc)
                continue
            if settings is None or not befores:
                continue
            sub, mask, source = png.with_name(f"{png.stem}_sub.png"), run / "mask.png", run / "input.png"
            mask_source = run / "mask-source.png"
            entries.append(HistoryEntry(
                image=str(png), before=str(befores[0]), settings=settings, sub_image=str(sub) if sub.is_file() else None,
                mask=str(mask) if mask.is_file() else None, command=command,
                input=str(source) if source.is_file() else None,
                references=tuple(r for r in files["references"] if Path(r).is_file()),
                mask_source=str(mask_source) if mask_source.is_file() else None))
            if len(entries) >= limit:
                return entries
    return entries
