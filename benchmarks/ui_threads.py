"""The web UI's ``--threads``: one small masked edit timed at several torch CPU thread counts.

    python -m benchmarks.ui_threads [--model_dir DIR] [--size 64] [--steps 8] [--repeats 5] [--busy 0]

What is timed: ``Editor.edit`` (what the UI's Generate runs) on the pretrained tiny
base (``app_gradio.py``'s default model; installed in ``$QIE_HOME`` when missing),
CPU fp32: a ``--size``² shapes image, a centred rectangular mask, ``--steps``
flow-matching steps with the model's default CFG, seed 0. Thread counts: 1, 2 and
torch's default (one per core), set with ``torch.set_num_threads`` in one process.
One untimed warm-up edit per count, then ``--repeats`` rounds, each timing every
count once (interleaved, so a background job that comes and goes hits them alike).
Reported: median seconds per edit and its ratio to 1 thread (> 1 = slower).

``--busy N`` runs N CPU-bound processes during the timing: a machine shared with
another job (a training run, a test suite), where torch's default threads compete
with it for the same cores.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `diffsynth_qie` / `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("DIFFSYNTH_SKIP_DOWNLOAD", "True")

log = logging.getLogger("benchmarks.ui_threads")


def _spin(stop) -> None:  # a CPU-bound neighbour (--busy)
    x = 0
    while not stop.is_set():
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def edit_request(size: int, steps: int):
    """The timed edit: a shapes image with a centred mask over half its width and height."""
    import random

    from PIL import Image, ImageDraw

    from diffsynth_qie.data.demo import random_shapes_image
    from diffsynth_qie.inference.editor import EditRequest

    image = random_shapes_image(random.Random(0), (size, size))
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle((size // 4, size // 4, 3 * size // 4 - 1, 3 * size // 4 - 1), fill=255)
    return EditRequest(images=[image], prompt="make the red circle blue", mask=mask, steps=steps, seed=0,
                       width=size, height=size)


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from diffsynth_qie.inference.editor import Editor
    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.startup import resolve_model_dir

    default = torch.get_num_threads()  # before anything sets it
    model_dir = args.model_dir or resolve_model_dir(UIConfig(model="tiny"))
    editor = Editor.from_preset(model="tiny", model_dir=model_dir, device="cpu")
    request = edit_request(args.size, args.steps)
    counts = list(dict.fromkeys([1, 2, default]))  # torch's default may be 1 or 2 itself
    times: dict[int, list[float]] = {n: [] for n in counts}
    stop = multiprocessing.Event()
    neighbours = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for p in neighbours:
        p.start()
    try:
        for n in counts:  # warm-up
            torch.set_num_threads(n)
            editor.edit(request)
        for _ in range(args.repeats):
            for n in counts:
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                editor.edit(request)
                times[n].append(time.perf_counter() - t0)
                log.info("%d thread(s): %.3f s", n, times[n][-1])
    finally:
        stop.set()
        for p in neighbours:
            p.join()
    base = statistics.median(times[1])
    return [{"threads": n, "default": n == default, "median_s": statistics.median(times[n]),
             "ratio": statistics.median(times[n]) / base, "times": times[n]} for n in counts]


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"pretrained tiny base, CPU fp32, {args.size}x{args.size} masked edit, {args.steps} steps, "
             f"{os.cpu_count()} cores, {args.busy} busy neighbour process(es), "
             f"median of {args.repeats} after 1 warm-up",
             "",
             "| threads | median s/edit | × 1 thread | all s |",
             "| --- | --- | --- | --- |"]
    for r in rows:
        name = f"{r['threads']} (torch default)" if r["default"] else str(r["threads"])
        lines.append(f"| {name} | {r['median_s']:.3f} | {r['ratio']:.2f} | "
                     f"{', '.join(f'{t:.2f}' for t in r['times'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", help="tiny model directory (default: the UI's, the pretrained tiny base)")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (a multiple of 16)")
    parser.add_argument("--steps", type=int, default=8, help="flow-matching steps")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound neighbour processes during the timing")
    args = parser.parse_args(argv)
    if args.size < 16 or args.size % 16 or args.steps < 1 or args.repeats < 1 or args.busy < 0:
        parser.error("--size must be a multiple of 16 (>= 16), --steps and --repeats >= 1, --busy >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(table(run(args), args))  # the script's result (stdout); progress goes to the log
    return 0


if __name__ == "__main__":
    sys.exit(main())
