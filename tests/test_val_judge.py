"""`qie train --val_judge SPEC`: every validation output with a source is scored by the judge (a local
OpenAI-compatible server here) with its row's instruction; the score is in scores.jsonl and its mean is
``val_judge`` beside the other validation metrics; a bad spec is refused when the flags are parsed."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import chat_server
from test_validation import cache_dir, run_config, store, training_module, validator  # noqa: F401 (fixtures)


@pytest.fixture
def judge_url():
    """Answers the first four requests (two validations of two outputs), then never (past the test's timeout)."""
    with chat_server(lambda seen: str(2 * len(seen)) if len(seen) <= 4 else {"delay": 60}) as served:
        yield served


def test_validation_logs_the_judges_scores(store, tiny_pipe, tiny_model_dir, tmp_path, judge_url,  # noqa: F811
                                           caplog):
    """... and a judge that stops answering costs a validation one --judge_timeout, naming the outputs."""
    import logging
    import time

    from diffsynth_qie.metrics.judge_config import JudgeConfig
    from diffsynth_qie.training.validation_metrics import read_scores

    url, requests = judge_url
    config = run_config("sft")
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, val_judge=f"{url}#judge-m"),
                                 judge=JudgeConfig(judge_timeout=0.5, judge_retries=0))
    module = training_module(tiny_pipe.dit, config)
    v = validator(store, [0, 2], tmp_path, tiny_model_dir, steps=2, cfg=1.0)
    v.run(3, module, torch.device("cpu"), torch.float32)
    rows = read_scores(tmp_path / "validation" / "step-3" / "scores.jsonl")
    assert sorted(r["judge"] for r in rows.values()) == [2.0, 4.0]
    assert v.metrics["val_judge"] == 3.0
    asked = sorted(body["messages"][0]["content"][0]["text"] for *_, body in requests)  # (asked at once)
    for i in (0, 2):  # each row's own instruction, the source and the output
        assert sum(store.meta(i).prompts[0] in text for text in asked) >= 1
    assert all(body["model"] == "judge-m" and len(body["messages"][0]["content"]) == 3 for *_, body in requests)
    v.run(4, module, torch.device("cpu"), torch.float32)
    assert len(requests) == 4  # one judge, asked once per output at every validation
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        v.run(5, module, torch.device("cpu"), torch.float32)
    assert time.monotonic() - started < 30 and "val_judge" not in v.metrics and "val_psnr" in v.metrics
    assert "2 of 2 row(s) got no score" in caplog.text and "within 0.5 s" in caplog.text


def test_validation_without_a_judge_has_no_judge_field(store, tiny_pipe, tiny_model_dir, tmp_path):  # noqa: F811
    v = validator(store, [0], tmp_path, tiny_model_dir, steps=2, cfg=1.0)
    v.run(1, training_module(tiny_pipe.dit, run_config("sft")), torch.device("cpu"), torch.float32)
    assert "val_judge" not in v.metrics and "val_psnr" in v.metrics


def test_a_bad_val_judge_is_refused_when_the_flags_are_parsed(capsys):
    from diffsynth_qie.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--val_judge", "http://127.0.0.1:8000/v1"])
    assert "name the model the endpoint serves after '#'" in capsys.readouterr().err
    args = build_parser().parse_args(["train", "--val_judge", "http://127.0.0.1:8000/v1#m"])
    assert args.val_judge == "http://127.0.0.1:8000/v1#m"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--val_judge", "http://127.0.0.1:8000/v1#m#json"])
    assert "reply format 'json' is unknown" in capsys.readouterr().err


def test_the_judge_flags_reach_the_run_config():
    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.commands.train import config_from_args

    args = build_parser().parse_args(["train", "--loss", "nft", "--reward", "judge", "--reward_judge",
                                      "http://127.0.0.1:8000/v1#m#viescore", "--judge_workers", "2", "--judge_timeout",
                                      "5", "--judge_retries", "0", "--judge_max_tokens", "512", "--judge_on_dead", "skip",
                                      "--reward_judge_max_failed", "0.5", "--reward_timeout", "30"])
    cfg = config_from_args(args)
    assert (cfg.judge.judge_workers, cfg.judge.judge_timeout, cfg.judge.judge_retries, cfg.judge.judge_max_tokens,
            cfg.judge.judge_on_dead) == (2, 5.0, 0, 512, "skip")
    assert (cfg.nft.reward_judge_max_failed, cfg.nft.reward_timeout) == (0.5, 30.0)
    assert cfg.to_json()["judge"]["judge_workers"] == 2  # saved with the run's settings
