"""The callbacks that bring a result back: a history click, a dropped PNG, a variation, "Edit this result"
(``ui/restore.py`` decides what comes back; ``ui/history.py`` holds the entries)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr

from . import history as hist
from . import masks
from . import restore as back
from .history import HistoryEntry
from .mask_events import brush, image_brush
from .messages import error_toast
from .settings import FLOW_DEFAULT_STEPS, MODE_LIGHTNING, shown_for_mode


class RestoreEvents:
    """The restoring methods of :class:`~diffsynth_qie.ui.events.Callbacks` (``self.h``: the UI's handlers;
    ``self._unlocked``: Generate clickable again unless the tab has a generation pending)."""

    h: Any

    @staticmethod
    def _show(entry: HistoryEntry):
        """The slider, sub-stream, downloads, command, "Edit this result" and current entry of ``entry``."""
        files = [f for f in (entry.image, entry.sub_image, entry.input, entry.mask, *entry.references) if f]
        return ((entry.before, entry.image), gr.update(value=entry.sub_image, visible=entry.sub_image is not None),
                files, entry.command, gr.update(interactive=True), entry)

    def _restore_all(self, settings, files: dict, editor: Any, request: gr.Request | None) -> tuple[tuple, str]:
        """(the restored settings' widgets, then editor, loaded record, mask file, references, variations (1), the
        variations grid (hidden) and the batch, then the sampler state (prev_mode, saved_steps), then the brush size;
        what could not be restored, for the status)."""
        image, known = files.get("image"), self.h.lora_choices()
        values = back.widget_values(settings, known)
        values.update({name: gr.update(visible=visible, value=values.get(name))
                       for name, visible in shown_for_mode(settings.mode).items()})
        size = gr.skip()
        if image is not None:
            given, size = self.h.give(getattr(request, "session_hash", None), image), image_brush(image)
            inputs = (gr.update(value=hist.editor_value(image), brush=brush(size)), masks.loaded_record(given, editor),
                      files.get("mask"), files.get("references") or None)
        else:
            inputs = (gr.skip(),) * 4
        widgets = (*(values[name] for name in hist.RESTORED), *inputs, 1, gr.update(value=None, visible=False), [],
                   settings.mode, FLOW_DEFAULT_STEPS if settings.mode == MODE_LIGHTNING else settings.steps, size)
        return widgets, back.missing_loras(settings, known)

    def restore(self, history: list[HistoryEntry], editor: Any = None, request: gr.Request = None,
                evt: gr.EventData = None):
        """A history click: the entry's settings, image, mask and references back, the entry in the slider."""
        entry = _picked(history, evt, "history")
        files = back.files_of({"image": entry.input, "mask": entry.mask_source, "references": list(entry.references)},
                              self.h.config.resolved_outputs_dir)
        widgets, missing = self._restore_all(entry.settings, files, editor, request)
        return (*widgets, *self._show(entry),
                f"Restored from the history: {entry.settings.summary()}." + (f" {missing}." if missing else ""))

    def load_png(self, path: str | None, editor: Any, history: list[HistoryEntry] | None = None,
                 request: gr.Request = None):
        """A PNG dropped on "Settings from a PNG": its settings (and, for a result of this tab, its image, mask and
        references) back in the widgets."""
        if not path:
            return (*(gr.skip(),) * (len(hist.RESTORED) + 10), *(gr.skip(),) * 6, gr.skip())
        given = self.h.given(getattr(request, "session_hash", None))  # (None: an in-process caller)
        try:
            settings, files = back.from_png(path, self.h.config.resolved_outputs_dir,
                                            None if given is None else back.tab_files(history, given))
        except Exception as exc:  # noqa: BLE001
            raise error_toast(exc) from None
        extra = " with its image, mask and reference images" if files.get("image") else ""
        widgets, missing = self._restore_all(settings, files, editor, request)
        notes = [*(["its image is not one of this tab's results, so the settings alone"] if files["withheld"] else []),
                 *([missing] if missing else [])]
        return (*widgets, *(gr.skip(),) * 6, f"Settings restored from {Path(str(path)).name}{extra}: "
                f"{settings.summary()}." + "".join(f" {n[0].upper()}{n[1:]}." for n in notes))

    def show_variation(self, batch: list[HistoryEntry], evt: gr.EventData = None):
        return self._show(_picked(batch, evt, "variations"))

    def edit_result(self, entry: HistoryEntry | None, editor: Any, request: gr.Request):
        if entry is None:
            raise gr.Error("generate an image first", duration=5, print_exception=False)
        given = self.h.give(getattr(request, "session_hash", None), entry.image)
        size = image_brush(entry.image)
        return (gr.update(value=hist.editor_value(entry.image), brush=brush(size)), masks.loaded_record(given, editor),
                self._unlocked(request),
                f"Editing the result of seed {entry.settings.seed}: paint, describe the next edit, Generate.", None,
                size)


def _picked(entries: list[HistoryEntry] | None, evt: Any, where: str) -> HistoryEntry:
    """The entry a gallery click selected; a message (not a traceback) for a call without a click on an entry.

    ``evt`` is gradio's plain ``EventData`` (its ``SelectData`` fails inside gradio, before any callback, on an
    API call sent without the event's data): the index is read from what the event was sent with, if anything."""
    if isinstance(evt, gr.EventData):
        index = evt._data.get("index") if isinstance(evt._data, dict) else None
    else:
        index = getattr(evt, "index", None)
    if isinstance(index, (list, tuple)):
        index = index[0] if index else None
    if not entries or not isinstance(index, int) or not 0 <= index < len(entries):
        raise gr.Error(f"click an entry of the {where} first (nothing is there to show yet)" if not entries else
                       f"click an entry of the {where}", duration=5, print_exception=False)
    return entries[index]
