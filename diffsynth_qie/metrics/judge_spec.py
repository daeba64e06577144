"""A judge named on the command line (``qie eval-edits --judge SPEC``, ``qie train --val_judge`` / ``--reward_judge``).

``SPEC`` is one of:

- ``URL#MODEL[#FORMAT]``: an OpenAI-compatible endpoint, the model it serves and its reply format
  (``judge_formats.py``: ``editscore``, ``viescore`` or ``number``; left out: ``editscore`` when the model's name
  says EditScore, else ``number``), e.g. ``http://127.0.0.1:8000/v1#EditScore-7B`` (a local vLLM); the key, if
  the endpoint wants one, is read from ``OPENAI_API_KEY``;
- ``DIR`` or ``BASE_DIR,DIR``: a local EditScore-7B (``DIR`` holds its PEFT ``adapter_config.json``; the
  Qwen2.5-VL-7B-Instruct base is ``BASE_DIR``, else the local path its adapter config names), asked in the
  ``editscore`` format. Nothing is downloaded; when the weights are not there the judge is absent (no field)
  and one line says so.

:func:`parse_spec` checks a spec without loading anything (flags are checked before any work);
:func:`build_judge` makes the judge (and checks that an endpoint answers), or None.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from PIL import Image

from .judge import JudgeDown, OpenAIJudge, ScoringJudge, load_editscore
from .judge_config import JudgeConfig
from .judge_formats import FORMATS, format_named
from .judge_http import Answer

log = logging.getLogger(__name__)

VAL_JUDGE_HELP = ("score every validation output with a judge too (val_judge in loss.jsonl, 0-10): URL#MODEL[#FORMAT] "
                  f"(an OpenAI-compatible endpoint, e.g. a local vLLM; FORMAT: {', '.join(FORMATS)}) or a local "
                  "EditScore-7B directory ([BASE_DIR,]DIR); runs at validation only")


@dataclass(frozen=True)
class JudgeSpec:
    kind: str                       # "openai" or "editscore"
    url: Optional[str] = None
    model: Optional[str] = None
    format: Optional[str] = None    # None: chosen by the model's name
    base_dir: Optional[str] = None
    lora_dir: Optional[str] = None


def parse_spec(spec: str, flag: str = "--judge") -> JudgeSpec:
    """The parts of ``spec`` (see the module docstring); a ValueError naming the flag and the fix otherwise."""
    spec = (spec or "").strip()
    if spec.startswith(("http://", "https://")):
        url, _, rest = spec.partition("#")
        model, _, fmt = rest.partition("#")
        if not model:
            raise ValueError(f"{flag} {spec}: name the model the endpoint serves after '#', e.g. "
                             f"{url}#EditScore-7B")
        if fmt and fmt not in FORMATS:
            raise ValueError(f"{flag} {spec}: reply format {fmt!r} is unknown; give URL#MODEL#FORMAT with FORMAT one "
                             f"of {', '.join(FORMATS)} (or leave it out)")
        return JudgeSpec("openai", url=url, model=model, format=fmt or None)
    base, _, lora = spec.rpartition(",")
    if not lora or not Path(lora).is_dir():
        raise ValueError(f"{flag} {spec!r}: give an OpenAI-compatible endpoint as URL#MODEL[#FORMAT] (e.g. "
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


def build_judge(spec: Optional[str], flag: str = "--judge", config: Optional[JudgeConfig] = None):
    """The judge ``spec`` names (None for no spec, or when a local model is not there: said once). An endpoint
    that does not answer is a dead judge at once: :class:`~.judge.JudgeDown` under ``--judge_on_dead stop``,
    else None and one line."""
    if not spec:
        return None
    config = config or JudgeConfig()
    parts = parse_spec(spec, flag)
    if parts.kind == "openai":
        fmt = format_named(parts.format, parts.model)
        judge = OpenAIJudge(parts.url, parts.model, fmt, config, api_key=os.environ.get("OPENAI_API_KEY"))
        if not judge.check_reachable():
            line = (f"{flag}: {judge.name} does not answer (nothing within --judge_timeout {config.judge_timeout:g} "
                    "s)")
            if config.judge_on_dead == "stop":
                raise JudgeDown(f"{line}; start it, or pass --judge_on_dead skip to go on without it")
            log.warning("%s: going on without it (--judge_on_dead skip)", line)
            return None
        log.info("%s: %s (reply format %s; up to %d request(s) at once, %g s each, %d retr%s)", flag, judge.name,
                 fmt.name, config.judge_workers, config.judge_timeout, config.judge_retries,
                 "y" if config.judge_retries == 1 else "ies")
        return judge
    loaded = load_editscore(parts.base_dir, parts.lora_dir)
    return None if loaded is None else EditScoreJudge(*loaded, config=config)


class EditScoreJudge(ScoringJudge):
    """EditScore-7B run here, asked in the ``editscore`` format (its two requests, greedy), one request at a
    time (one model)."""

    def __init__(self, model, processor, config: Optional[JudgeConfig] = None):
        import dataclasses

        config = dataclasses.replace(config or JudgeConfig(), judge_workers=1)
        super().__init__(format_named("editscore"), config, name="judge EditScore-7B (local)")
        self.model, self.processor = model, processor

    def ask(self, text: str, images: list[Image.Image]) -> Answer:
        import torch

        messages = [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}]
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = self.processor(text=[prompt], images=[im.convert("RGB") for im in images],
                                return_tensors="pt").to(self.model.device)
        with torch.no_grad():
            ids = self.model.generate(**inputs, max_new_tokens=self.config.judge_max_tokens, do_sample=False)
        new = ids[:, inputs["input_ids"].shape[1]:]
        reply = self.processor.batch_decode(new, skip_special_tokens=True)[0]
        cut = new.shape[1] >= self.config.judge_max_tokens
        return Answer(text=reply, answered=True, cut=cut)
