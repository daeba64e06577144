"""CLIP directional similarity with a tiny CLIP built and saved here (the path a real local model takes, up to
where a download would start): the known answers (the image change along the text change: +1; against it: -1;
no image change: 0), and a missing model makes the field absent with one logged line."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from PIL import Image

from diffsynth_qie.metrics import clip_direction as C

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    d = tmp_path_factory.mktemp("clip")
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [256 + i for i in range(256 - len(printable))]  # GPT-2's byte -> unicode table
    chars = [chr(c) for c in printable + extra]
    vocab = {t: i for i, t in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(d / "vocab.json"), str(d / "merges.txt"))
    image = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=77,
                                      bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"]),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                        image_size=32, patch_size=8), projection_dim=16)
    CLIPModel(cfg).save_pretrained(d)
    CLIPProcessor(image_processor=image, tokenizer=tok).save_pretrained(d)
    return d


def test_direction_has_the_known_answers(tiny_clip):
    clip = C.load_clip(tiny_clip)
    red, blue = Image.new("RGB", (40, 40), (220, 20, 20)), Image.new("RGB", (40, 40), (20, 20, 220))
    same = C.clip_direction(clip, [red], [red], ["make it blue"])
    assert same.abs().item() < 1e-6                                   # no image change: no direction
    # the text change from "make it blue" back to "" is exactly the opposite direction
    fwd = C.clip_direction(clip, [red], [blue], ["make it blue"])
    back = C.clip_direction(clip, [red], [blue], [""], before=["make it blue"])
    assert fwd.item() == pytest.approx(-back.item(), abs=1e-5) and -1 <= fwd.item() <= 1
    swapped = C.clip_direction(clip, [blue], [red], ["make it blue"])
    assert swapped.item() == pytest.approx(-fwd.item(), abs=1e-5)   # the image change reversed
    both = C.clip_direction(clip, [red, blue], [blue, red], ["make it blue"] * 2)
    assert both.tolist() == pytest.approx([fwd.item(), swapped.item()], abs=1e-5)


def test_a_missing_clip_model_is_absent_and_said_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert C.load_clip(tmp_path / "nope") is None and C.load_clip(tmp_path / "nope") is None
    assert caplog.text.count("skipping clip_direction") == 1 and "nothing is downloaded" in caplog.text
