"""The session history: every result of this browser tab, newest first, with what it was made with.

Held in a ``gr.State`` (one list per tab, never shared between users). Clicking an
entry restores its settings to the widgets (:func:`restore`) and shows it again;
"Edit this result" loads it into the editor (:func:`editor_value`), the chained
editing Qwen-Image-Edit is used for.
"""
from __future__ import annotations

from dataclasses import dataclass

from .results import EditSettings
from .settings import RESTORED

MAX_ENTRIES = 48


@dataclass(frozen=True)
class HistoryEntry:
    image: str                    # the result's PNG (settings in its text chunks)
    before: str                   # the input at the output's size (the slider's left side)
    settings: EditSettings
    sub_image: str | None = None  # LBM's sub-stream result
    mask: str | None = None       # the mask the result was made with (white = edited)
    command: str = ""             # the `qie edit` command that repeats it

    @property
    def caption(self) -> str:
        s = self.settings
        prompt = s.prompt if len(s.prompt) <= 40 else s.prompt[:39] + "…"
        return f"{prompt} · seed {s.seed}" + (f" · {s.lora}" if s.lora else "")


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
