"""One chat request to an OpenAI-compatible endpoint, bounded in time, retried where a retry can help.

- :func:`post` sends one request and reads the answer under one deadline (``timeout`` seconds from connect to
  the last byte: a server that accepts and never answers, or answers a byte a minute, ends there).
- :func:`chat` is :func:`post` with retries: a timeout, a dropped or refused connection, 408, 429 and 5xx are
  tried again after ``backoff · 2^k`` seconds (the server's ``Retry-After`` when it gives one, at most
  :data:`MAX_WAIT`); other statuses and answers that are no chat completion are final.

It returns an :class:`Answer`: the reply's text, or the reason there is none. Nothing here raises for what a
server does.
"""
from __future__ import annotations

import http.client
import json
import logging
import socket
import time
import urllib.parse
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

MAX_WAIT = 60.0          # the longest wait between tries, whatever Retry-After says
MAX_BODY = 16 << 20      # an answer longer than this is no chat completion
RETRIED = {408, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class Answer:
    """A chat reply's ``text`` (None when there is none) and why not; ``answered``: the server gave a chat
    completion (it is alive, whatever the text says); ``cut``: the reply stopped at ``max_tokens``."""

    text: Optional[str] = None
    why: str = ""
    answered: bool = False
    cut: bool = False


class _Retry(Exception):
    def __init__(self, why: str, wait: Optional[float] = None):
        super().__init__(why)
        self.why, self.wait = why, wait


def post(url: str, body: bytes, headers: dict, timeout: float) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one POST, all of it within ``timeout`` seconds (``TimeoutError`` past it)."""
    parts = urllib.parse.urlsplit(url)
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no complete answer within {timeout:g} s")
        return remaining

    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.connect()
        sock = conn.sock
        sock.settimeout(left())
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("POST", path, body, headers)
        sock.settimeout(left())
        response = conn.getresponse()
        chunks, size = [], 0
        while not response.isclosed():  # (a response read to its end closes the socket)
            sock.settimeout(left())
            chunk = response.read(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_BODY:
                raise ValueError(f"the answer is longer than {MAX_BODY >> 20} MiB")
        return response.status, dict(response.getheaders()), b"".join(chunks)
    except socket.timeout as e:  # (an alias of TimeoutError on Python >= 3.10)
        raise TimeoutError(f"no complete answer within {timeout:g} s") from e
    finally:
        conn.close()


def _retry_after(headers: dict) -> Optional[float]:
    value = {k.lower(): v for k, v in headers.items()}.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _read_completion(status: int, headers: dict, raw: bytes) -> Answer:
    """The answer one HTTP exchange gave (``_Retry`` for a status worth another try)."""
    if status in RETRIED:
        raise _Retry(f"HTTP {status}", _retry_after(headers))
    text = raw.decode("utf-8", "replace")
    if status != 200:
        return Answer(why=f"HTTP {status} ({' '.join(text.split())[:120]!r})")
    try:
        choice = json.loads(text)["choices"][0]
        content = choice["message"].get("content")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return Answer(why=f"the answer is no chat completion ({' '.join(text.split())[:120]!r})")
    cut = choice.get("finish_reason") == "length"
    if not isinstance(content, str) or not content.strip():
        return Answer(why="the reply has no text" + (" (cut at max_tokens)" if cut else ""), answered=True, cut=cut)
    return Answer(text=content, answered=True, cut=cut)


def chat(url: str, payload: dict, headers: dict, timeout: float, retries: int, backoff: float = 1.0) -> Answer:
    """One chat completion with up to ``retries`` more tries (the module docstring)."""
    body = json.dumps(payload).encode()
    tries = retries + 1
    for attempt in range(tries):
        try:
            return _read_completion(*post(url, body, {"Content-Type": "application/json", **headers}, timeout))
        except _Retry as e:
            why, wait = e.why, e.wait
        except (TimeoutError, ConnectionError, http.client.HTTPException, OSError) as e:
            why, wait = (str(e) if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"), None
        except ValueError as e:  # an answer too long
            return Answer(why=str(e))
        if attempt + 1 == tries:
            return Answer(why=f"{why} (after {tries} tr{'y' if tries == 1 else 'ies'})")
        wait = min(MAX_WAIT, backoff * 2 ** attempt if wait is None else wait)
        log.debug("judge: %s from %s; trying again in %.1f s (%d of %d)", why, url, wait, attempt + 2, tries)
        time.sleep(wait)
    raise AssertionError("unreachable")


def served_models(base_url: str, headers: dict, timeout: float) -> tuple[bool, Optional[list[str]]]:
    """(whether the endpoint answers at all, the model ids its ``GET /models`` lists or None when it lists none)
    within ``timeout`` seconds."""
    parts = urllib.parse.urlsplit(base_url.rstrip("/") + "/models")
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path, headers=headers)
        response = conn.getresponse()
        raw = response.read(MAX_BODY)
    except (OSError, http.client.HTTPException):
        return False, None
    finally:
        conn.close()
    if response.status != 200:
        return True, None
    try:
        return True, [str(m["id"]) for m in json.loads(raw)["data"]]
    except (ValueError, KeyError, TypeError):
        return True, None
