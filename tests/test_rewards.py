"""Reward tuning's building blocks: the --reward spec (every kind of term, the weighted sum, the checks that fail
before any rollout) and DiffusionNFT's objective against a direct transcription of the paper's equations."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

from diffsynth_qie.metrics.rewards import ProcessReward, RewardBatch, parse_reward
from diffsynth_qie.training.losses.nft_math import nft_loss, optimality, soft_update_


def _batch(n=4, size=64, seed=0, change_outside=0.0):
    g = torch.Generator().manual_seed(seed)
    source = torch.rand(n, 3, size, size, generator=g)
    mask = torch.zeros(n, 1, size, size)
    mask[..., 16:48, 16:48] = 1
    target = source.clone()
    target[:, 2:3] = torch.where(mask.bool(), 1.0, target[:, 2:3])  # the target: blue inside the mask
    output = target.clone()
    output += change_outside * torch.arange(n).float()[:, None, None, None] * (1 - mask) * 0.1
    return RewardBatch(source=source, output=output.clamp(0, 1), instructions=["make it blue"] * n,
                       keys=[f"row{i}" for i in range(n)], target=target, mask=mask)


def test_preserve_ranks_outputs_by_how_much_they_changed_outside_the_mask():
    batch = _batch(change_outside=1.0)  # row i changes the outside by 0.1 * i
    r = parse_reward("preserve")(batch)
    assert r.shape == (4,) and r[0] > r[1] > r[2] > r[3] and float(r[0]) > 0.95  # (SSIM windows see the edge)


def test_weighted_sum_is_the_sum_of_its_weighted_terms():
    batch = _batch(change_outside=1.0)
    p, f = parse_reward("preserve")(batch), parse_reward("fidelity")(batch)
    both = parse_reward("preserve:0.5, fidelity:2")(batch)
    assert torch.allclose(both, 0.5 * p + 2 * f, atol=1e-6) and not torch.allclose(both, p + f)


def test_a_users_function_and_a_jsonl_of_scores(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(textwrap.dedent("""
        def blueness(batch):
            inside = batch.mask.expand_as(batch.output)[:, 2] > 0
            return [float(o[2][m].mean()) for o, m in zip(batch.output, inside)]
        def wrong_shape(batch):
            return [1.0]
        def not_a_number(batch):
            return [float("nan")] * len(batch)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    batch = _batch()
    assert torch.allclose(parse_reward("myrewards:blueness:2")(batch), torch.full((4,), 2.0))
    with pytest.raises(ValueError, match=r"'myrewards:wrong_shape' returned 1 values for 4 rows"):
        parse_reward("myrewards:wrong_shape")(batch)
    with pytest.raises(ValueError, match=r"'myrewards:not_a_number' returned a non-finite value for rows \[0, 1, 2, 3\]"):
        parse_reward("myrewards:not_a_number")(batch)
    scores = tmp_path / "scores.jsonl"
    scores.write_text("\n".join(json.dumps({"key": f"row{i}", "reward": i * 0.5}) for i in range(4)))
    assert parse_reward(f"jsonl:{scores}")(batch).tolist() == [0.0, 0.5, 1.0, 1.5]


class _Judge:
    def score(self, source, instruction, output):
        return {"judge": float(sum(output.getpixel((32, 32)))) / 100}


def test_a_judge_term_and_what_fails_before_any_rollout(tmp_path):
    batch = _batch()
    assert torch.allclose(parse_reward("judge:0.1", judge=_Judge())(batch),
                          torch.tensor([sum(_Judge().score(None, "", _pil(batch.output[i])).values()) * 0.1
                                        for i in range(4)]), atol=1e-6)
    for spec, message in [("judge", "--reward judge needs a judge"), ("nosuch", "'nosuch' is unknown"),
                          ("nosuchmodule_xyz:fn", "cannot load 'fn' from module 'nosuchmodule_xyz'"),
                          (f"jsonl:{tmp_path}/missing.jsonl", "no such file"), ("", "is empty"),
                          ("preserve:inf", "finite weight")]:
        with pytest.raises(ValueError, match=message):
            parse_reward(spec)
    with pytest.raises(ValueError, match="compares with the target"):
        parse_reward("fidelity")(RewardBatch(source=batch.source, output=batch.output, instructions=["x"] * 4))


class _FlakyJudge:
    """Scores rows by their output's brightness, except the rows listed in ``fails``."""

    def __init__(self, fails):
        self.fails, self.asked = set(fails), []

    def assess_many(self, items):
        from diffsynth_qie.metrics.judge import Verdict

        self.asked.append(len(items))
        return [Verdict({}, "HTTP 503 (after 3 tries)") if i in self.fails else
                Verdict({"judge": float(sum(out.getpixel((32, 32)))) / 100}) for i, (_, _, out, _) in enumerate(items)]


def test_a_judge_that_fails_on_some_rollouts_counts_them_as_the_mean_up_to_the_share_then_stops(caplog):
    from diffsynth_qie.metrics.rewards import RewardFailed

    batch = _batch(change_outside=1.0)
    full = parse_reward("judge", judge=_FlakyJudge([]))(batch)
    judge = _FlakyJudge([2])
    one = parse_reward("judge", judge=judge, max_failed=0.25)(batch)
    assert judge.asked == [4]  # the rows asked together
    assert torch.allclose(one[[0, 1, 3]], full[[0, 1, 3]]) and torch.isclose(one[2], full[[0, 1, 3]].mean())
    assert "1 of 4 rollouts of row2 got no score (HTTP 503 (after 3 tries))" in caplog.text
    with pytest.raises(RewardFailed, match=r"could not score 2 of 4 rollouts .* HTTP 503 .*--reward_judge_max_failed "
                                           r"0.25 of them, so the run stops"):
        parse_reward("judge", judge=_FlakyJudge([1, 2]), max_failed=0.25)(batch)
    with pytest.raises(RewardFailed, match="could not score 1 of 4"):  # the default: none may fail
        parse_reward("judge", judge=_FlakyJudge([0]))(batch)


def test_a_reward_that_raises_or_hangs_fails_in_one_line(tmp_path, monkeypatch):
    import time

    from diffsynth_qie.metrics.rewards import RewardFailed, call_reward

    (tmp_path / "badrewards.py").write_text(textwrap.dedent("""
        import time
        def divide(batch):
            return [1 / 0 for _ in range(len(batch))]
        def hang(batch):
            time.sleep(30)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    batch = _batch()
    with pytest.raises(RewardFailed, match=r"reward term 'badrewards:divide' raised ZeroDivisionError: division by zero"):
        call_reward(parse_reward("badrewards:divide"), batch, timeout=5)
    started = time.monotonic()
    with pytest.raises(RewardFailed, match=r"the reward of row x took more than --reward_timeout 0.2 s"):
        call_reward(parse_reward("badrewards:hang"), batch, timeout=0.2, what="the reward of row x")
    assert time.monotonic() - started < 5
    assert torch.equal(call_reward(parse_reward("preserve"), batch, timeout=30), parse_reward("preserve")(batch))


def _pil(x):
    from PIL import Image

    return Image.fromarray((x.clamp(0, 1).permute(1, 2, 0) * 255).round().byte().numpy())


def test_a_reward_in_another_process_gives_the_same_numbers():
    batch = _batch(change_outside=1.0)
    remote = ProcessReward("preserve:0.5,drift")
    try:
        assert torch.allclose(remote(batch), parse_reward("preserve:0.5,drift")(batch), atol=1e-6)
    finally:
        remote.close()


# --- DiffusionNFT, against the paper's equations written out directly -----------------------------
def _paper_loss(v_theta, v_old, v, rewards, k, beta, clip):
    """arXiv 2509.16117: r from group-normalised rewards; L = r||v+ - v||^2 + (1 - r)||v- - v||^2 (over beta)."""
    out = []
    for i in range(v_theta.shape[0]):
        group = rewards[(i // k) * k:(i // k + 1) * k]
        a = (rewards[i] - group.mean()) / max(float(group.std()), 1e-4)
        r = 0.5 + 0.5 * max(-1.0, min(1.0, float(a) / clip))
        pos = (1 - beta) * v_old[i] + beta * v_theta[i]
        neg = (1 + beta) * v_old[i] - beta * v_theta[i]
        out.append((r * ((pos - v[i]) ** 2).mean() + (1 - r) * ((neg - v[i]) ** 2).mean()) / beta)
    return torch.stack(out)


@pytest.mark.parametrize("beta,clip", [(1.0, 5.0), (0.1, 2.0)])
def test_nft_loss_equals_the_papers_equations(beta, clip):
    g = torch.Generator().manual_seed(3)
    v_theta, v_old, v = (torch.randn(6, 4, 3, 3, generator=g, dtype=torch.float64) for _ in range(3))
    rewards = torch.randn(6, generator=g, dtype=torch.float64)
    r = optimality(rewards, group_size=3, adv_clip=clip)
    assert torch.allclose(nft_loss(v_theta, v_old, v, r, beta).double(),
                          _paper_loss(v_theta, v_old, v, rewards, 3, beta, clip).float().double(), atol=1e-6)
    assert (r >= 0).all() and (r <= 1).all() and r.reshape(2, 3).mean(1).sub(0.5).abs().max() < 0.5


def test_nft_gradient_moves_toward_the_rewarded_rollouts():
    """With the old policy at v_old, a rewarded rollout (r=1) pulls v_theta toward its target, a penalised one
    (r=0) pushes it away: the implicit-policy contrast of the paper."""
    v_old, v = torch.zeros(2, 4), torch.ones(2, 4)
    v_theta = torch.zeros(2, 4, requires_grad=True)
    nft_loss(v_theta, v_old, v, torch.tensor([1.0, 0.0]), beta=1.0).sum().backward()
    assert (v_theta.grad[0] < 0).all() and (v_theta.grad[1] > 0).all()


def test_nft_refuses_groups_of_one_and_bad_settings():
    with pytest.raises(ValueError, match="at least 2 per source"):
        optimality(torch.ones(4), group_size=1)
    with pytest.raises(ValueError, match="must be > 0"):
        nft_loss(torch.ones(1, 2), torch.ones(1, 2), torch.ones(1, 2), torch.ones(1), beta=0)
    old, cur = [torch.zeros(3)], [torch.ones(3)]
    soft_update_(old, cur, 0.75)
    assert torch.allclose(old[0], torch.full((3,), 0.25))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        soft_update_(old, cur, 1.0)


def test_a_reward_judge_that_goes_down_is_never_left_out():
    """A reward judge that is down stops the run in one line, under --judge_on_dead stop (the judge's rule) and
    skip alike: a reward is never computed without it."""
    from conftest import chat_server
    from diffsynth_qie.metrics.judge import OpenAIJudge
    from diffsynth_qie.metrics.judge_config import JudgeConfig
    from diffsynth_qie.metrics.judge_formats import format_named
    from diffsynth_qie.metrics.rewards import RewardFailed
    from diffsynth_qie.training.losses.nft import NFTConfig, build_reward

    batch = _batch()
    with chat_server(lambda seen: {"status": 503}) as (url, seen):
        judge = OpenAIJudge(url, "m", format_named("number"), JudgeConfig(judge_retries=0))
        with pytest.raises(RewardFailed, match=r"the reward judge m at .* is down \(3 requests in a row failed, the "
                                               r"last: HTTP 503.*the run stops rather than train without its rewards"):
            parse_reward("judge", judge=judge, max_failed=1.0)(batch)
    nft = NFTConfig(reward="judge", reward_judge="http://127.0.0.1:9/v1#m")  # nothing listens there
    with pytest.raises(ValueError, match="--reward judge cannot be left out"):
        build_reward(nft, JudgeConfig(judge_timeout=0.5, judge_on_dead="skip"))
