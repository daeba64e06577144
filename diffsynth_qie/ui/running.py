"""``python app_gradio.py`` started in its own process and waited for, as a user starts it: the one way the browser
test, ``benchmarks/ui_first_result.py`` and ``scripts/ui_screenshots.py`` run the UI.

:func:`running_app` starts it on a free port (or the one given) from the checkout's ``app_gradio.py``, its output
in a log file, and stops it on exit (terminate, then kill). :meth:`RunningApp.wait` polls until the page answers
(and, optionally, until a line shows in the log: the model's load), and raises :class:`AppNotServing` with the
log's end when the app exits or does not answer in time.

Only the standard library: importing it starts nothing heavy.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

APP = Path(__file__).resolve().parents[2] / "app_gradio.py"
POLL_S = 0.05
LOG_TAIL = 3000


class AppNotServing(RuntimeError):
    """The app exited, or did not answer (or log the awaited line) in time; the message ends with its log."""


def free_port() -> int:
    """A local port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningApp:
    """A started app: its page's ``url``, its process and log, and when it started (``time.perf_counter``)."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    started: float

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _fail(self, why: str) -> AppNotServing:
        return AppNotServing(f"app_gradio.py {why}:\n{self.log_text()[-LOG_TAIL:]}")

    def wait(self, timeout: float = 120.0, log_line: Optional[str] = None) -> tuple[float, Optional[float]]:
        """Until the page answers (HTTP 200) and, with ``log_line`` (a regular expression), the log shows it:
        ``(seconds to the page, seconds to the line or None)``, both from the start."""
        pattern = re.compile(log_line) if log_line else None
        page = line = None
        deadline = self.started + timeout
        while page is None or (pattern is not None and line is None):
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode}")
            if time.perf_counter() > deadline:
                waited = "answer at " + self.url if page is None else f"log {log_line!r}"
                raise self._fail(f"did not {waited} within {timeout:.0f} s")
            if page is None:
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(self.url, timeout=2) as r:
                        if r.status == 200:
                            page = time.perf_counter() - self.started
            if pattern is not None and line is None and pattern.search(self.log_text()):
                line = time.perf_counter() - self.started
            time.sleep(POLL_S)
        return page, line


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Terminate the process; kill it if it has not ended within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running_app(flags: Sequence[str], log_path: Path, port: Optional[int] = None, env: Optional[dict] = None,
                wait: bool = True, timeout: float = 120.0, python: str = sys.executable) -> Iterator[RunningApp]:
    """``python app_gradio.py --port PORT FLAGS...`` running while the block runs (waited for unless ``wait`` is
    False: call :meth:`RunningApp.wait` then). ``env`` adds to this process's environment (unbuffered output, no
    Gradio analytics); ``python`` is the interpreter that runs it (this one by default)."""
    port = port or free_port()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})}
    started = time.perf_counter()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([python, str(APP), "--port", str(port), *map(str, flags)], cwd=APP.parent,
                                env=full_env, stdout=out, stderr=subprocess.STDOUT)
    app = RunningApp(f"http://127.0.0.1:{port}/", proc, Path(log_path), started)
    try:
        if wait:
            app.wait(timeout)
        yield app
    finally:
        stop(proc)
