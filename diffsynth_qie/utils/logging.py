"""Logging setup shared by every entry point.

Only rank 0 logs at INFO; other ranks log warnings and errors only, so multi-GPU
runs don't print every progress line N times.
"""
from __future__ import annotations

import logging
import os


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
    silenced all our INFO logs under ``accelerate launch``."""


def setup_logging(level: str | int = "INFO") -> None:
    """Configure the root logger once (idempotent)."""
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    if not is_main_process():
        level = max(level, logging.WARNING)
    root = logging.getLogger()
    if getattr(root, "_qie_configured", False):
        root.setLevel(level)
        return
    handler = _Handler()
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if process_rank():
        fmt = f"[rank{process_rank()}] " + fmt
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.handlers[:] = [handler]
    root.setLevel(level)
    root._qie_configured = True  # type: ignore[attr-defined]
    for noisy in ("httpx", "urllib3", "PIL", "matplotlib", "modelscope"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
