"""The mask preview and box tool, Stop's immediate answer, the per-family examples label, housekeeping of the
temp folder, and ``qie edit`` PNGs that the UI reads back."""
from __future__ import annotations

import logging
import os
import shlex
import time
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from diffsynth_qie.ui import mask_preview, masks
from diffsynth_qie.ui.config import UIConfig
from diffsynth_qie.ui.handlers import UIHandlers
from diffsynth_qie.ui.uploads import UIError


def _image(size=(40, 20)):
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def test_preview_is_the_mask_generate_uses(tmp_path):
    """The preview's share is that of the mask Generate builds (paint ∪ file, invert, grow); kept pixels dimmed."""
    image = _image()
    painted = Image.new("L", image.size, 0)
    painted.paste(255, (0, 0, 10, 10))
    shown, line = mask_preview.preview(image, painted, None, False, 0, 0)
    assert "12.5 %" in line and shown.size == image.size
    assert np.array_equal(np.asarray(shown)[:10, :10], np.asarray(image)[:10, :10])   # the editable part as it is
    assert (np.asarray(shown)[:, 20:].astype(int).sum() < np.asarray(image)[:, 20:].astype(int).sum())  # dimmed
    _, line = mask_preview.preview(image, painted, None, True, 0, 0)
    assert "87.5 %" in line and "inverted" in line
    _, line = mask_preview.preview(image, painted, None, False, 2, 1.5)
    assert "18.0 %" in line and "grown 2 px" in line and "feathered 1.5 px" in line  # 12x12 of 800
    _, line = mask_preview.preview(image, None, None, False, 0, 0)
    assert "whole image" in line
    with pytest.raises(UIError, match="Invert mask"):
        mask_preview.preview(image, None, None, True, 0, 0)


def test_box_tool_adds_rectangles_to_the_mask_file(tmp_path):
    path, line = mask_preview.box_from_drag("12.4,8.6,3,4,1700000000", None, (40, 20), tmp_path)
    box = np.asarray(Image.open(path)) > 0
    assert box.sum() == 10 * 6 and box[4:10, 3:13].all() and "(3, 4)–(12, 9)" in line
    path2, _ = mask_preview.box_from_drag("30,15,99,99", path, (40, 20), tmp_path)  # added, clipped to the image
    both = np.asarray(Image.open(path2)) > 0
    assert both.sum() == 60 + 50 and both[15:, 30:].all()
    with pytest.raises(UIError, match="load an image"):
        mask_preview.box_from_drag("1,1,2,2", None, None, tmp_path)
    with pytest.raises(UIError, match="not four numbers"):
        mask_preview.box_from_drag("1,a,2,2", None, (40, 20), tmp_path)


def test_stop_says_at_once_whether_it_stops_a_run_or_a_queued_job(tmp_path):
    pytest.importorskip("gradio")
    from diffsynth_qie.ui.events import Callbacks

    cb = Callbacks(UIHandlers(UIConfig(lora_dir=str(tmp_path), examples="")))
    tab = SimpleNamespace(session_hash="tab-1")
    assert not isinstance(cb.stop(tab), str)  # nothing of this tab queued or running: the status stays
    cb._pending.add("tab-1")
    assert "will not run" in cb.stop(tab)     # queued behind another tab's generation
    cb.h._running = "tab-1"
    # running: the stop is requested and the running generation says "Stopping…" itself (ui/live.py), so that
    # word cannot reach the page after the stopped run's last one
    assert not isinstance(cb.stop(tab), str) and cb.h.stopping("tab-1") and not cb.h.stopping("tab-2")


def test_examples_label_follows_the_family():
    from diffsynth_qie.ui.examples import examples_label

    assert "held-out rows" in examples_label("tiny")
    assert "Qwen-Image-2.1 was not trained on them" in examples_label("tiny-2.1")


def test_pruning_removes_empty_folders_and_a_bad_editor_value_still_loads(tmp_path):
    from diffsynth_qie.ui.uploads import prune_temp_files

    old = time.time() - 3600
    for name in ("results/a", "results/b/c"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "results/keep").mkdir()
    (tmp_path / "results/keep/f.bin").write_bytes(b"x" * 10)
    for p in [*tmp_path.rglob("*")]:
        os.utime(p, (old, old))
    prune_temp_files(tmp_path, max_bytes=1 << 20)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "results", "results/keep", "results/keep/f.bin"]

    bad = tmp_path / "cut.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n broken")
    record = masks.loaded_record("new.png", {"background": str(bad), "layers": [], "composite": str(bad)})
    assert '"replaced": null' in record and "new.png" in record


def test_client_disconnect_traceback_is_one_info_line(caplog):
    from diffsynth_qie.ui.startup import QuietClientDisconnect

    class ClientDisconnect(Exception):
        pass

    try:
        raise ClientDisconnect()
    except ClientDisconnect:
        import sys
        record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application",
                                   None, sys.exc_info())
    with caplog.at_level(logging.INFO):
        assert QuietClientDisconnect().filter(record) is False
    assert "disconnected during an upload" in caplog.text
    other = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "boom", None, None)
    assert QuietClientDisconnect().filter(other) is True


def test_qie_edit_png_carries_settings_the_ui_restores(tmp_path, tiny_model_dir):
    """A PNG written by `qie edit` has the UI's record: dropped on the UI, its settings come back; its command
    parses back to the same flags."""
    from diffsynth_qie.commands import edit as edit_command
    from diffsynth_qie.ui import restore
    from diffsynth_qie.ui.results import read_extras, read_settings
    import argparse

    image, ref, mask = tmp_path / "in.png", tmp_path / "ref.png", tmp_path / "mask.png"
    _image((32, 32)).save(image)
    _image((32, 32)).save(ref)
    Image.new("L", (32, 32), 255).save(mask)
    parser = argparse.ArgumentParser()
    edit_command.add_arguments(parser)
    out = tmp_path / "out.png"
    args = parser.parse_args(["--model", "tiny", "--model_dir", str(tiny_model_dir), "--image", str(image),
                              "--image", str(ref), "--mask", str(mask), "--prompt", "make it blue", "--steps", "2",
                              "--cfg", "2.5", "--seed", "7", "--mask_feather", "1.5", "--out", str(out),
                              "--device", "cpu"])
    assert edit_command.run(args) == 0
    settings = read_settings(out)
    assert (settings.prompt, settings.steps, settings.cfg, settings.seed, settings.mask_feather, settings.mode) == (
        "make it blue", 2, 2.5, 7, 1.5, "flow")
    files, command = read_extras(out)
    assert files == {"image": str(image), "mask": str(mask), "references": [str(ref)]}
    again = parser.parse_args(shlex.split(command)[2:])
    assert (again.image, again.mask, again.steps, again.cfg, again.seed) == (
        [str(image), str(ref)], str(mask), 2, 2.5, 7)
    restored, _ = restore.from_png(out, tmp_path / "outputs")
    assert restored == settings


def test_width_and_height_round_to_the_model_and_say_so(tmp_path):
    """W×H: 0 is automatic, others round to multiples of 16; one without the other is refused; "Keep the input's
    size" fills both from the editor's image and says when it rounded; the status says why a size changed."""
    pytest.importorskip("gradio")
    from diffsynth_qie.ui import settings as table
    from diffsynth_qie.ui.mask_events import MaskTools
    from diffsynth_qie.ui.outputs import size_notice

    assert [table.output_side(v) for v in (0, None, 1000, 700, 8, 992)] == [0, 0, 992, 704, 16, 992]
    both = SimpleNamespace(width=1000)
    assert table.SETTING["height"].check(700, both) == 704
    with pytest.raises(UIError, match="give both width and height"):
        table.SETTING["height"].check(0, both)
    path = tmp_path / "in.png"
    _image((1000, 700)).save(path)
    tools = MaskTools(UIHandlers(UIConfig(lora_dir=str(tmp_path), examples="", temp_dir=str(tmp_path / "t"))))
    w, h, line = tools.input_size({"background": str(path), "layers": [], "composite": str(path)}, None)
    assert (w, h) == (992, 704) and "rounded from 1000×700" in line
    assert "1000×700" in size_notice((1000, 700), (992, 688), 0) and "automatic" in size_notice((1000, 700),
                                                                                               (992, 688), 0)
