"""A generation streamed to the browser: it runs on a worker thread while the event's generator reports its progress
and yields its live previews as they come (gradio sends each yield to the page at once).

Everything the page sees is said from the generator's own thread (gradio's progress tracker belongs to it); the
worker only puts what happened on a queue. Previews that arrive faster than the page takes them are skipped but
for the newest. When gradio closes the generator early (the tab went away), the run is told to stop.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Generator, TypeVar

from .runner import PreviewFn, ProgressFn

T = TypeVar("T")
_DONE = object()


def stream(work: Callable[[ProgressFn, PreviewFn], T], report: ProgressFn, frame: Callable[[Any, Any], Any],
           on_close: Callable[[], None], stopping: Callable[[], bool] = lambda: False,
           notice: Callable[[], Any] | None = None) -> Generator[Any, None, T]:
    """Run ``work(progress, preview)`` on a thread; yield ``frame(before, image)`` for each live preview, pass its
    progress on to ``report``, and return what ``work`` returns (``result = yield from stream(...)``), or raise
    what it raised. ``on_close`` runs when the generator is closed while ``work`` still runs. Once ``stopping()``,
    ``notice()`` is yielded once: the "stopping" word comes from this generator, so it can never arrive after the
    stopped run's own last word."""
    events: queue.Queue = queue.Queue()
    outcome: dict[str, Any] = {}
    closed = threading.Event()  # the generator was closed (the tab went away) while the work ran

    def run() -> None:
        try:
            outcome["value"] = work(lambda *p: events.put(("progress", p)), lambda *p: events.put(("preview", p)))
        except BaseException as exc:  # noqa: BLE001 - raised again on the generator's thread
            outcome["error"] = exc
            if closed.is_set():  # nobody raises it any more: say here how the run ended (a stop, or an error)
                from .handlers import user_message

                user_message(exc)
        finally:
            events.put(_DONE)

    worker = threading.Thread(target=run, name="qie-ui-generate", daemon=True)
    worker.start()
    try:
        done = announced = False
        while not done:
            try:
                batch = [events.get(timeout=0.1)]
            except queue.Empty:
                batch = []
            if notice is not None and not announced and stopping():
                announced = True
                yield notice()
            if not batch:
                continue
            while not events.empty():  # what piled up meanwhile: the newest progress and preview count
                batch.append(events.get_nowait())
            done = batch[-1] is _DONE
            latest = {kind: args for kind, args in (e for e in batch if e is not _DONE)}
            if "progress" in latest:
                report(*latest["progress"])
            if "preview" in latest and not done:
                yield frame(*latest["preview"])
    finally:
        if worker.is_alive():
            closed.set()
            on_close()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
