"""Logging setup shared by every entry point.

Only rank 0 logs at INFO; other ranks log warnings and errors only, so multi-GPU
runs don't print every progress line N times.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings
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
    quiet_libraries(verbose=level <= logging.DEBUG)
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


# --- lines other libraries write into every run, that say nothing to our users ------------------
# transformers >= 5 warns about the RoPE keys of every Qwen2.5-VL config written for transformers 4 (DiffSynth's
# text encoder config, real and tiny); the config loads correctly.
_ROPE_CONFIG_KEYS = "got `key=rope_scaling` in kwargs but hasn't set it as attribute"
_ROPE_PARAMETERS = "Unrecognized keys in `rope_parameters`"
# logger name -> (the highest level dropped, the messages dropped: None for all at that level or below).
# They are dropped before any handler sees them (the libraries' own handlers too), unless DEBUG logging is on.
LIBRARY_NOISE: dict[str, tuple[int, tuple[str, ...] | None]] = {
    # DeepSpeed's accelerator detection, once per process that imports it: a CPU run is what the user started.
    "DeepSpeed": (logging.WARNING, ("Setting accelerator to CPU",)),
    # accelerate's save_state/load_state, a line per file of every checkpoint; our loop logs the checkpoint.
    "accelerate.checkpointing": (logging.INFO, None),
    "transformers.configuration_utils": (logging.WARNING, (_ROPE_CONFIG_KEYS,)),
    "transformers.modeling_rope_utils": (logging.WARNING, (_ROPE_PARAMETERS,)),
}
# Python warnings from library code calling library code: (category, start of the message).
LIBRARY_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # DiffSynth's text encoder passes `past_key_values` (None) to transformers' Qwen2.5-VL, which renamed it.
    (FutureWarning, "`past_key_values` is deprecated"),
)


class _DropBelowDebug(logging.Filter):
    """Drops a library's routine records (``LIBRARY_NOISE``) while the root logger is not at DEBUG."""

    def __init__(self, max_level: int, messages: tuple[str, ...] | None) -> None:
        super().__init__()
        self.max_level, self.messages = max_level, messages

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > self.max_level or logging.getLogger().isEnabledFor(logging.DEBUG):
            return True
        return self.messages is not None and not any(m in record.getMessage() for m in self.messages)


def quiet_libraries(verbose: bool) -> None:
    """Keep ``LIBRARY_NOISE`` and ``LIBRARY_WARNINGS`` out of the log, or, ``verbose``, let them through.

    Idempotent and reversible (a later call with the other ``verbose`` wins). The logger filters go on the
    loggers by name, so they hold also for a library imported later (DeepSpeed's logger keeps filters it
    finds when it sets itself up)."""
    for name, (max_level, messages) in LIBRARY_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropBelowDebug) for f in logger.filters):
            logger.addFilter(_DropBelowDebug(max_level, messages))
    for category, message in LIBRARY_WARNINGS:  # re-adding a filter moves it to the front: the last call wins
        warnings.filterwarnings("default" if verbose else "ignore", message=re.escape(message), category=category)


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


# Also when our logging is not set up (a library call from a notebook), these go to our DEBUG log from the first one.
_KNOWN_HARMLESS = (_ROPE_CONFIG_KEYS, _ROPE_PARAMETERS)


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
