"""The UI's event callbacks: widget values in, widget updates out, all decisions delegated to the handlers.

Kept apart from the layout (``ui/app.py``) so each stays small; each method here maps
one event's inputs to :class:`~diffsynth_qie.ui.handlers.UIHandlers` calls and turns
its errors into ``gr.Error`` toasts.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import gradio as gr

from . import history as hist
from . import live
from . import masks
from .examples import Example, examples_file, load_examples
from .handlers import GenerateInputs, Stopped, UIHandlers, user_message
from .lora_events import LoraEvents
from .mask_events import brush, image_brush
from .messages import error_toast, toast_html
from .restore_events import RestoreEvents
from .runner import queued_note
from .settings import INPUT_NAMES, shown_for_mode, steps_for_mode

STOPPING = "Stopping at the next step (the finished variations are kept)…"

log = logging.getLogger(__name__)


class Callbacks(LoraEvents, RestoreEvents):
    """One UI's callbacks over its :class:`UIHandlers` (the LoRA picker's: ``ui/lora_events.py``; bringing a result
    back: ``ui/restore_events.py``)."""

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
            raise error_toast(exc) from None
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
            raise error_toast(exc) from None
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

