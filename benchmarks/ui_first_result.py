"""Time to a first result in the web UI on the tiny model: `python app_gradio.py` started, the page served, the
model loaded (the UI loads it in the background at start), and one example edited at the UI's defaults.

    python -m benchmarks.ui_first_result [--repeats 3]

Prints, per repeat, the seconds from the process start to the page answering, to the model's load line in the
UI's log, and the edit of the first example row (the CPU demo's held-out row, 64 px, with its mask) at the UI's
default steps and CFG through the same ``Editor`` in this process, warm. A user's first result after one click is
at most ``max(page, model) + edit`` (the click itself comes after the page is up).
"""
from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

LOADED = re.compile(r"loaded \S+ \(dit")


def start_and_wait(tmp: Path, timeout: float = 120.0) -> tuple[float, float]:
    """(seconds to the page answering, seconds to the model's load line) of one app start."""
    from diffsynth_qie.ui.running import running_app

    with running_app(["--outputs_dir", tmp / "outputs", "--lora_dir", tmp / "loras"], tmp / "app.log",
                     wait=False) as app:
        return app.wait(timeout, log_line=LOADED.pattern)


def edit_seconds(repeats: int) -> float:
    """The first example's edit at the UI's defaults, warm (median of ``repeats``)."""
    from diffsynth_qie.data.demo import make_recolour_demo
    from diffsynth_qie.inference import EditRequest, Editor
    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.settings import SETTINGS
    from diffsynth_qie.ui.examples import load_examples
    from PIL import Image

    config = UIConfig()
    with tempfile.TemporaryDirectory() as tmp:
        rows = make_recolour_demo(Path(tmp) / "demo", num_pairs=1, num_heldout=1) / "heldout.json"
        example = load_examples(rows)[0]
        editor = Editor.from_preset(config.model, model_dir=config.model_dir or None, device="cpu")
        defaults = {s.name: s.default for s in SETTINGS}
        request = EditRequest(images=[Image.open(example.image).convert("RGB")], prompt=example.prompt,
                              mask=Image.open(example.mask), steps=defaults["steps"], cfg=defaults["cfg"])
        editor.edit(request)  # warm
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            editor.edit(request)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)

    results = []
    for i in range(a.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(start_and_wait(Path(tmp)))
        print(f"start {i + 1}: page {results[-1][0]:.1f} s, model loaded {results[-1][1]:.1f} s", flush=True)
    edit = edit_seconds(a.repeats)
    page = statistics.median(r[0] for r in results)
    model = statistics.median(r[1] for r in results)
    print(f"median: page {page:.1f} s, model {model:.1f} s, first example's edit {edit:.2f} s (warm) -> "
          f"first result within {max(page, model) + edit:.1f} s of `python app_gradio.py`")


if __name__ == "__main__":
    main()
