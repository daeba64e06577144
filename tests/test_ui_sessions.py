"""The web UI's sessions: a browser session's Generate reads back only the files the UI gave that session (not
another session's, though they lie in the same temp folder), and the gallery handlers called without their event
data answer with a message instead of a server traceback."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from diffsynth_qie.ui.config import UIConfig
from diffsynth_qie.ui.handlers import GenerateInputs, UIHandlers


def _photo(seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), "RGB")


def test_a_session_reads_back_only_its_own_files(tmp_path):
    from diffsynth_qie.ui import masks

    h = UIHandlers(UIConfig(lora_dir=str(tmp_path), examples="", temp_dir=str(tmp_path / "t")))
    theirs = h.config.resolved_temp_dir / "results" / "b.png"  # session B's result, in the shared temp folder
    theirs.parent.mkdir(parents=True)
    _photo(2).save(theirs)
    h.give("session-b", str(theirs))
    stale = {"background": _photo(1), "layers": []}
    crafted = GenerateInputs(editor=stale, prompt="x", loaded_image=masks.loaded_record(str(theirs), stale))
    job = h.check(crafted, "session-a")  # session A names B's file: ignored, A's own editor image is used
    assert np.array_equal(np.asarray(job.image), np.asarray(_photo(1)))
    job = h.check(crafted, "session-b")  # B's own file
    assert np.array_equal(np.asarray(job.image), np.asarray(_photo(2)))


@pytest.mark.parametrize("evt", [None, SimpleNamespace(index=3), SimpleNamespace(index=None)])
def test_gallery_handlers_without_their_event_answer_with_a_message(evt, tmp_path):
    import gradio as gr

    from diffsynth_qie.ui.events import Callbacks

    events = Callbacks(UIHandlers(UIConfig(lora_dir=str(tmp_path), examples="", temp_dir=str(tmp_path / "t"))))
    for handler, where in ((events.restore, "history"), (events.show_variation, "variations")):
        with pytest.raises(gr.Error, match=f"click an entry of the {where}"):
            handler([], evt=evt)
        with pytest.raises(gr.Error, match=f"click an entry of the {where}"):
            handler(None, evt=evt)
