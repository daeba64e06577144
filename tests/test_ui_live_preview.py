"""The UI's live preview: Generate's event is a generator whose yields put the editor's previews into the result
slider while the generation still runs; the last yield is the result (or, after a Stop or failure, the last result
back in place of the preview)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from diffsynth_qie.ui.config import UIConfig
from diffsynth_qie.ui.handlers import GenerateInputs, UIHandlers

W, H = 64, 48


class BlockingEditor:
    """Sends one preview, then waits for the test (the generation is still running), then finishes or fails."""

    def __init__(self, fail: BaseException | None = None):
        self.release, self.requests, self.fail = threading.Event(), [], fail
        self.preview = Image.new("RGB", (W, H), (0, 200, 0))

    def set_loras(self, loras):
        pass

    def edit(self, request):
        self.requests.append(request)
        request.progress(1, 4)
        request.preview(2, 4, self.preview)
        assert self.release.wait(10), "the test never saw the preview while the generation ran"
        if self.fail is not None:
            raise self.fail
        return SimpleNamespace(image=Image.new("RGB", (W, H), (200, 0, 0)), sub_image=None)


def _values(run, cb, **given):
    painted = np.zeros((H, W, 4), np.uint8)
    painted[4:20, 4:30] = (255, 0, 255, 255)
    settings = dict(GenerateInputs(editor={"background": Image.new("RGB", (W, H), (30, 60, 90)),
                                           "layers": [Image.fromarray(painted, "RGBA")], "composite": None},
                                   prompt="turn it green").__dict__, steps=4, **given)
    states = {"history": [], "queued_at": None, "current": None}
    return {c: {**settings, **states}[cb._names[c]] for c in run.inputs}


@pytest.fixture
def demo_run(tmp_path):
    pytest.importorskip("gradio")
    from diffsynth_qie.ui.app import build_ui

    def make(fake):
        h = UIHandlers(UIConfig(lora_dir=str(tmp_path), examples="", temp_dir=str(tmp_path / "t"),
                                outputs_dir=str(tmp_path / "o")), editor_factory=lambda: fake)
        demo = build_ui(h)
        (run,) = [f for f in demo.fns.values() if f.name == "run"]
        slot = [getattr(c, "elem_id", None) for c in run.outputs].index("result")
        return run, run.fn.__self__, slot
    return make


def _is_preview(frame, slot, fake):
    value = frame[slot]["value"]
    return isinstance(value, tuple) and np.array_equal(np.asarray(value[1]), np.asarray(fake.preview)) and \
        value[0].size == fake.preview.size


def test_the_preview_reaches_the_result_slider_while_the_generation_runs(demo_run):
    fake = BlockingEditor()
    run, cb, slot = demo_run(fake)
    frames = run.fn(_values(run, cb, live_preview=2), None, lambda *a, **k: None)
    first = next(frames)  # the editor is still waiting: this came while it ran
    assert not fake.release.is_set() and fake.requests[0].preview_every == 2
    assert _is_preview(first, slot, fake), first[slot]
    assert all(v == {"__type__": "update"} for i, v in enumerate(first) if i != slot)  # nothing else changes yet
    fake.release.set()
    *_, last = frames
    assert last[slot][1].endswith(".png") and "Done in" in last[slot + 6]  # the result, then its status


@pytest.mark.parametrize("fail", ["stop", "error"])
def test_a_stop_or_failure_after_a_preview_puts_the_last_result_back(demo_run, fail):
    from diffsynth_qie.ui.handlers import Stopped

    fake = BlockingEditor(Stopped("Stopped at step 2 of variation 1/1") if fail == "stop" else RuntimeError("boom"))
    run, cb, slot = demo_run(fake)
    frames = run.fn(_values(run, cb, live_preview=2), None, lambda *a, **k: None)
    assert _is_preview(next(frames), slot, fake)
    fake.release.set()
    *_, last = frames
    assert last[slot] == {"__type__": "update", "value": None}  # no result before this one: the slider is emptied
    assert last[slot + 6].startswith("Stopped at step 1 of variation 1/1" if fail == "stop" else "Failed: internal error")


def test_no_preview_is_asked_for_when_off(demo_run):
    fake = BlockingEditor()
    fake.release.set()
    fake.edit = lambda request: (fake.requests.append(request),
                                 SimpleNamespace(image=Image.new("RGB", (W, H)), sub_image=None))[1]
    run, cb, slot = demo_run(fake)
    frames = list(run.fn(_values(run, cb, live_preview=0), None, lambda *a, **k: None))
    assert len(frames) == 1 and fake.requests[0].preview_every == 0 and fake.requests[0].preview is None


def test_previews_of_the_tiny_model_come_every_n_steps(tiny_model_dir, tmp_path):
    """The real editor through the handlers: 5 steps, a preview every 2: steps 2 and 4, at the result's size."""
    h = UIHandlers(UIConfig(model="tiny", model_dir=str(tiny_model_dir), lora_dir=str(tmp_path), device="cpu",
                            examples="", temp_dir=str(tmp_path / "t"), outputs_dir=str(tmp_path / "o")))
    seen = []
    inputs = GenerateInputs(editor={"background": Image.new("RGB", (W, H), (30, 60, 90)), "layers": []},
                            prompt="turn it green", steps=5, cfg=2.0, live_preview=2)
    out = h.generate(inputs, preview=lambda before, image: seen.append((before.size, image.size)))
    assert seen == [((W, H), out.image.size)] * 2


def test_a_stop_is_announced_by_the_stream_itself_before_its_last_word():
    """The running generation's "Stopping…" comes from its own generator, so it is always before the final status."""
    from diffsynth_qie.ui import live

    stop, seen = threading.Event(), []

    def work(progress, preview):
        for step in range(1, 1000):
            if stop.is_set():
                return "stopped at step %d" % step
            progress(step, 1000, "")
            threading.Event().wait(0.01)
        return "finished"

    frames = live.stream(work, lambda *a: None, lambda b, i: ("preview",), lambda: None, stop.is_set,
                         lambda: ("stopping",))
    threading.Timer(0.2, stop.set).start()
    try:
        while True:
            seen.append(next(frames))
    except StopIteration as end:
        result = end.value
    assert seen == [("stopping",)] and result.startswith("stopped at step")
