"""The web UI's sessions: a browser session's Generate reads back only the files the UI gave that session (not
another session's, though they lie in the same temp folder), and the gallery handlers called without their event
data answer with a message instead of a server traceback."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from diffsynth_qie.ui.config import UIConfig
from diffsynth_qie.ui.handlers import NO_LORA, GenerateInputs, UIHandlers


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


# --- restore from a PNG, as a crafted PNG can ask -------------------------------------------------------------
def _handlers(tmp_path) -> UIHandlers:
    return UIHandlers(UIConfig(lora_dir=str(tmp_path / "loras"), examples="", temp_dir=str(tmp_path / "t"),
                               outputs_dir=str(tmp_path / "out")))


def _png(path, settings, files=None):
    """A PNG carrying ``settings`` (the JSON text, as given) and ``files`` as this UI writes them."""
    import json

    from PIL.PngImagePlugin import PngInfo

    from diffsynth_qie.ui.results import FILES_KEY, PNG_KEY

    info = PngInfo()
    info.add_text(PNG_KEY, settings if isinstance(settings, str) else json.dumps(settings))
    if files is not None:
        info.add_text(FILES_KEY, json.dumps(files))
    path.parent.mkdir(parents=True, exist_ok=True)
    _photo(0).save(path, pnginfo=info)
    return str(path)


def _settings(**changed):
    from diffsynth_qie.ui.results import EditSettings

    return {**EditSettings(model="tiny", prompt="make it blue").to_json(), **changed}


def _tab(name):
    return SimpleNamespace(session_hash=name)


@pytest.mark.parametrize("settings, words", [
    (_settings(cfg="abc"), "CFG must be a number, got .*abc"),
    (_settings(steps=10 ** 9), "steps must be a whole number in 1..1000"),
    (_settings(mode="warp"), "unknown mode .*warp"),
    ([1, 2, 3], "settings are not a JSON object"),
    ('{"prompt": ', "settings are not"),
])
def test_a_crafted_settings_png_is_one_message_never_a_traceback(tmp_path, settings, words):
    import gradio as gr

    from diffsynth_qie.ui import history as hist
    from diffsynth_qie.ui.events import Callbacks

    h = _handlers(tmp_path)
    png = _png(h.config.resolved_outputs_dir / "run" / "edit_seed0.png", settings)
    (h.config.resolved_outputs_dir / "run" / "before-8x8.png").write_bytes(b"")
    with pytest.raises(gr.Error, match=words):
        Callbacks(h).load_png(png, None, [], request=_tab("a"))
    assert hist.load_saved(h.config.resolved_outputs_dir) == []  # the history skips it too


def test_a_lora_that_is_not_in_the_folder_is_said_not_restored(tmp_path):
    from diffsynth_qie.ui.events import Callbacks
    from diffsynth_qie.ui.settings import RESTORED

    h = _handlers(tmp_path)
    png = _png(tmp_path / "drop" / "result.png", _settings(lora="gone.safetensors", lora_scale=0.5))
    out = Callbacks(h).load_png(png, None, [], request=_tab("a"))
    assert out[RESTORED.index("lora")] == NO_LORA
    assert "LoRA gone.safetensors is not in the LoRA folder: none is picked" in out[-1]


def test_a_png_restores_only_the_files_this_tab_may_read(tmp_path):
    """A PNG naming another tab's input.png brings back the settings alone; the image is neither shown nor given
    to this tab. The tab whose result it is gets it back whole."""
    from diffsynth_qie.ui.events import Callbacks
    from diffsynth_qie.ui.history import HistoryEntry
    from diffsynth_qie.ui.results import EditSettings
    from diffsynth_qie.ui.settings import RESTORED

    h = _handlers(tmp_path)
    theirs = h.config.resolved_outputs_dir / "run-b" / "input.png"  # tab B's input, in the shared outputs folder
    theirs.parent.mkdir(parents=True)
    _photo(3).save(theirs)
    png = _png(tmp_path / "drop" / "crafted.png", _settings(), {"image": str(theirs), "mask": None, "references": []})
    cb = Callbacks(h)
    out = cb.load_png(png, None, [], request=_tab("a"))
    editor = out[len(RESTORED)]
    assert "value" not in editor and str(theirs) not in h.given("a")
    assert "Its image is not one of this tab's results, so the settings alone" in out[-1]
    entry = HistoryEntry(image=str(theirs), before=str(theirs), settings=EditSettings(model="tiny", prompt="x"),
                         input=str(theirs))
    out = cb.load_png(png, None, [entry], request=_tab("b"))
    assert out[len(RESTORED)]["value"]["background"] == str(theirs) and str(theirs) in h.given("b")


@pytest.mark.parametrize("data", [None, {}, {"index": 7}, {"index": "0"}, {"value": 1}, [0]])
def test_gallery_events_called_without_their_event_data_answer_with_a_message(tmp_path, data):
    """As gradio calls them for /restore and /show_variation from the API: with the event's data it was sent."""
    import gradio as gr
    from gradio.helpers import special_args

    from diffsynth_qie.ui.events import Callbacks
    from diffsynth_qie.ui.history import HistoryEntry
    from diffsynth_qie.ui.results import EditSettings

    entry = HistoryEntry(image="a.png", before="a.png", settings=EditSettings(model="tiny", prompt="x"))
    cb = Callbacks(_handlers(tmp_path))
    for fn, inputs in ((cb.restore, [[entry], None]), (cb.show_variation, [[entry]])):
        args, *_ = special_args(fn, list(inputs), request=None, event_data=gr.EventData(None, data))
        with pytest.raises(gr.Error, match="click an entry of the"):
            fn(*args)
