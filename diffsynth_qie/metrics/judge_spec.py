"""A judge named on the command line (``qie eval-edits --judge SPEC``, ``qie train --val_judge SPEC``).

``SPEC`` is one of:

- ``URL#MODEL``: an OpenAI-compatible endpoint and the model it serves, e.g.
  ``http://127.0.0.1:8000/v1#EditScore-7B`` (a local vLLM); the key, if the endpoint wants one, is read from
  ``OPENAI_API_KEY``;
- ``DIR`` or ``BASE_DIR,DIR``: a local EditScore-7B (``DIR`` holds its PEFT ``adapter_config.json``; the
  Qwen2.5-VL-7B-Instruct base is ``BASE_DIR``, else the local path its adapter config names). Nothing is
  downloaded; when the weights are not there the judge is absent (no field) and one line says so.

:func:`parse_spec` checks a spec without loading anything (flags are checked before any work);
:func:`build_judge` makes the judge, or None.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from PIL import Image

from .judge import SCORE_PROMPT, OpenAIJudge, load_editscore, parse_score

log = logging.getLogger(__name__)

VAL_JUDGE_HELP = ("score every validation output with a judge too (val_judge in loss.jsonl, 0-10): URL#MODEL (an "
                  "OpenAI-compatible endpoint, e.g. a local vLLM) or a local EditScore-7B directory ([BASE_DIR,]DIR); "
                  "runs at validation only")


@dataclass(frozen=True)
class JudgeSpec:
    kind: str                       # "openai" or "editscore"
    url: Optional[str] = None
    model: Optional[str] = None
    base_dir: Optional[str] = None
    lora_dir: Optional[str] = None


def parse_spec(spec: str, flag: str = "--judge") -> JudgeSpec:
    """The parts of ``spec`` (see the module docstring); a ValueError naming the flag and the fix otherwise."""
    spec = (spec or "").strip()
    if spec.startswith(("http://", "https://")):
        url, _, model = spec.partition("#")
        if not model:
            raise ValueError(f"{flag} {spec}: name the model the endpoint serves after '#', e.g. "
                             f"{url}#EditScore-7B")
        return JudgeSpec("openai", url=url, model=model)
    base, _, lora = spec.rpartition(",")
    if not lora or not Path(lora).is_dir():
        raise ValueError(f"{flag} {spec!r}: give an OpenAI-compatible endpoint as URL#MODEL (e.g. "
                         "http://127.0.0.1:8000/v1#EditScore-7B) or a local EditScore-7B directory ([BASE_DIR,]DIR)")
    return JudgeSpec("editscore", base_dir=base or _adapter_base(lora), lora_dir=lora)


def judge_spec_type(value: str) -> str:
    """An argparse ``type`` for ``--val_judge``: the spec, checked when the flags are parsed."""
    import argparse

    try:
        parse_spec(value, "--val_judge")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return value


def _adapter_base(lora_dir: str) -> str:
    """The base model directory an adapter config names (its local path), else ``<lora_dir>/base``."""
    try:
        named = json.loads((Path(lora_dir) / "adapter_config.json").read_text(encoding="utf-8"))
        named = named.get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        named = None
    return named if named and Path(named).is_dir() else str(Path(lora_dir) / "base")


def build_judge(spec: Optional[str], flag: str = "--judge"):
    """The judge ``spec`` names (None for no spec, or when a local model is not there: said once)."""
    if not spec:
        return None
    parts = parse_spec(spec, flag)
    if parts.kind == "openai":
        log.info("judge: %s at %s", parts.model, parts.url)
        return OpenAIJudge(parts.url, parts.model, api_key=os.environ.get("OPENAI_API_KEY"))
    loaded = load_editscore(parts.base_dir, parts.lora_dir)
    return None if loaded is None else EditScoreJudge(*loaded)


class EditScoreJudge:
    """EditScore-7B run here: the source and the output with :data:`~.judge.SCORE_PROMPT`, greedy, the reply's
    first number in 0-10 is the score."""

    def __init__(self, model, processor, max_new_tokens: int = 32):
        self.model, self.processor, self.max_new_tokens = model, processor, max_new_tokens

    def score(self, source: Image.Image, instruction: str, output: Image.Image) -> dict[str, float]:
        import torch

        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                 {"type": "text", "text": SCORE_PROMPT.format(instruction=instruction)}]}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = self.processor(text=[text], images=[source.convert("RGB"), output.convert("RGB")],
                                return_tensors="pt").to(self.model.device)
        with torch.no_grad():
            ids = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        reply = self.processor.batch_decode(ids[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0]
        value = parse_score(reply)
        return {} if value is None else {"judge": value}

    def prefer(self, source, instruction, a, b) -> Optional[float]:
        sa, sb = self.score(source, instruction, a).get("judge"), self.score(source, instruction, b).get("judge")
        if sa is None or sb is None:
            return None
        return 0.5 if sa == sb else float(sa > sb)
