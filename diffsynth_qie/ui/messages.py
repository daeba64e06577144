"""What the browser is told: an error as one line (:func:`user_message`; unexpected ones log their traceback on the
server, never in the browser), and a message as a toast shows it (:func:`toast_html`: a toast renders its text as
HTML, so the line breaks of a message, the missing weights' file list, the download command, would run into one
paragraph)."""
from __future__ import annotations

import html
import logging

from .runner import Stopped

log = logging.getLogger(__name__)

ITEM = "- "  # a line of a list (``"  - file"``), as the project's messages write them


def user_message(exc: BaseException) -> str:
    """A one-line message for the browser; unexpected errors log their traceback here.

    ``ValueError`` is this project's "user error" (it names the bad value and the fix),
    so its text is shown as is, as are missing model files (the list and the download
    command). Anything else is a bug or an environment problem: the user gets its type
    and a pointer to the server log, never a stack trace.
    """
    from ..models.load.loading import MissingModelFiles

    if isinstance(exc, Stopped):  # (logged where it stopped: ui/runner.run_variations)
        return str(exc)
    if isinstance(exc, (ValueError, MissingModelFiles)):
        log.warning("refused: %s", exc)
        return str(exc)
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower():
        log.error("generation ran out of memory", exc_info=exc)
        return ("out of memory: try a smaller image, fewer reference images or steps, "
                "or free memory on the device")
    log.error("generation failed", exc_info=exc)
    return f"internal error ({type(exc).__name__}); the details are in the server log"


def toast_html(message: str) -> str:
    """``message`` for a toast: escaped, its ``- `` lines a bulleted list, its other lines on lines of their own."""
    parts: list[str] = []
    items: list[str] = []

    def close() -> None:
        if items:
            parts.append("<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>")
            items.clear()

    for line in str(message).splitlines():
        text = line.strip()
        if text.startswith(ITEM):
            items.append(html.escape(text[len(ITEM):]))
            continue
        close()
        if text:
            parts.append(html.escape(text) + "<br>")
    close()
    out = "".join(parts)
    return out[:-len("<br>")] if out.endswith("<br>") else out


def error_toast(exc: BaseException):
    """``exc`` as gradio's error toast: :func:`user_message`'s line, never a traceback in the browser."""
    import gradio as gr

    return gr.Error(toast_html(user_message(exc)), duration=None, print_exception=False)
