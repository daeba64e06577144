"""An optional judge of edits: ``(source, instruction, output) -> scores`` and a pairwise preference.

- :class:`Judge`: the interface; ``score`` returns ``{"judge": 0-10}`` (and any sub-scores the judge gives),
  ``prefer`` returns the probability that output ``a`` is the better edit of the two.
- :class:`OpenAIJudge`: any OpenAI-compatible chat endpoint (a local vLLM serving EditScore,
  EditReward, Qwen2.5-VL, ...): the images go as PNG data URLs, the reply's first number is the score.
- :func:`load_editscore`: EditScore-7B (a PEFT LoRA on Qwen2.5-VL-7B-Instruct, Apache-2.0) read only
  from local directories, never downloaded; ``None`` with one logged line when they are not there.

A judge that cannot answer never invents a value: the field is absent (``score`` returns ``{}``)
and the reason is logged once.
"""
from __future__ import annotations

import base64
import io
import json
import logging
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Protocol

from PIL import Image

log = logging.getLogger(__name__)

SCORE_PROMPT = ("You judge an image edit. The first image is the source, the second the edited result. "
                "Instruction: {instruction}\nRate how well the edit follows the instruction while keeping "
                "everything else unchanged, from 0 (failed) to 10 (perfect). Answer with the number first.")
PAIR_PROMPT = ("You compare two edits of the first image. Instruction: {instruction}\nImage 2 is edit A, image 3 "
               "is edit B. Answer 'A' or 'B' for the better edit.")
_said: set[str] = set()


class Judge(Protocol):
    def score(self, source: Image.Image, instruction: str, output: Image.Image) -> dict[str, float]: ...

    def prefer(self, source: Image.Image, instruction: str, a: Image.Image, b: Image.Image) -> Optional[float]: ...


def parse_score(text: str, top: float = 10.0) -> Optional[float]:
    """The first number of a reply, when it lies in [0, ``top``]; None otherwise."""
    m = re.search(r"-?\d+(?:\.\d+)?", text or "")
    if m is None:
        return None
    value = float(m.group())
    return value if 0 <= value <= top else None


def _say_once(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        log.warning("judge: %s", reason)


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


class OpenAIJudge:
    """A judge behind an OpenAI-compatible ``/v1/chat/completions`` (``base_url`` ends before ``/chat``)."""

    def __init__(self, base_url: str, model: str, api_key: Optional[str] = None, timeout: float = 120.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge endpoint {base_url!r}: give an http(s) URL such as http://127.0.0.1:8000/v1")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.timeout = model, api_key, timeout

    def _ask(self, text: str, images: list[Image.Image]) -> Optional[str]:
        content = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": _data_url(im)}}
                                                      for im in images]
        body = json.dumps({"model": self.model, "temperature": 0, "max_tokens": 64,
                           "messages": [{"role": "user", "content": content}]}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url, body, headers), timeout=self.timeout) as r:
                return json.loads(r.read())["choices"][0]["message"]["content"]
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
            _say_once(f"{self.url} gave no answer ({type(e).__name__}: {e}); no judge scores")
            return None

    def score(self, source: Image.Image, instruction: str, output: Image.Image) -> dict[str, float]:
        reply = self._ask(SCORE_PROMPT.format(instruction=instruction), [source, output])
        value = parse_score(reply) if reply is not None else None
        if reply is not None and value is None:
            _say_once(f"{self.url} replied without a score in 0-10 ({reply[:60]!r}); no judge score")
        return {} if value is None else {"judge": value}

    def prefer(self, source: Image.Image, instruction: str, a: Image.Image, b: Image.Image) -> Optional[float]:
        reply = self._ask(PAIR_PROMPT.format(instruction=instruction), [source, a, b])
        answer = (reply or "").strip().upper()[:1]
        return {"A": 1.0, "B": 0.0}.get(answer)


def load_editscore(base_dir: str | Path, lora_dir: str | Path):
    """(model, processor) of EditScore-7B from local directories (Qwen2.5-VL-7B-Instruct and the EditScore LoRA),
    loaded with ``local_files_only``; None with one logged line when a directory or a package is missing."""
    base, lora = Path(base_dir), Path(lora_dir)
    missing = [str(p) for p in (base / "config.json", lora / "adapter_config.json") if not p.is_file()]
    if missing:
        _say_once(f"EditScore needs local copies of Qwen/Qwen2.5-VL-7B-Instruct and EditScore/EditScore-7B "
                  f"(nothing is downloaded here); not found: {', '.join(missing)}")
        return None
    try:
        from peft import PeftModel
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration
    except ImportError as e:
        _say_once(f"EditScore needs transformers and peft ({e})")
        return None
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(base, local_files_only=True, torch_dtype="auto")
    model = PeftModel.from_pretrained(model, lora, local_files_only=True).eval()
    return model, AutoProcessor.from_pretrained(base, local_files_only=True)
