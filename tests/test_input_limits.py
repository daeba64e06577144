"""Inputs that would cost unbounded resources are refused where they enter: cache, edit, UI.

- prompts over ``--max_prompt_tokens`` tokens (a pasted document makes every step slower);
- images whose header declares more than ``MAX_IMAGE_PIXELS`` (checked before decoding);
- images smaller than the resize divisor (they would have to be enlarged).
"""
from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image, ImageFile

from diffsynth_qie.cache.writer import CacheConfig, prepare_row, write_cache
from diffsynth_qie.data import DatasetConfig
from diffsynth_qie.data.images import MAX_IMAGE_PIXELS, ImageTooLarge, fit_image, load_mask, load_rgb
from diffsynth_qie.models.prompts import prompt_token_count
from diffsynth_qie.models.qwen_image_edit.encoding import encode_prompt
from diffsynth_qie.models.presets import DEFAULT_MAX_PROMPT_TOKENS

LONG_PROMPT = "make the red circle blue and " * 400  # thousands of tokens


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG that declares ``width`` x ``height`` (8-bit gray) in a few dozen bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


@pytest.fixture
def no_decoding(monkeypatch):
    """Fail the test if any image is decoded (the limit must act on the header)."""
    def refuse(self, *a, **k):
        raise AssertionError(f"decoded a {self.size} image before checking its size")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


# ---------------------------------------------------------------- pixel limit, before decoding
@pytest.mark.parametrize("side", [12000, 20000])  # 20000^2 is beyond PIL's own bomb limit too
def test_huge_image_refused_from_header(tmp_path, no_decoding, side):
    path = png_header_only(tmp_path / "bomb.png", side, side)
    assert path.stat().st_size < 1000 and side * side > MAX_IMAGE_PIXELS
    for loader in (load_rgb, load_mask):
        with pytest.raises(ImageTooLarge, match="bomb.png.*downscale"):
            loader(path)


# ---------------------------------------------------------------- tiny images are never enlarged
def test_tiny_image_is_refused_naming_the_minimum(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=r"1x1 pixels; images need at least 16 pixels"):
        fit_image((1, 1), 1024 * 1024, 16)
    assert fit_image((16, 20), 1024 * 1024, 16) == (16, 16)  # at the minimum: trimmed, not enlarged

    from diffsynth_qie.data.rows import EditRow
    from diffsynth_qie.models.family_ops import ops_for
    Image.new("RGB", (1, 1), "red").save(tmp_path / "dot.png")
    Image.new("RGB", (64, 64), "red").save(tmp_path / "src.png")
    row = EditRow(row_id="r0", target=tmp_path / "dot.png", edit_images=[tmp_path / "src.png"], prompts=["x"])
    with pytest.raises(ValueError, match=r"dot\.png is 1x1 pixels.*at least 16"):
        prepare_row(row, CacheConfig(max_pixels=128 * 128), ops_for("qwen-image-edit"))

    from diffsynth_qie.inference.editor import EditRequest, output_size, reference_size
    dot = Image.new("RGB", (1, 1), "red")
    with pytest.raises(ValueError, match="at least 16 pixels"):
        output_size(EditRequest(images=[dot], prompt="x"), dot)
    with pytest.raises(ValueError, match="at least 16 pixels"):
        reference_size(dot, None)


# ---------------------------------------------------------------- prompt tokens
def test_prompt_token_cap(tiny_pipe):
    n = prompt_token_count(tiny_pipe, LONG_PROMPT)
    assert n > DEFAULT_MAX_PROMPT_TOKENS
    with pytest.raises(ValueError, match=rf"{n} tokens .*limit of {DEFAULT_MAX_PROMPT_TOKENS}.*--max_prompt_tokens"):
        encode_prompt(tiny_pipe, LONG_PROMPT)
    emb = encode_prompt(tiny_pipe, LONG_PROMPT, max_tokens=n)  # the flag raises the cap
    assert emb.shape[0] >= n


def test_editor_refuses_long_prompt_before_encoding(tiny_pipe, monkeypatch):
    from diffsynth_qie.inference.editor import EditRequest, Editor

    calls = []
    monkeypatch.setattr(tiny_pipe.text_encoder, "forward", lambda *a, **k: calls.append(1))
    editor = Editor(tiny_pipe)
    image = Image.new("RGB", (64, 64), "red")
    with pytest.raises(ValueError, match="--max_prompt_tokens"):
        editor.edit(EditRequest(images=[image], prompt=LONG_PROMPT, steps=1))
    with pytest.raises(ValueError, match="--max_prompt_tokens"):
        editor.edit(EditRequest(images=[image], prompt="x", negative_prompt=LONG_PROMPT, steps=1))
    assert calls == []


def test_cache_skips_rows_with_long_prompts(tmp_path, demo_data_dir, tiny_pipe, tiny_model_dir):
    src = Path(demo_data_dir)
    shutil.copytree(src / "images", tmp_path / "data" / "images")
    rows = json.loads((src / "metadata.json").read_text())[:2]
    for i, r in enumerate(rows):
        r["id"] = f"row{i}"
    rows[1]["prompt"] = LONG_PROMPT
    (tmp_path / "data" / "metadata.json").write_text(json.dumps(rows))
    cache_dir = tmp_path / "cache"
    config = CacheConfig(cache_dir=str(cache_dir), model="tiny", model_dir=str(tiny_model_dir),
                         max_pixels=64 * 64, device="cpu", dtype="float32", num_workers=1,
                         dataset=DatasetConfig(dataset_metadata=str(tmp_path / "data" / "metadata.json"),
                                               max_bad_fraction=0.5))
    summary = write_cache(config, pipe=tiny_pipe)
    assert (summary.computed, summary.skipped) == (1, 1)
    skipped = [json.loads(line) for line in (cache_dir / "skipped.jsonl").read_text().splitlines()]
    assert [(s["row_id"], s["field"]) for s in skipped] == [("row1", "prompts")]
    assert "--max_prompt_tokens 1024" in skipped[0]["reason"]
    assert [e["id"] for e in summary.manifest["entries"]] == ["row0"]

    # raising the cap caches the row
    config.max_prompt_tokens = 100_000
    summary = write_cache(config, pipe=tiny_pipe)
    assert summary.skipped == 0 and summary.computed == 1 and summary.reused == 1


def test_edit_command_has_the_flag():
    import argparse

    from diffsynth_qie.commands.edit import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", "o.png"])
    assert args.max_prompt_tokens == DEFAULT_MAX_PROMPT_TOKENS
    assert parser.parse_args(["--out", "o.png", "--max_prompt_tokens", "4096"]).max_prompt_tokens == 4096
