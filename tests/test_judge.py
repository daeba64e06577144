"""The optional judge: the OpenAI-compatible adapter against a local HTTP server started here (what it sends,
what it parses, that a dead or rambling endpoint yields no score), and EditScore's loader up to the weight load."""
from __future__ import annotations

import logging

import pytest
from PIL import Image

from conftest import chat_server
from diffsynth_qie.metrics import judge as J


@pytest.fixture
def server():
    replies: list = []
    with chat_server(lambda seen: replies.pop(0)) as (url, seen):
        yield url, seen, replies


def test_openai_judge_scores_and_compares_through_the_endpoint(server):
    url, seen, replies = server
    src, out = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    judge = J.OpenAIJudge(url, "editscore", api_key="k")
    replies += ["7.5 - the circle is blue", "B", "twelve out of ten: 12"]
    assert judge.score(src, "make it blue", out) == {"judge": 7.5}
    assert judge.prefer(src, "make it blue", out, src) == 0.0
    assert judge.score(src, "make it blue", out) == {}  # 12 is outside 0-10: no value
    path, auth, body = seen[0]
    assert path == "/v1/chat/completions" and auth == "Bearer k" and body["model"] == "editscore"
    content = body["messages"][0]["content"]
    assert "make it blue" in content[0]["text"] and len(content) == 3
    assert all(c["image_url"]["url"].startswith("data:image/png;base64,") for c in content[1:])
    assert len(seen[1][2]["messages"][0]["content"]) == 4  # source, A, B


def test_a_dead_endpoint_gives_no_score_and_says_so_once(caplog):
    judge = J.OpenAIJudge("http://127.0.0.1:9/v1", "m", timeout=2)
    img = Image.new("RGB", (8, 8))
    with caplog.at_level(logging.WARNING):
        assert judge.score(img, "x", img) == {} and judge.score(img, "x", img) == {}
    assert caplog.text.count("gave no answer") == 1
    with pytest.raises(ValueError, match="http"):
        J.OpenAIJudge("127.0.0.1:8000", "m")


def test_editscore_loads_only_local_files(tmp_path, caplog, monkeypatch):
    with caplog.at_level(logging.WARNING):
        assert J.load_editscore(tmp_path / "base", tmp_path / "lora") is None
    assert "nothing is downloaded" in caplog.text
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text("{}")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    calls = []

    def fake_load(path, **kwargs):  # stands where the 7B weights would load
        calls.append((str(path), kwargs))
        raise OSError("weights not here")

    monkeypatch.setattr(transformers.Qwen2_5_VLForConditionalGeneration, "from_pretrained", fake_load)
    with pytest.raises(OSError, match="weights not here"):
        J.load_editscore(tmp_path / "base", tmp_path / "lora")
    assert calls == [(str(tmp_path / "base"), {"local_files_only": True, "torch_dtype": "auto"})]


def test_parse_score():
    assert J.parse_score("Score: 8") == 8.0 and J.parse_score("none") is None and J.parse_score("-1") is None
