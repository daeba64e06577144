"""What the UI says while and after it works: a queued tab's ETA from measured step times, and messages whose
lists stay lists in a toast."""
from __future__ import annotations

import threading
import time

import pytest

from diffsynth_qie.ui.messages import toast_html
from diffsynth_qie.ui.runner import Where, queue_eta, queued_note, run_variations


def test_a_toast_shows_a_messages_list_as_a_list():
    """Bug 18: the missing-weights toast ran its file list into one paragraph (a toast renders HTML)."""
    message = ("model_dir /m lacks files of the 2511 preset:\n  - dit: x.safetensors of Qwen/Q (looked in /a)\n"
               "  - vae: <vae>.safetensors of Qwen/Q\nDownload it with: modelscope download --model Qwen/Q")
    out = toast_html(message)
    assert out == ("model_dir /m lacks files of the 2511 preset:<br><ul><li>dit: x.safetensors of Qwen/Q (looked in "
                   "/a)</li><li>vae: &lt;vae&gt;.safetensors of Qwen/Q</li></ul>Download it with: modelscope "
                   "download --model Qwen/Q")
    assert toast_html("one line") == "one line"


def test_the_missing_weights_toast_is_a_list(tmp_path):
    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.handlers import GenerateInputs, UIHandlers, user_message
    from PIL import Image

    (tmp_path / "empty").mkdir()
    h = UIHandlers(UIConfig(model="2511", model_dir=str(tmp_path / "empty"), lora_dir=str(tmp_path), examples=""))
    with pytest.raises(FileNotFoundError) as info:
        h.generate(GenerateInputs(editor={"background": Image.new("RGB", (32, 32)), "layers": []}, prompt="x"))
    shown = toast_html(user_message(info.value))
    assert shown.count("<li>") >= 2 and "<ul>" in shown and "modelscope download" in shown


def test_queue_eta_comes_from_the_running_jobs_measured_steps():
    assert queue_eta(0, None, None) == 0.0 and queued_note(0, 0.0) is None
    where = Where(total=2, steps=10, variation=1, step=4, steps_done=4)
    where.started = time.perf_counter() - 2.0  # 4 steps in 2 s: 0.5 s a step, 6 + 10 steps left
    assert queue_eta(1, where, None) == pytest.approx(8.0, abs=0.2)
    assert queue_eta(3, where, 5.0) == pytest.approx(18.0, abs=0.2)  # and two whole runs of 5 s queued
    assert queue_eta(2, where, None) is None and queue_eta(1, Where(total=1, steps=10), None) is None
    assert queued_note(2, 18.2) == "Queued behind 2 generations of other tabs, about 18 s (from measured step times)."
    assert "when that one ends" in queued_note(1, None)


def test_the_handlers_follow_a_run_for_the_eta(tmp_path):
    """While a generation runs, a tab that queues gets its time left; afterwards the last run's time is kept."""
    seen = []

    def edit(seed, step):
        for i in range(1, 4):
            step(i, 3)
            seen.append(where.seconds_left())
        return seed

    where = Where(total=2, steps=3)
    results, stopped = run_variations([1, 2], edit, 3, threading.Event(), lambda *a: None, where)
    assert [s for s, _ in results] == [1, 2] and stopped is None
    assert all(s is not None for s in seen) and seen[-1] == pytest.approx(0.0, abs=1e-6)


def test_precheck_says_queued_with_an_eta(tmp_path):
    pytest.importorskip("gradio")
    from types import SimpleNamespace

    from PIL import Image

    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.events import Callbacks
    from diffsynth_qie.ui.handlers import UIHandlers

    h = UIHandlers(UIConfig(lora_dir=str(tmp_path), examples=""))
    cb = Callbacks(h)
    values = {"editor": {"background": Image.new("RGB", (32, 32)), "layers": []}, "prompt": "x"}
    cb.inputs = lambda v: __import__("diffsynth_qie.ui.job", fromlist=["GenerateInputs"]).GenerateInputs(**values)
    _, _, note = cb.precheck({}, SimpleNamespace(session_hash="a"))
    assert note == {"__type__": "update"}  # nothing ahead: the status is left alone
    h.where = Where(total=1, steps=10, variation=1, step=5, steps_done=5)
    h.where.started = time.perf_counter() - 5.0
    _, _, note = cb.precheck({}, SimpleNamespace(session_hash="b"))
    assert note.startswith("Queued behind 1 generation of another tab, about 5 s")
