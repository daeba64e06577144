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
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOADED = re.compile(r"loaded \S+ \(dit")


def start_and_wait(tmp: Path, port: int, timeout: float = 120.0) -> tuple[float, float]:
    """(seconds to the page answering, seconds to the model's load line) of one app start."""
    log_path = tmp / "app.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(REPO / "app_gradio.py"), "--port", str(port),
                                 "--outputs_dir", str(tmp / "outputs"), "--lora_dir", str(tmp / "loras")],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    page = model = None
    try:
        while time.perf_counter() - t0 < timeout and (page is None or model is None):
            if proc.poll() is not None:
                raise RuntimeError(f"app_gradio.py exited: {log_path.read_text()[-2000:]}")
            if page is None:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read(64)
                    page = time.perf_counter() - t0
                except OSError:
                    pass
            if model is None and LOADED.search(log_path.read_text()):
                model = time.perf_counter() - t0
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if page is None or model is None:
        raise RuntimeError(f"not ready in {timeout} s: {log_path.read_text()[-2000:]}")
    return page, model


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
    import socket

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)

    results = []
    for i in range(a.repeats):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            results.append(start_and_wait(Path(tmp), port))
        print(f"start {i + 1}: page {results[-1][0]:.1f} s, model loaded {results[-1][1]:.1f} s", flush=True)
    edit = edit_seconds(a.repeats)
    page = statistics.median(r[0] for r in results)
    model = statistics.median(r[1] for r in results)
    print(f"median: page {page:.1f} s, model {model:.1f} s, first example's edit {edit:.2f} s (warm) -> "
          f"first result within {max(page, model) + edit:.1f} s of `python app_gradio.py`")


if __name__ == "__main__":
    main()
