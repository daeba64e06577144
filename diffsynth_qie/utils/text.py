"""What counts as an empty prompt, in one place: the cache, training rows, ``qie edit`` and the UI ask here."""
from __future__ import annotations

import unicodedata


def visible_text(text: str | None) -> str:
    """``text`` without control and format characters (NUL, zero-width spaces, byte-order marks, direction
    marks: Unicode categories Cc and Cf, except tab and newline) and without surrounding whitespace."""
    if not text:
        return ""
    kept = "".join(ch for ch in text if ch in "\t\n" or unicodedata.category(ch) not in ("Cc", "Cf"))
    return kept.strip()


def is_empty_prompt(text: str | None) -> bool:
    """True when ``text`` says nothing: empty, whitespace, or only invisible characters."""
    return not visible_text(text)
