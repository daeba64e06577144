"""What the UI keeps per browser tab (a session): the files it gave that tab's editor, which are the only files
besides the examples that tab's Generate may read back, and that tab's Stop, which stops only its own
generation (the running one at its next denoising step, a queued one as it starts)."""
from __future__ import annotations

import contextlib
import threading


class TabSessions:
    """The per-tab state of the UI's handlers (``session``: gradio's session hash; None: an in-process caller)."""

    def __init__(self):
        self._stop = threading.Event()       # set by Stop; cleared when the next generation starts
        self._running: str | None = None     # the browser session whose generation runs
        self._stop_queued: set[str] = set()  # sessions whose generation was stopped before it ran
        self._stop_lock = threading.Lock()
        self._given: dict[str, set[str]] = {}  # browser session -> the files the UI put into its editor

    # files -----------------------------------------------------------------------------------------
    def give(self, session: str | None, path: str) -> str:
        """Record that the UI put ``path`` into ``session``'s editor (a result, a cleared image): the files a
        session's Generate may read back are the examples and what was given to it."""
        if session is not None:
            self._given.setdefault(session, set()).add(str(path))
        return str(path)

    def given(self, session: str | None) -> frozenset[str] | None:
        """The files given to ``session``'s editor (None for an in-process caller: the UI's folders)."""
        return None if session is None else frozenset(self._given.get(session, ()))

    def forget_session(self, session: str | None) -> None:
        """A tab that went away: drop what it was given (a reload starts a new session)."""
        self._given.pop(session, None)

    # Stop ------------------------------------------------------------------------------------------
    def request_stop(self, session: str | None = None) -> bool:
        """Stop ``session``'s generation: the running one at its next denoising step (True), a queued one as it
        starts (False). Another tab's generation is left alone; None stops whichever runs (API callers, tests)."""
        with self._stop_lock:
            if session is None or session == self._running:
                self._stop.set()
                return True
            self._stop_queued.add(session)
            return False

    def stopping(self, session: str | None) -> bool:
        """True while ``session``'s running generation has a Stop it has not reached yet."""
        with self._stop_lock:
            return self._stop.is_set() and self._running == session

    def forget_stop(self, session: str | None) -> None:
        """Drop a Stop that found nothing left to stop (the generation had ended): it must not stop the next one."""
        with self._stop_lock:
            self._stop_queued.discard(session)

    @contextlib.contextmanager
    def _running_as(self, session: str | None):
        """Around a generation of ``session``: its Stop (one pressed while it was queued included) reaches it."""
        with self._stop_lock:
            self._stop.clear()
            self._running = session
            if session is not None and session in self._stop_queued:  # stopped while it waited in the queue
                self._stop_queued.discard(session)
                self._stop.set()
        try:
            yield
        finally:
            self._running = None
