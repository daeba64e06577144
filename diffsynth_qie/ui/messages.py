"""Messages as a toast shows them: a toast renders its text as HTML, so the line breaks of a message (the missing
weights' file list, the download command) would run into one paragraph."""
from __future__ import annotations

import html

ITEM = "- "  # a line of a list (``"  - file"``), as the project's messages write them


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
