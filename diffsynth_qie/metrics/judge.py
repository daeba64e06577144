"""An optional judge of edits: ``(source, instruction, output) -> scores``, a score or none, never a wrong one.

One client serves ``qie eval-edits --judge``, ``qie train --val_judge`` and ``--reward judge`` alike:

- :class:`ScoringJudge`: a reply format (``judge_formats.py``: its prompts and where its replies put the score),
  at most ``judge_workers`` requests at once (:meth:`~ScoringJudge.submit`, :meth:`~ScoringJudge.assess_many`),
  and the dead-judge rule: after :data:`DEAD_AFTER` failed requests in a row the judge is *down*: with
  ``--judge_on_dead stop`` every later call raises :class:`JudgeDown` (one line: the run stops), with ``skip`` one
  line says so and every later row gets no score at once. Each row it could not score is kept with the reason
  (:meth:`~ScoringJudge.take_unscored`), so a run ends naming them.
- :class:`OpenAIJudge`: a judge behind any OpenAI-compatible ``/v1/chat/completions`` (a local vLLM serving
  EditScore, a VLM, ...): the images as PNG data URLs, each request bounded by ``--judge_timeout`` and retried
  (``judge_http.py``).
- :func:`load_editscore`: EditScore-7B (a PEFT LoRA on Qwen2.5-VL-7B-Instruct, Apache-2.0) read only from local
  directories, never downloaded; ``None`` with one logged line when they are not there.

A row without a score has no ``judge`` field (``score`` returns ``{}``); a reply in no known form is quoted in one
logged line.
"""
from __future__ import annotations

import base64
import io
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

from PIL import Image

from .judge_config import JudgeConfig
from .judge_parse import quote

log = logging.getLogger(__name__)

DEAD_AFTER = 3  # failed requests in a row (each after its retries) that make a judge down


class Judge(Protocol):
    def score(self, source: Image.Image, instruction: str, output: Image.Image) -> dict[str, float]: ...


class JudgeDown(ValueError):
    """A judge stopped answering and ``--judge_on_dead stop`` was chosen: the run stops with this one line;
    ``what``: the judge and why it is down, without the advice."""

    def __init__(self, message: str, what: str = ""):
        super().__init__(message)
        self.what = what or message


@dataclass(frozen=True)
class Verdict:
    """One edit's scores ({} when none) and why there are none."""

    scores: dict
    why: str = ""


class ScoringJudge:
    """The shared client (the module docstring); a subclass supplies :meth:`ask` (one request's reply)."""

    def __init__(self, fmt, config: Optional[JudgeConfig] = None, name: str = "judge"):
        self.format, self.config, self.name = fmt, config or JudgeConfig(), name
        self._lock = threading.Lock()
        self._failures, self._down, self._unscored = 0, "", []
        self._pool: Optional[ThreadPoolExecutor] = None

    # -- one request: the subclass's job
    def ask(self, text: str, images: list[Image.Image]):
        """``judge_http.Answer`` of one request (text, or why none; whether the judge answered at all)."""
        raise NotImplementedError

    # -- one edit
    def assess(self, source: Image.Image, instruction: str, output: Image.Image, label: str = "") -> Verdict:
        """The edit's :class:`Verdict`; a failure is recorded (and, by the dead-judge rule, may stop the run)."""
        if self._down:
            return self._unscore(label, f"the judge is down ({self._down})", logged=True)
        pictures = {"source": source, "output": output}
        replies = []
        for request in self.format.requests(instruction):
            answer = self.ask(request.text, [pictures[k] for k in request.images])
            self._count(answer.answered, answer.why)
            if answer.text is None or answer.cut:
                why = "the reply was cut at --judge_max_tokens" if answer.cut else answer.why
                return self._unscore(label, why, quoted=answer.text if answer.cut else None)
            replies.append(answer.text)
        reading = self.format.read(replies)
        if not reading.scores:
            return self._unscore(label, f"the reply gives no score: {reading.why}", quoted=replies[reading.bad or 0])
        return Verdict(reading.scores)

    def score(self, source: Image.Image, instruction: str, output: Image.Image, label: str = "") -> dict[str, float]:
        return self.assess(source, instruction, output, label).scores

    def prefer(self, source: Image.Image, instruction: str, a: Image.Image, b: Image.Image) -> Optional[float]:
        """P(``a`` is the better edit) from the two edits' scores: 1, 0, 0.5 on a tie; None without both."""
        sa, sb = (self.score(source, instruction, x).get("judge") for x in (a, b))
        if sa is None or sb is None:
            return None
        return 0.5 if sa == sb else float(sa > sb)

    # -- many edits, at most judge_workers at once
    def submit(self, source: Image.Image, instruction: str, output: Image.Image, label: str = "") -> "Future[Verdict]":
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.config.judge_workers, thread_name_prefix="judge")
        return self._pool.submit(self.assess, source, instruction, output, label)

    def assess_many(self, items) -> list[Verdict]:
        """Verdicts of ``(source, instruction, output, label)`` items, in order."""
        futures = [self.submit(*item) for item in items]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- bookkeeping
    def take_unscored(self) -> list[tuple[str, str]]:
        """``(label, why)`` of every row without a score since the last call."""
        with self._lock:
            out, self._unscored = self._unscored, []
        return out

    def _count(self, answered: bool, why: str) -> None:
        with self._lock:
            self._failures = 0 if answered else self._failures + 1
            newly_down = self._failures >= DEAD_AFTER and not self._down
            if newly_down:
                self._down = f"{DEAD_AFTER} requests in a row failed, the last: {why}"
        if newly_down and self.config.judge_on_dead == "skip":
            log.warning("%s is down (%s): going on without it (--judge_on_dead skip); the rows from here on get "
                        "no judge score", self.name, self._down)

    def _unscore(self, label: str, why: str, quoted: Optional[str] = None, logged: bool = False) -> Verdict:
        if self._down and self.config.judge_on_dead == "stop":
            what = f"{self.name} is down ({self._down})"
            raise JudgeDown(f"{what}; the run stops (--judge_on_dead stop). Start the judge, or pass --judge_on_dead "
                            "skip to go on without it", what)
        with self._lock:
            self._unscored.append((label, why))
        if not logged:
            log.warning("%s: %sno score: %s%s", self.name, f"{label}: " if label else "", why,
                        f"; reply: {quote(quoted)}" if quoted is not None else "")
        return Verdict({}, why)


def unscored_line(name: str, unscored: list[tuple[str, str]], total: int, limit: int = 8) -> str:
    """One line naming the rows a judge could not score (the first ``limit``) and why."""
    named = "; ".join(f"{label or '?'} ({why})" for label, why in unscored[:limit])
    more = f"; and {len(unscored) - limit} more" if len(unscored) > limit else ""
    return f"{name}: {len(unscored)} of {total} row(s) got no score: {named}{more}"


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


class OpenAIJudge(ScoringJudge):
    """A judge behind an OpenAI-compatible ``/v1/chat/completions`` (``base_url`` ends before ``/chat``)."""

    def __init__(self, base_url: str, model: str, fmt, config: Optional[JudgeConfig] = None,
                 api_key: Optional[str] = None, backoff: float = 1.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge endpoint {base_url!r}: give an http(s) URL such as http://127.0.0.1:8000/v1")
        super().__init__(fmt, config, name=f"judge {model} at {base_url}")
        self.base_url, self.url = base_url.rstrip("/"), base_url.rstrip("/") + "/chat/completions"
        self.model, self.backoff = model, backoff
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def ask(self, text: str, images: list[Image.Image]):
        from .judge_http import chat

        content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": _data_url(im)}}
                                                      for im in images]
        payload = {"model": self.model, "temperature": 0, "max_tokens": self.config.judge_max_tokens,
                   "messages": [{"role": "user", "content": content}]}
        return chat(self.url, payload, self.headers, self.config.judge_timeout, self.config.judge_retries,
                    self.backoff)

    def check_reachable(self) -> bool:
        """Whether the endpoint answers at all (``GET /models``, one ``--judge_timeout``); a ValueError when it
        lists the models it serves and this one is not among them."""
        from .judge_http import served_models

        alive, models = served_models(self.base_url, self.headers, self.config.judge_timeout)
        if models is not None and self.model not in models:
            raise ValueError(f"{self.name}: the endpoint serves {', '.join(models) or 'no model'}, not "
                             f"{self.model!r}; name one of them after '#'")
        return alive


def load_editscore(base_dir: str | Path, lora_dir: str | Path):
    """(model, processor) of EditScore-7B from local directories (Qwen2.5-VL-7B-Instruct and the EditScore LoRA),
    loaded with ``local_files_only``; None with one logged line when a directory or a package is missing."""
    base, lora = Path(base_dir), Path(lora_dir)
    missing = [str(p) for p in (base / "config.json", lora / "adapter_config.json") if not p.is_file()]
    if missing:
        log.warning("judge: EditScore needs local copies of Qwen/Qwen2.5-VL-7B-Instruct and EditScore/EditScore-7B "
                    "(nothing is downloaded here); not found: %s", ", ".join(missing))
        return None
    try:
        from peft import PeftModel
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration
    except ImportError as e:
        log.warning("judge: EditScore needs transformers and peft (%s)", e)
        return None
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(base, local_files_only=True, torch_dtype="auto")
    model = PeftModel.from_pretrained(model, lora, local_files_only=True).eval()
    return model, AutoProcessor.from_pretrained(base, local_files_only=True)
