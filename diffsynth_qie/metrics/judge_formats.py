"""A judge's reply format: the prompt(s) it is asked with, and how its replies become scores (0-10).

============  ====================================================================================
format        what is asked, and what is read
============  ====================================================================================
``editscore``  EditScore's (VectorSpaceLab/EditScore, arXiv 2509.23909) two requests with their rules,
               at its scale 0-25: a *semantic* request (source, output, instruction) answered
               ``{"reasoning": …, "score": [success, overediting]}`` and a *quality* request (the
               output alone) answered ``{"reasoning": …, "score": [naturalness, artifacts]}``.
               ``judge_semantic`` = min(semantic scores) / 2.5, ``judge_quality`` = min(quality
               scores) / 2.5, ``judge`` = √(semantic · quality): its overall score, 0-10.
``viescore``   the same two requests and JSON replies at VIEScore's scale 0-10 (GEdit-Bench's
               scorer; any VLM that answers VIEScore-style JSON).
``number``     one request (source, output, instruction) asking for a score out of 10 on a last line
               ``Score: N/10``; the JSON ``score``, the last ``Score:`` field or a bare number is read
               (``judge_parse.py``), ``N/M`` rescaled to 0-10.
============  ====================================================================================

A reply outside its format (no score where the format puts it, a value outside the scale, several numbers
where one is asked) gives no score and the reason, never a guess.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .judge_parse import find_score

_CONTEXT = (
    "You are a professional digital artist. You evaluate how well AI-generated images meet the rules below. "
    "Every input image is AI-generated, and so is every person shown in them: there is no privacy concern.\n\n"
    "Answer in exactly this form (keep the reasoning short):\n{{\n\"reasoning\" : \"...\",\n\"score\" : [...]\n}}\n")
_SEMANTIC = (
    "RULES:\n\nTwo images are given: the first is the original AI-generated image, the second an edited version of "
    "it. Evaluate how well the editing instruction was carried out in the second image.\n\nThe two images may look "
    "identical when the edit failed.\n\n"
    "On a scale from 0 to {top}:\n"
    "A first score from 0 to {top} rates the success of the edit (0: the edited scene does not follow the "
    "instruction at all; {top}: it follows the instruction perfectly).\n"
    "A second score from 0 to {top} rates the overediting of the second image (0: the edited scene is completely "
    "different from the original; {top}: it is a minimal yet effective edit of the original).\n"
    "Give both in a list, score = [score1, score2], score1 for the success of the edit and score2 for the "
    "overediting.\n\nEditing instruction: {instruction}\n")
_QUALITY = (
    "RULES:\n\nThe image is an AI-generated image. Evaluate how well it was generated.\n\n"
    "On a scale from 0 to {top}:\n"
    "A first score from 0 to {top} rates the image's naturalness (0: the scene does not look natural at all, e.g. a "
    "wrong sense of distance, wrong shadows or wrong lighting; {top}: it looks natural).\n"
    "A second score from 0 to {top} rates the image's artifacts (0: large parts are distorted, watermarked, "
    "scratched, blurred faces, unusual body parts or subjects that do not blend; {top}: no artifacts).\n"
    "Give both in a list, score = [naturalness, artifacts].\n")
_NUMBER = (
    "You judge an image edit. The first image is the source, the second the result of editing it with this "
    "instruction: {instruction}\nRate how well the result follows the instruction while keeping everything else "
    "unchanged, from 0 (failed) to {top} (perfect). You may reason first; end your reply with one line "
    "\"Score: N/{top}\".")


@dataclass(frozen=True)
class Request:
    """One chat request of a format: its text and the images after it (``"source"``, ``"output"``, in order)."""

    text: str
    images: tuple[str, ...]


@dataclass(frozen=True)
class Reading:
    """What a format read from one edit's replies: ``scores`` ({} for none), why there are none, and the index of
    the reply that gave none (to quote it)."""

    scores: dict
    why: str = ""
    bad: Optional[int] = None


def _g(value: float) -> str:
    return f"{value:g}"


class NumberFormat:
    """``number``: one request, one score out of ``top`` (the module docstring)."""

    name = "number"

    def __init__(self, top: float = 10.0):
        self.top = float(top)

    def requests(self, instruction: str) -> list[Request]:
        return [Request(_NUMBER.format(instruction=instruction, top=_g(self.top)), ("source", "output"))]

    def read(self, replies: list[str]) -> Reading:
        found, why = find_score(replies[0])
        if found is None:
            return Reading({}, why, 0)
        if len(found.values) != 1:
            return Reading({}, f"its score is {len(found.values)} numbers {list(found.values)}, where this format "
                               "asks for one (a VIEScore-style judge: pick #viescore)", 0)
        top = found.top or self.top
        value = found.values[0]
        if not 0 <= value <= top or top <= 0:
            return Reading({}, f"its score {_g(value)} is outside 0-{_g(top)}", 0)
        return Reading({"judge": value * 10.0 / top})


class PairedFormat:
    """``editscore`` / ``viescore``: a semantic and a quality request, JSON score lists on 0-``top`` (the module
    docstring)."""

    def __init__(self, name: str, top: float):
        self.name, self.top = name, float(top)

    def requests(self, instruction: str) -> list[Request]:
        top, context = _g(self.top), _CONTEXT.format()
        return [Request(context + "\n" + _SEMANTIC.format(top=top, instruction=instruction), ("source", "output")),
                Request(context + "\n" + _QUALITY.format(top=top), ("output",))]

    def read(self, replies: list[str]) -> Reading:
        parts = []
        for i, (which, reply) in enumerate(zip(("semantic", "quality"), replies)):
            found, why = find_score(reply)
            if found is None:
                return Reading({}, f"its {which} reply: {why}", i)
            top = found.top or self.top
            bad = [v for v in found.values if not 0 <= v <= top]
            if bad or top <= 0:
                return Reading({}, f"its {which} score {list(found.values)} is outside 0-{_g(top)}", i)
            parts.append(min(found.values) * 10.0 / top)
        semantic, quality = parts
        return Reading({"judge": math.sqrt(semantic * quality), "judge_semantic": semantic, "judge_quality": quality})


FORMATS = {"editscore": lambda: PairedFormat("editscore", 25), "viescore": lambda: PairedFormat("viescore", 10),
           "number": lambda: NumberFormat(10)}


def format_named(name: Optional[str], model: str = ""):
    """The format ``name`` (None: ``editscore`` for a model whose name says EditScore, else ``number``); a
    ValueError naming the choices for an unknown name."""
    if name is None:
        name = "editscore" if "editscore" in (model or "").lower() else "number"
    if name not in FORMATS:
        raise ValueError(f"judge reply format {name!r} is unknown; choose one of {', '.join(FORMATS)} "
                         "(docs/SCORECARD.md, 'The optional judge')")
    return FORMATS[name]()
