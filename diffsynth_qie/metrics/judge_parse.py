"""Where a judge's reply puts its score, read from there and nowhere else.

A reply is read after its reasoning blocks (``<think>…</think>``) are dropped, in this order:

1. the **JSON object**: the last ``{…}`` in the reply that parses as JSON and has a ``score`` key
   (any case): a number, or a list of numbers;
2. the **last score field**: ``Score: 8``, ``**Score:** 8/10``, ``"score": [9, 8]``, ``score = 7 out of 10``,
   the last one in the reply (a reasoning reply states its verdict last);
3. a reply that is **nothing but a number** (``7``, ``7.5``, ``8/10``).

Anything else gives no score: the first number of a reply is never taken (``Step 1 of 2: … {"score": [9, 8]}``
is not 1, ``In image 2 the circle became blue. Score: 8/10`` is not 2). :func:`find_score` returns the numbers
and the scale the reply stated (``8/10``: 10), or the reason it found none; the formats (``judge_formats.py``)
decide which numbers and scales they accept.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

_THINK = re.compile(r"<think>.*?</think>", re.S | re.I)
_NUMBER = r"-?\d+(?:\.\d+)?"
_FIELD = re.compile(
    r"""(?<![A-Za-z_])score ["'*]* \s* [:=] \s* [*"']* \s*
        (?P<value> \[ [^\]\[]* \] | -?\d+(?:\.\d+)? )
        (?: \s* (?: / | out \s+ of ) \s* (?P<top> \d+(?:\.\d+)? ) )?""", re.I | re.X)
_BARE = re.compile(rf"^\s*(?P<value>{_NUMBER})\s*(?:(?:/|out\s+of)\s*(?P<top>\d+(?:\.\d+)?))?\s*\.?\s*$", re.I)
_SMART_QUOTES = str.maketrans({"“": '"', "”": '"', "‘": "'", "’": "'"})


@dataclass(frozen=True)
class Found:
    """Numbers a reply gave as its score, the scale it stated (``/ 10``, ``out of 25``; None: none stated) and
    where they came from (``json``, ``field``, ``bare``)."""

    values: tuple[float, ...]
    top: Optional[float]
    where: str


def answer_part(text: str) -> str:
    """The reply without its reasoning: ``<think>…</think>`` blocks dropped; an unclosed ``<think>`` (a reply cut
    while it reasoned) drops everything after it."""
    text = _THINK.sub(" ", text or "")
    opened = re.search(r"<think>", text, re.I)
    return text[:opened.start()] if opened else text


def last_json_object(text: str) -> Optional[dict]:
    """The last top-level ``{…}`` of ``text`` that parses as a JSON object (smart quotes read as plain ones)."""
    text = text.translate(_SMART_QUOTES)
    decoder, found, pos = json.JSONDecoder(), None, 0
    while (start := text.find("{", pos)) != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            pos = start + 1
            continue
        if isinstance(value, dict):
            found = value
        pos = end
    return found


def _numbers(value) -> Optional[tuple[float, ...]]:
    """A score value as numbers: a number, a numeric string, or a non-empty list of them; None otherwise."""
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if isinstance(item, bool):
            return None
        if isinstance(item, (int, float)):
            out.append(float(item))
        elif isinstance(item, str) and re.fullmatch(_NUMBER, item.strip()):
            out.append(float(item))
        else:
            return None
    return tuple(out) or None


def find_score(text: Optional[str]) -> tuple[Optional[Found], str]:
    """``(Found, "")`` where the reply states its score (the module docstring's order), else ``(None, why)``."""
    answer = answer_part(text or "")
    obj = last_json_object(answer)
    if obj is not None:
        key = next((k for k in obj if str(k).lower() == "score"), None)
        if key is not None:
            values = _numbers(obj[key])
            if values is None:
                return None, f"its JSON score is not a number or a list of numbers ({obj[key]!r})"
            return Found(values, None, "json"), ""
    fields = list(_FIELD.finditer(answer))
    if fields:
        last = fields[-1]
        raw = last["value"]
        values = _numbers(_json_or_none(raw)) if raw.startswith("[") else _numbers(raw)
        if values is None:
            return None, f"its last score field is not a number or a list of numbers ({last.group(0)!r})"
        return Found(values, float(last["top"]) if last["top"] else None, "field"), ""
    bare = _BARE.match(answer)
    if bare:
        return Found((float(bare["value"]),), float(bare["top"]) if bare["top"] else None, "bare"), ""
    if re.search(r"<think>", text or "", re.I):
        return None, "it was cut while still reasoning (no answer after <think>)"
    return None, "it has no JSON score, no 'Score:' field and is not a bare number"


def _json_or_none(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return None


def quote(text: Optional[str], limit: int = 160) -> str:
    """A reply as one short quoted line for the log: whitespace folded, the middle cut when long."""
    flat = " ".join((text or "").split())
    if len(flat) > limit:
        flat = flat[: limit // 2 - 2] + " … " + flat[-(limit // 2 - 2):]
    return repr(flat)
