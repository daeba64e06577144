"""The labelled cases of ``qie check-dataset``'s benchmark (``benchmarks/pairs_bench.py``), as data.

``python -m benchmarks.pairs_cases [--repeats N] > tests/assets/pairs_bench.json`` writes the case list the
tests use (``--repeats 1``); a bigger run draws more cases per photo with other seeds. Each case names a photo
that scikit-image ships (``skimage/data``), an aspect ratio, an edit, an optional planted problem, the mask it
ships with and the flags it must get (``expect``; empty for a clean row). Nothing here draws a photo.
"""
from __future__ import annotations

import argparse
import json
import random
import sys

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
          "hubble_deep_field.jpg", "retina.jpg", "ihc.png", "camera.png", "coins.png", "moon.png", "brick.png")
ASPECTS = ([1, 1], [4, 3], [3, 4], [16, 9], [2, 3], [3, 2])
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange")
LOCAL = ("recolour", "insert", "remove", "move", "text")
WORDS = ("SALE", "OPEN", "HELLO", "2024", "CAFE", "EXIT")


def _box(rng: random.Random, small: bool = False) -> list[float]:
    w, h = (rng.uniform(0.12, 0.2), rng.uniform(0.12, 0.2)) if small else (rng.uniform(0.18, 0.32),
                                                                            rng.uniform(0.18, 0.32))
    return [round(rng.uniform(0.08, 0.92 - w), 3), round(rng.uniform(0.08, 0.92 - h), 3), round(w, 3), round(h, 3)]


def _edit(rng: random.Random, op: str) -> dict:
    e: dict = {"op": op, "box": _box(rng)}
    if op == "recolour":
        e["colour"] = rng.choice(COLOURS)
        e["prompt"] = f"make the object in the middle {e['colour']}"
    elif op == "insert":
        e["donor"] = rng.choice(PHOTOS)
        e["prompt"] = "add a framed picture"
    elif op == "remove":
        e["donor"] = rng.choice(PHOTOS)
        e["prompt"] = "remove the object"
    elif op == "move":
        e["donor"] = rng.choice(PHOTOS)
        e["offset"] = [rng.choice((-1, 1)) * rng.randint(18, 30), rng.choice((-1, 1)) * rng.randint(18, 30)]
        e["prompt"] = "move the object a little"
    elif op == "text":
        e["text"] = rng.choice(WORDS)
        e["prompt"] = f"write '{e['text']}' on it"
    elif op == "grade":
        e["gamma"], e["gains"] = round(rng.uniform(0.7, 0.85), 2), [1.12, 1.0, 0.82]
        e["prompt"] = "apply a warm colour grade"
    elif op == "style":
        e["prompt"] = "make it look like a poster"
    return e


def cases(repeats: int = 1, seed: int = 0) -> list[dict]:
    """The benchmark's cases: per photo and repeat, five clean edits on one shared source (local edits with and
    without a mask, a global grade or style with a full or no mask) and one planted problem of each kind."""
    out: list[dict] = []
    for r in range(repeats):
        for p, photo in enumerate(PHOTOS):
            rng = random.Random(f"{seed}/{r}/{photo}")
            aspect, fmt = ASPECTS[(p + r) % len(ASPECTS)], "jpg" if (p + r) % 3 == 0 else "png"
            stem = f"{photo.split('.')[0]}{r}"
            base = {"photo": photo, "aspect": aspect, "source_fmt": fmt, "source": stem}

            def add(name, edit, expect=(), mask="edit", problem=None, **kw):
                out.append({**base, "id": f"{stem}-{name}", "edit": edit, "mask": mask, "problem": problem,
                            "expect": list(expect), **kw})

            ops = rng.sample(LOCAL, 4)
            for i, op in enumerate(ops):  # several edits of one source photo (one source file)
                add(f"clean-{op}", _edit(rng, op), mask="edit" if i % 2 == 0 else "none")
            glob = _edit(rng, rng.choice(("grade", "style")))
            add(f"clean-{glob['op']}", glob, mask=rng.choice(("full", "none")))
            # planted problems, each on its own source copy where the problem changes the source
            add("identical", {"op": "none", "prompt": "make the sky blue"}, ["near_identical"], mask="none")
            add("noop", {"op": "none", "prompt": "make it brighter"}, ["no_op"], mask="none",
                problem={"kind": "reencode", "quality": 40})
            add("shift", _edit(rng, rng.choice(LOCAL)), ["shifted"], mask="none",
                problem={"kind": "shift", "dy": rng.choice((-1, 1)) * rng.randint(3, 8),
                         "dx": rng.choice((-1, 1)) * rng.randint(3, 8)})
            add("zoom", _edit(rng, rng.choice(LOCAL)), ["scale_mismatch"], mask="none",
                problem={"kind": "zoom", "factor": rng.choice((0.85, 1.12, 1.18, 1.25))})
            add("dup-row", None, ["duplicate"], problem={"kind": "duplicate_of", "of": f"{stem}-clean-{ops[0]}"})
            add("dup-reencoded", None, ["duplicate"],
                problem={"kind": "reencoded_of", "of": f"{stem}-clean-{ops[1]}", "quality": 88})
            rev = _edit(rng, "recolour")
            add("reversed", rev, ["reversed"], problem={"kind": "reversed"})
            add("outside", _edit(rng, rng.choice(LOCAL)), ["changes_outside_mask"],
                problem={"kind": "outside", "box": _box(rng), "colour": rng.choice(COLOURS)})
            add("empty-mask", _edit(rng, rng.choice(LOCAL)), ["mask_empty"], mask="empty")
            add("mask-size", _edit(rng, rng.choice(LOCAL)), ["mask_aspect"], mask="wrong_size")
            add("wrong-source", _edit(rng, rng.choice(LOCAL)), ["wrong_source"], mask="none",
                problem={"kind": "wrong_source", "photo": PHOTOS[(p + 1 + r) % len(PHOTOS)]})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    json.dump(cases(args.repeats, args.seed), sys.stdout, indent=0)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
