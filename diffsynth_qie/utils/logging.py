"""Logging setup shared by every entry point.

Only rank 0 logs at INFO; other ranks log warnings and errors only, so multi-GPU
runs don't print every progress line N times.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from typing import Iterator


def process_rank() -> int:
    """Global rank from the launcher's environment (accelerate/torchrun/deepspeed), 0 if unset."""
    for key in ("RANK", "LOCAL_RANK"):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                pass
    return 0


def is_main_process() -> bool:
    return process_rank() == 0


class _Handler(logging.StreamHandler):
    """A StreamHandler subclass: modelscope's get_logger raises every root handler whose
    type *is* StreamHandler to ERROR once torch.distributed is initialised, which
    silenced all our INFO logs under ``accelerate launch``. It writes to whatever
    ``sys.stderr`` is when a record arrives (not the one at setup), so redirected or
    captured stderr (tests, notebooks) gets the lines."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(level: str | int = "INFO") -> None:
    """Configure the root logger once (idempotent)."""
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    if not is_main_process():
        level = max(level, logging.WARNING)
    root = logging.getLogger()
    if getattr(root, "_qie_configured", False):
        root.setLevel(level)
        for handler in root.handlers:
            if isinstance(handler, _Handler):
                handler.setLevel(level)
        return
    handler = _Handler()
    # the handler's own level too: a library logger set lower (DEBUG while capturing a load) still propagates
    # its records here, and only --verbose should show them
    handler.setLevel(level)
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if process_rank():
        fmt = f"[rank{process_rank()}] " + fmt
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.handlers[:] = [handler]
    root.setLevel(level)
    root._qie_configured = True  # type: ignore[attr-defined]
    for noisy in ("httpx", "urllib3", "PIL", "matplotlib", "modelscope"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# --- other libraries' output -------------------------------------------------------
class _LineLogger(io.TextIOBase):
    """A text stream that logs each complete line (``print`` output) at ``level``."""

    def __init__(self, logger: logging.Logger, level: int):
        self._logger, self._level, self._pending = logger, level, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        for line in lines:
            if line.strip():
                self._logger.log(self._level, "%s", line.rstrip())
        return len(text)

    def flush(self) -> None:
        if self._pending.strip():
            self._logger.log(self._level, "%s", self._pending.rstrip())
        self._pending = ""


@contextlib.contextmanager
def prints_to_log(logger_name: str, level: int = logging.DEBUG) -> Iterator[None]:
    """Inside: what is printed to stdout is logged to ``logger_name`` at ``level`` instead.

    For libraries that ``print`` their progress (DiffSynth's loader prints a download
    box, each model's config as JSON and a line per optional model it did not find):
    the lines stay available with ``--verbose`` without burying our own output. The
    redirection is process-wide while it lasts, so wrap only the library call.
    """
    stream = _LineLogger(logging.getLogger(logger_name), level)
    try:
        with contextlib.redirect_stdout(stream):
            yield
    finally:
        stream.flush()


@contextlib.contextmanager
def library_logs_to_debug(*logger_names: str) -> Iterator[None]:
    """Inside: the named libraries' INFO/WARNING records are dropped unless DEBUG logging is on
    (errors still show)."""
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        yield
        return
    loggers = [logging.getLogger(n) for n in logger_names]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, saved):
            lg.setLevel(level)


# transformers >= 5 warns about the RoPE keys of every Qwen2.5-VL config written for transformers 4 (DiffSynth's
# text encoder config, real and tiny); the config loads correctly, so these go to DEBUG from the first one.
_KNOWN_HARMLESS = ("got `key=rope_scaling` in kwargs but hasn't set it as attribute",
                   "Unrecognized keys in `rope_parameters`")


class _OncePerMessage(logging.Filter):
    """Lets each distinct message through once and known-harmless ones never; the rest go to our DEBUG log."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self._seen or any(k in message for k in _KNOWN_HARMLESS):
            logging.getLogger("diffsynth_qie.library").debug("%s: %s", record.name, message)
            return False
        self._seen.add(message)
        return True


def library_warnings_once() -> None:
    """Show each distinct transformers warning once per process (idempotent; call it before loading
    models). Loading a Qwen2.5-VL text encoder warns about its RoPE config on every load."""
    import transformers.utils.logging as tlog

    for handler in tlog._get_library_root_logger().handlers:
        if not any(isinstance(f, _OncePerMessage) for f in handler.filters):
            handler.addFilter(_OncePerMessage())
