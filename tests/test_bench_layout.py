"""`qie eval-edits --export gedit|imgedit DIR`: the generations in each benchmark's published layout."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from diffsynth_qie.inference.bench_layout import export


def images(n, seed):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)) for _ in range(n)]


def test_gedit_layout(tmp_path):
    src, out = images(2, 0), images(2, 1)
    files = export("gedit", tmp_path, src, ["make it blue", "add a hat"], out,
                   [{"key": "abc", "task_type": "color_alter", "instruction_language": "cn"}, None])
    assert files == [tmp_path / "fullset/color_alter/cn/abc.png", tmp_path / "fullset/custom/en/00001.png"]
    assert np.array_equal(np.asarray(Image.open(files[0])), np.asarray(out[0]))
    assert np.array_equal(np.asarray(Image.open(tmp_path / "fullset/custom/en/00001_SRCIMG.png")), np.asarray(src[1]))


def test_imgedit_layout(tmp_path):
    src, out = images(2, 2), images(2, 3)
    files = export("imgedit", tmp_path, src, ["make it blue", "add a hat"], out, [None, {"edit_type": "add"}])
    assert files == [tmp_path / "00000.png", tmp_path / "00001.png"]
    meta = json.loads((tmp_path / "edit.json").read_text())
    assert meta == {"00000": {"id": "00000.png", "prompt": "make it blue", "edit_type": "custom"},
                    "00001": {"id": "00001.png", "prompt": "add a hat", "edit_type": "add"}}
    for key, item in meta.items():  # each source where the scorer's --origin_img_root/<id> looks
        assert (tmp_path / "sources" / item["id"]).is_file()
    with pytest.raises(ValueError, match="--export 'geditv2'"):
        export("geditv2", tmp_path, src, ["a", "b"], out)
