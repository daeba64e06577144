"""The UI's event callbacks: widget values in, widget updates out, all decisions delegated to the handlers.

Kept apart from the layout (``ui/app.py``) so each stays small; each method here maps
one event's inputs to :class:`~diffsynth_qie.ui.handlers.UIHandlers` calls and turns
its errors into ``gr.Error`` toasts.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import gradio as gr

from . import history as hist
from . import live
from . import masks
from . import restore as back
from .examples import Example, examples_file, load_examples
from .handlers import MODE_LBM, MODE_LIGHTNING, NO_LORA, GenerateInputs, Stopped, UIHandlers, user_message
from .history import HistoryEntry
from .lora_events import LoraEvents
from .messages import toast_html
from .runner import queued_note
from .settings import INPUT_NAMES

STOPPING = "Stopping at the next step (the finished variations are kept)…"

log = logging.getLogger(__name__)

LIGHTNING_DEFAULT_STEPS = 8
FLOW_DEFAULT_STEPS = 40


def steps_for_mode(new: str, prev: str, steps: float, saved: float | None) -> tuple[float, float | None]:
    """(steps to show, steps to remember) when the sampler changes from ``prev`` to ``new``.

    Entering Lightning remembers the user's steps and shows 8; leaving it gives them back
    (never leaves a flow-matching run silently at Lightning's 8).
    """
    if new == MODE_LIGHTNING and prev != MODE_LIGHTNING:
        return LIGHTNING_DEFAULT_STEPS, steps
    if prev == MODE_LIGHTNING and new != MODE_LIGHTNING:
        return saved or FLOW_DEFAULT_STEPS, saved
    return steps, saved


def shown_for_mode(mode: str) -> dict[str, bool]:
    """Which sampler widgets ``mode`` shows: LBM has its own steps and no CFG; Lightning runs 4/8 steps at CFG 1;
    the negative prompt only where CFG applies (it has no effect at CFG 1)."""
    lbm, few = mode == MODE_LBM, mode == MODE_LIGHTNING
    return {"steps": not lbm, "cfg": not (lbm or few), "lbm_steps": lbm, "negative_prompt": not (lbm or few)}


def _error(exc: BaseException) -> gr.Error:
    return gr.Error(toast_html(user_message(exc)), duration=None, print_exception=False)


class Callbacks(LoraEvents):
    """One UI's callbacks over its :class:`UIHandlers` (the LoRA picker's: ``ui/lora_events.py``)."""

    def __init__(self, handlers: UIHandlers):
        self.h = handlers
        self._pending: set[str] = set()   # browser sessions with a generation queued or running
        self._pending_lock = threading.Lock()
        self._examples: list[Example] = []
        self._names: dict[Any, str] = {}  # component -> its setting's (or state's) name (see bind)

    @property
    def folder(self):
        return self.h.config.resolved_temp_dir / "editor"

    # startup -----------------------------------------------------------------------------
    def examples(self) -> list[Example]:
        c = self.h.config
        try:
            path = examples_file(c.examples, c.lora_dir, c.model, c.resolved_temp_dir)
            self._examples = load_examples(path) if path is not None else []
        except (ValueError, OSError) as exc:  # a broken examples file must not keep the UI from starting
            log.warning("no examples: %s", exc)
            self._examples = []
        self.h.known_images = frozenset(ex.image for ex in self._examples)
        return self._examples

    def poll_model_status(self):
        return self.h.model_status(), gr.Timer(active=self.h.loading)

    # sampler, LoRA, mask tools ----------------------------------------------------------------
    def switch_mode(self, selected: str, prev: str, steps: float, saved: float | None):
        """Show the widgets of ``selected`` (:func:`shown_for_mode`; LBM's sub-stream output with LBM)."""
        shown = shown_for_mode(selected)
        shown_steps, saved = steps_for_mode(selected, prev, steps, saved)
        return (gr.update(visible=shown["steps"], value=shown_steps), gr.update(visible=shown["cfg"]),
                gr.update(visible=shown["lbm_steps"]), gr.update(visible=shown["lbm_steps"]), selected, saved,
                gr.update(visible=shown["negative_prompt"]))

    # The editor loads an image the UI gives it (an example, "Edit this result", "Clear paint") into its canvas
    # asynchronously, with no event saying when, and until then sends what it held before. ``loaded`` (a hidden
    # textbox) records the image given and a digest of what it replaced, so Generate can tell
    # (``job.editor_image``). Generate is locked from the click until the record is in.
    @staticmethod
    def lock_generate():
        return gr.update(interactive=False)

    def example_loaded(self, clicked: Any, editor: Any, request: gr.Request):
        """The clicked example's image (the dataset gives ``(index, values)``) as ``loaded``; Generate unlocked."""
        index = clicked[0] if isinstance(clicked, (list, tuple)) and clicked else None
        if not (isinstance(index, int) and 0 <= index < len(self._examples)):
            return gr.update(), self._unlocked(request), gr.update(), gr.update(), gr.update()
        example = self._examples[index]
        size = image_brush(example.image)
        return (masks.loaded_record(example.image, editor), self._unlocked(request),
                f"Example {index + 1} loaded: press Generate.", gr.update(brush=brush(size)), size)

    def _unlocked(self, request: gr.Request | None):
        """Generate clickable again, unless this tab has a generation queued or running."""
        with self._pending_lock:
            busy = getattr(request, "session_hash", None) in self._pending
        return gr.update() if busy else gr.update(interactive=True)

    def new_image(self, value: Any):
        """An uploaded image: a brush about 6 % of its longer side (25 px is a blob on a small image); the editor's
        brush and the brush-size slider."""
        try:
            size = masks.brush_size(masks.image_from_editor(value).size)
        except Exception:  # noqa: BLE001 - no image yet: keep the brush
            return gr.update(), gr.update()
        return gr.update(brush=brush(size)), size

    @staticmethod
    def set_brush(size: float):
        """The brush-size slider (or ``[`` / ``]``) moved: the editor's brush follows."""
        return gr.update(brush=brush(int(size)))

    def clear_mask(self, value: Any, request: gr.Request):
        try:
            cleared = masks.clear(value, self.folder)
        except Exception as exc:  # noqa: BLE001
            raise _error(exc) from None
        given = self.h.give(getattr(request, "session_hash", None), cleared["background"])
        return (cleared, masks.loaded_record(given, value), self._unlocked(request),
                "Paint cleared (the image stays).")

    # Generate's inputs ------------------------------------------------------------------------
    def bind(self, widgets: dict[str, Any], **states: Any) -> set:
        """The inputs of an event whose callback takes ``widgets`` (setting name -> component, every setting of
        ``ui/settings.py``) and ``states`` as one dict: gradio passes {component: value}, :meth:`named` names them."""
        missing = [name for name in INPUT_NAMES if name not in widgets]
        if missing:
            raise RuntimeError(f"the layout has no widget for the settings {missing}")
        named = {**widgets, **states}
        self._names.update({component: name for name, component in named.items()})
        return set(named.values())

    def named(self, values: dict) -> dict[str, Any]:
        """{name: value} of gradio's {component: value} for an event's inputs made by :meth:`bind`."""
        return {self._names[component]: value for component, value in values.items()}

    def inputs(self, values: dict) -> GenerateInputs:
        named = self.named(values)
        return GenerateInputs(**{name: named[name] for name in INPUT_NAMES})

    def precheck(self, values: dict, request: gr.Request):
        """Before queueing: refuse bad input with a toast (the last result stays), then lock Generate.

        One generation per browser tab: a second click while one is queued or running (a double
        click arrives before the button is disabled) is refused instead of queueing a duplicate.
        """
        try:
            self.h.check(self.inputs(values), getattr(request, "session_hash", None))
        except Exception as exc:  # noqa: BLE001
            raise _error(exc) from None
        session = getattr(request, "session_hash", None)
        with self._pending_lock:
            if session in self._pending:
                raise gr.Error("this tab already has a generation queued or running; wait for it, or press Stop",
                               duration=4, print_exception=False)
            ahead = len(self._pending)
            self._pending.add(session)
        note = queued_note(ahead, self.h.queue_eta(ahead))
        return gr.update(interactive=False), time.time(), note if note else gr.skip()

    def run(self, values: dict, request: gr.Request, progress=gr.Progress()):
        """Generate (``values``: the settings' widgets, ``history`` and ``queued_at``, as :meth:`bind` made them): a
        generator, so the live previews reach the result slider while it runs (``ui/live.py``); the last yield is
        the result, or on a failure or Stop a status that leaves everything on screen as it was."""
        named, session = self.named(values), getattr(request, "session_hash", None)
        previewed = []

        def frame(before, image):
            previewed.append(True)
            return (gr.update(value=(before, image)), *(gr.skip(),) * 11)

        try:
            inputs = self.inputs(values)
            out = yield from live.stream(
                lambda report, preview: self.h.generate(inputs, report, queued_at=named["queued_at"], session=session,
                                                        preview=preview),
                lambda done, total, desc: progress((done, total), desc=desc), frame,
                lambda: self.h.request_stop(session), lambda: self.h.stopping(session),
                lambda: (*(gr.skip(),) * 6, STOPPING, *(gr.skip(),) * 5))
        except Exception as exc:  # noqa: BLE001 - the last result back in place of a preview, and a status
            # a Stop is what the user asked for: no toast; a failure: a toast. `finished` unlocks Generate.
            message = user_message(exc)  # logs the traceback of an unexpected error
            if not isinstance(exc, Stopped):
                gr.Warning(toast_html(message), duration=None, title="Generate failed")
            entry = named.get("current")
            kept = gr.skip() if not previewed else gr.update(value=(entry.before, entry.image) if entry else None)
            yield (kept, *(gr.skip(),) * 5, f"{message}." if isinstance(exc, Stopped) else
                   f"Failed: {message} (the last result is kept; fix it and press Generate).",
                   self.h.model_status(), *(gr.skip(),) * 4)
            return
        history = hist.add(named["history"], out.entries)
        many = len(out.entries) > 1
        yield (*self._show(out.entries[0]), out.status, self.h.model_status(),
               gr.update(value=[e.image for e in out.entries] if many else None, visible=many),
               history, hist.gallery(history), out.entries)

    def _release(self, request: gr.Request | None) -> None:
        with self._pending_lock:
            self._pending.discard(getattr(request, "session_hash", None))

    def finished(self, request: gr.Request):
        self._release(request)
        self.h.forget_stop(getattr(request, "session_hash", None))
        return gr.update(interactive=True), self.h.model_status()

    def disconnect(self, request: gr.Request):
        """A tab closed or reloaded: its queued or running generation stops (others must not wait for it)."""
        session = getattr(request, "session_hash", None)
        with self._pending_lock:
            pending = session in self._pending
        if pending:
            log.info("a browser tab went away: stopping its generation")
            self.h.request_stop(session)
        self.h.forget_session(session)

    def saved_history(self):
        """The history rebuilt from the outputs folder (on page load: it survives reloads and restarts)."""
        history = hist.load_saved(self.h.config.resolved_outputs_dir)
        return history, hist.gallery(history)

    def stop(self, request: gr.Request):
        """Stop this tab's generation (queued or running), saying so at once in the status; the run then reports
        where it stopped, and Generate unlocks."""
        session = getattr(request, "session_hash", None)
        with self._pending_lock:
            pending = session in self._pending
        log.info("Stop pressed (%s)", "stopping this tab's generation" if pending else "nothing of this tab to stop")
        if not pending:
            return gr.skip()
        if self.h.request_stop(session):  # the running generation says so itself (ui/live.py: in order)
            return gr.skip()
        return ("Stopped while waiting in the queue: it will not run. Generate unlocks when another tab's "
                "generation ahead of it ends.")

    # results and history --------------------------------------------------------------------
    @staticmethod
    def _show(entry: HistoryEntry):
        """The slider, sub-stream, downloads, command, "Edit this result" and current entry of ``entry``."""
        files = [f for f in (entry.image, entry.sub_image, entry.input, entry.mask, *entry.references) if f]
        return ((entry.before, entry.image), gr.update(value=entry.sub_image, visible=entry.sub_image is not None),
                files, entry.command, gr.update(interactive=True), entry)

    def _restore_all(self, settings, files: dict, editor: Any, request: gr.Request | None) -> tuple:
        """The restored settings' widgets, then editor, loaded record, mask file, references, variations (1), the
        variations grid (hidden) and the batch, then the sampler state (prev_mode, saved_steps), then the brush size."""
        image = files.get("image")
        values = back.widget_values(settings, self.h.lora_choices())
        values.update({name: gr.update(visible=visible, value=values.get(name))
                       for name, visible in shown_for_mode(settings.mode).items()})
        size = gr.skip()
        if image is not None:
            given, size = self.h.give(getattr(request, "session_hash", None), image), image_brush(image)
            inputs = (gr.update(value=hist.editor_value(image), brush=brush(size)), masks.loaded_record(given, editor),
                      files.get("mask"), files.get("references") or None)
        else:
            inputs = (gr.skip(),) * 4
        return (*(values[name] for name in hist.RESTORED), *inputs, 1, gr.update(value=None, visible=False), [],
                settings.mode, FLOW_DEFAULT_STEPS if settings.mode == MODE_LIGHTNING else settings.steps, size)

    def restore(self, history: list[HistoryEntry], editor: Any = None, request: gr.Request = None,
                evt: gr.SelectData = None):
        """A history click: the entry's settings, image, mask and references back, the entry in the slider."""
        entry = _picked(history, evt, "history")
        files = back.files_of({"image": entry.input, "mask": entry.mask_source, "references": list(entry.references)},
                              self.h.config.resolved_outputs_dir)
        return (*self._restore_all(entry.settings, files, editor, request), *self._show(entry),
                f"Restored from the history: {entry.settings.summary()}.")

    def load_png(self, path: str | None, editor: Any, request: gr.Request):
        """A PNG dropped on "Settings from a PNG": its settings (and, for a result of this UI, its image, mask and
        references) back in the widgets."""
        if not path:
            return (*(gr.skip(),) * (len(hist.RESTORED) + 10), *(gr.skip(),) * 6, gr.skip())
        try:
            settings, files = back.from_png(path, self.h.config.resolved_outputs_dir)
        except Exception as exc:  # noqa: BLE001
            raise _error(exc) from None
        extra = " with its image, mask and reference images" if files.get("image") else ""
        return (*self._restore_all(settings, files, editor, request), *(gr.skip(),) * 6,
                f"Settings restored from {Path(str(path)).name}{extra}: {settings.summary()}.")

    def show_variation(self, batch: list[HistoryEntry], evt: gr.SelectData = None):
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


def brush(size: int) -> gr.Brush:
    """The editor's one brush (magenta at 60 %: the image stays visible under the paint), ``size`` px across."""
    return gr.Brush(colors=[masks.BRUSH_COLOR], color_mode="fixed", default_size=int(size))


def image_brush(path: str) -> int:
    """The brush size for the image file ``path`` (read from its header), whatever loaded it."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return masks.brush_size(im.size)
    except (OSError, ValueError):
        return masks.DEFAULT_BRUSH


def _picked(entries: list[HistoryEntry] | None, evt: Any, where: str) -> HistoryEntry:
    """The entry a gallery click selected; a message (not a traceback) for a call without a click on an entry."""
    index = getattr(evt, "index", None)
    if isinstance(index, (list, tuple)):
        index = index[0] if index else None
    if not entries or not isinstance(index, int) or not 0 <= index < len(entries):
        raise gr.Error(f"click an entry of the {where} first (nothing is there to show yet)" if not entries else
                       f"click an entry of the {where}", duration=5, print_exception=False)
    return entries[index]
