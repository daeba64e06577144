"""The judge gives a score or none, never a wrong one: each reply format read from where it puts the score (the
replies a reasoning or EditScore-style judge really gives), and the client against a stand-in server on 127.0.0.1
per format with verbose, JSON, truncated, 500, 429 and slow replies; a dead judge detected once (stop, or go on
without it); EditScore's loader up to the weight load."""
from __future__ import annotations

import logging
import math
import time

import pytest
from PIL import Image

from conftest import chat_server
from diffsynth_qie.metrics import judge as J
from diffsynth_qie.metrics.judge_config import JudgeConfig
from diffsynth_qie.metrics.judge_formats import format_named
from diffsynth_qie.metrics.judge_spec import build_judge, parse_spec

SRC, OUT = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
FAST = JudgeConfig(judge_timeout=0.5, judge_retries=0)


def _read(fmt: str, *replies: str):
    return format_named(fmt).read(list(replies)).scores.get("judge")


@pytest.mark.parametrize("reply,expected", [
    ("In image 2 the red circle became blue. Score: 8/10", 8.0),        # the first number (2) is no score
    ("Step 1 of 2: the circle turned blue.\nStep 2 of 2: nothing else moved.\n**Score:** 9", 9.0),
    ("<think>At first I would say Score: 3, but the circle is blue.</think>\nScore: 7", 7.0),
    ('{"reasoning": "blue, as asked", "score": 6}', 6.0),
    ("Score: 4/5", 8.0),                                                  # a scale of its own, rescaled to 0-10
    ("7.5", 7.5),
    ("The score = 3 out of 10.", 3.0),
    ('Step 1 of 2: the circle turned blue … {"score": [9, 8]}', None),   # two numbers where one is asked
    ("Score: 12/10", None),                                               # outside its own scale
    ("The circle is blue, 1 of 2 edits done, I rate it highly.", None),  # no score where the format puts it
    ("<think>The circle is blue. Score: 8", None),                        # cut while reasoning
    ("Score: 8 for colour, but the shape... Overall: good", 8.0),         # the last score field wins
])
def test_the_number_format_reads_the_score_where_it_is_stated(reply, expected):
    assert _read("number", reply) == expected


def test_the_paired_formats_read_the_json_scores_on_their_scale():
    semantic = 'The circle turned blue and nothing else moved.\n{"reasoning": "done as asked", "score": [20, 25]}'
    quality = '{\n"reasoning" : "natural, with a "soft" edge",\n"score" : [25, 15]\n}'  # broken JSON: its field
    scores = format_named("editscore").read([semantic, quality]).scores
    assert scores == pytest.approx({"judge_semantic": 8.0, "judge_quality": 6.0, "judge": math.sqrt(48)})
    assert _read("viescore", '{"score": [8, 9]}', '{"score": [10, 6]}') == pytest.approx(math.sqrt(8 * 6))
    assert _read("viescore", '{"score": [8, 19]}', '{"score": [10, 6]}') is None  # 19 is outside 0-10
    assert _read("editscore", '{"score": [8, 19]}', "natural, no artifacts") is None  # the quality reply has none
    assert _read("editscore", "Score: 1", '{"score": [10, 6]}') == pytest.approx(math.sqrt(0.4 * 2.4))
    reading = format_named("viescore").read(['{"score": "high"}', '{"score": [1, 1]}'])
    assert reading.scores == {} and reading.bad == 0 and "not a number" in reading.why


@pytest.mark.parametrize("fmt,replies,expected,asked", [
    ("number", ["I compared both images carefully.\nStep 1: blue. Step 2: kept.\nScore: 8/10"], {"judge": 8.0},
     [2]),
    ("viescore", ['{"reasoning": "ok", "score": [8, 9]}', '{"reasoning": "ok", "score": [10, 2]}'],
     {"judge": 4.0, "judge_semantic": 8.0, "judge_quality": 2.0}, [2, 1]),
    ("editscore", ['{"reasoning": "ok", "score": [25, 20]}', '{"reasoning": "ok", "score": [11.25, 25]}'],
     {"judge": 6.0, "judge_semantic": 8.0, "judge_quality": 4.5}, [2, 1]),
])
def test_each_format_through_a_standin_server(fmt, replies, expected, asked):
    queue = list(replies)
    with chat_server(lambda seen: queue.pop(0)) as (url, seen):
        judge = J.OpenAIJudge(url, "m", format_named(fmt), JudgeConfig(judge_max_tokens=777), api_key="k")
        assert judge.score(SRC, "make it blue", OUT) == pytest.approx(expected)
    assert [len(body["messages"][0]["content"]) - 1 for *_, body in seen] == asked  # images per request
    path, auth, body = seen[0]
    assert path == "/v1/chat/completions" and auth == "Bearer k" and body["max_tokens"] == 777
    assert "make it blue" in body["messages"][0]["content"][0]["text"]
    assert all(c["image_url"]["url"].startswith("data:image/png;base64,") for c in body["messages"][0]["content"][1:])
    if fmt == "editscore":
        assert "0 to 25" in body["messages"][0]["content"][0]["text"]  # EditScore's scale, asked


def test_truncated_html_and_unreadable_replies_give_no_score_and_one_quoted_line(caplog):
    answers = [{"content": "Score: 3 so far, and the", "finish_reason": "length"},
               {"body": b"<html><body>Bad gateway</body></html>"},
               "The circle is blue and I rate it 1 of the best."]
    with chat_server(lambda seen: answers[len(seen) - 1]) as (url, seen):
        judge = J.OpenAIJudge(url, "m", format_named("number"), FAST)
        with caplog.at_level(logging.WARNING):
            assert [judge.score(SRC, "x", OUT, f"row {i}") for i in range(3)] == [{}, {}, {}]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "row 0" in lines[0] and "cut at --judge_max_tokens" in lines[0]
    assert "no chat completion" in lines[1] and "'The circle is blue and I rate it 1 of the best.'" in lines[2]
    assert [label for label, _ in judge.take_unscored()] == ["row 0", "row 1", "row 2"] and not judge.take_unscored()


def test_429_and_500_are_tried_again_and_a_slow_reply_ends_at_the_timeout():
    answers = [{"status": 429, "headers": {"Retry-After": "0"}}, {"status": 500}, "Score: 6",
               {"delay": 30, "content": "Score: 1"}, "Score: 9"]
    with chat_server(lambda seen: answers[len(seen) - 1]) as (url, seen):
        config = JudgeConfig(judge_timeout=0.4, judge_retries=2)
        judge = J.OpenAIJudge(url, "m", format_named("number"), config, backoff=0.01)
        assert judge.score(SRC, "x", OUT) == {"judge": 6.0} and len(seen) == 3
        started = time.monotonic()
        assert judge.score(SRC, "x", OUT) == {"judge": 9.0}  # the slow answer was given up at 0.4 s, then retried
        assert time.monotonic() - started < 3.0 and len(seen) == 5
        once = J.OpenAIJudge(url, "m", format_named("number"), JudgeConfig(judge_timeout=0.3, judge_retries=0))
        answers.append({"delay": 30})
        started = time.monotonic()
        assert once.assess(SRC, "x", OUT).why.startswith("no complete answer within 0.3 s")
        assert time.monotonic() - started < 2.0


def test_requests_run_at_most_judge_workers_at_once():
    with chat_server(lambda seen: {"delay": 0.3, "content": "Score: 5"}) as (url, seen):
        judge = J.OpenAIJudge(url, "m", format_named("number"), JudgeConfig(judge_workers=3))
        started = time.monotonic()
        verdicts = judge.assess_many([(SRC, "x", OUT, f"r{i}") for i in range(6)])
        took = time.monotonic() - started
    assert [v.scores for v in verdicts] == [{"judge": 5.0}] * 6
    assert seen.active == 3 and took < 6 * 0.3  # three at once, never more


def test_a_dead_judge_is_found_once_and_stops_the_run_or_is_left_out(caplog):
    dead = "http://127.0.0.1:9/v1#m"  # nothing listens there
    with pytest.raises(J.JudgeDown, match="does not answer.*--judge_on_dead skip"):
        build_judge(dead, "--judge", FAST)
    with caplog.at_level(logging.WARNING):
        assert build_judge(dead, "--judge", JudgeConfig(judge_timeout=0.5, judge_on_dead="skip")) is None
    assert "going on without it" in caplog.text
    with chat_server(lambda seen: {"status": 503}) as (url, seen):  # answers, then fails every request
        judge = J.OpenAIJudge(url, "m", format_named("number"), FAST)
        for i in range(J.DEAD_AFTER - 1):
            assert judge.score(SRC, "x", OUT) == {}
        with pytest.raises(J.JudgeDown, match=r"3 requests in a row failed, the last: HTTP 503"):
            judge.score(SRC, "x", OUT)
        with pytest.raises(J.JudgeDown):  # and at once from then on
            judge.score(SRC, "x", OUT)
        assert len(seen) == J.DEAD_AFTER
        skip = J.OpenAIJudge(url, "m", format_named("number"), JudgeConfig(judge_retries=0, judge_on_dead="skip"))
        verdicts = skip.assess_many([(SRC, "x", OUT, f"row {i}") for i in range(10)])
        assert all(v.scores == {} for v in verdicts) and len(seen) <= 2 * J.DEAD_AFTER + 3  # (3 were in flight)
        missed = skip.take_unscored()
        assert len(missed) == 10 and "row 9" in J.unscored_line("--judge", missed, 10, limit=10)


def test_an_endpoint_that_serves_another_model_is_refused_by_name():
    with chat_server(lambda seen: "Score: 1", models=["EditScore-7B"]) as (url, seen):
        with pytest.raises(ValueError, match="serves EditScore-7B, not 'Qwen2.5-VL'"):
            build_judge(f"{url}#Qwen2.5-VL", "--val_judge")
        judge = build_judge(f"{url}#EditScore-7B", "--val_judge")
        assert judge.format.name == "editscore" and not seen  # the format its name says; the check asked nothing


def test_spec_names_the_format_and_refuses_an_unknown_one():
    assert parse_spec("http://h:1/v1#m#viescore").format == "viescore"
    assert parse_spec("http://h:1/v1#m").format is None and format_named(None, "qwen-vl").name == "number"
    with pytest.raises(ValueError, match="reply format 'json' is unknown.*editscore, viescore, number"):
        parse_spec("http://h:1/v1#m#json")
    with pytest.raises(ValueError, match="http"):
        J.OpenAIJudge("127.0.0.1:8000", "m", format_named("number"))


def test_prefer_compares_the_two_scores():
    replies = iter(["Score: 4", "Score: 8", "Score: 5", "none"])
    with chat_server(lambda seen: next(replies)) as (url, seen):
        judge = J.OpenAIJudge(url, "m", format_named("number"), FAST)
        assert judge.prefer(SRC, "x", OUT, SRC) == 0.0 and judge.prefer(SRC, "x", OUT, SRC) is None


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


def test_a_hanging_judge_cannot_stall_eval_edits_past_its_timeout(caplog):
    """Round 5, medium 2: a judge that never answers costs --judge_timeout per request, asked --judge_workers at
    once, and the rows it could not score are named at the end; the edits and their scorecard are all there."""
    from types import SimpleNamespace

    from diffsynth_qie.inference.evaluate import EvalCase, evaluate

    class Editor:  # the edit itself is not what is tested: the source, bluer
        def edit(self, request):
            return SimpleNamespace(image=Image.blend(request.images[0], OUT, 0.5), sub_image=None, cache=None)

    cases = [EvalCase(images=[SRC], prompt=f"make it blue {i}", target=None, extra={"key": f"k{i}"})
             for i in range(4)]
    with chat_server(lambda seen: {"delay": 60, "content": "Score: 9"}) as (url, seen):
        judge = J.OpenAIJudge(url, "m", format_named("number"),
                              JudgeConfig(judge_timeout=0.3, judge_retries=0, judge_on_dead="skip"))
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            report = evaluate(Editor(), cases, judge=judge, column="lora", steps=1)
        took = time.monotonic() - started
    assert took < 10 and len(report.scores) == 4 and all("judge" not in row and "shift_px" in row
                                                          for row in report.scores)
    assert len(seen) == 4  # one request per row, the four at once
    (line,) = [r.getMessage() for r in caplog.records if "row(s) got no score" in r.getMessage()]
    assert "4 of 4" in line and all(f"lora row k{i}" in line for i in range(4)) and "within 0.3 s" in line
