"""`--checkpoint_blocks N|auto`: the plan's term of N of L blocks checkpointed against the fake device, the
preflight's mix of checkpointed and plain blocks, auto's choice (the fewest that fit) and its refusals.

The fake-device runs are one preflight at 512² (its three runs: one and two blocks checkpointed, the first of two
checkpointed with the second plain) and two 3-block steps (N = 1, 2), shared by the module."""
from __future__ import annotations

import dataclasses

import pytest

from diffsynth_qie.memory import plan_terms
from diffsynth_qie.memory.census import preset_census
from diffsynth_qie.memory.plan import CUDA_OVERHEAD, GiB, PlanOptions, predict
from diffsynth_qie.models.presets import get_preset

SIDE, PROMPT = 512, 40


def run_config(**train):
    from diffsynth_qie.training.config import RunConfig

    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, model="2511", cache_dir="-", output_dir="-",
                                                             **train))
    return cfg.resolved(get_preset("2511"))


@pytest.fixture(scope="module")
def runs():
    """The preflight's three runs of 30 of 60 blocks checkpointed (one and two blocks checkpointed, the first of two
    checkpointed with the second plain), and a 3-block step with the first block checkpointed."""
    from diffsynth_qie.preflight.train_partial import run_three
    from diffsynth_qie.preflight.train_step import batch_shapes, verify_train_step

    shapes = batch_shapes(SIDE, 1, PROMPT, 1)
    kept = run_three(run_config(checkpoint_blocks=30), (1, 2),
                     lambda cfg, n, grows=True: verify_train_step(cfg, get_preset("2511"), shapes, num_layers=n,
                                                                  costs=True))
    return kept, verify_train_step(run_config(checkpoint_blocks=1), get_preset("2511"), shapes, num_layers=3)


def _options(n, **o):
    return PlanOptions(resolution=SIDE, prompt_tokens=PROMPT, gradient_checkpointing=True, checkpoint_blocks=n, **o)


def _activations(r) -> int:
    """A run's activations as the plan counts them (``benchmarks/fit_plan.py``): the steady peak beyond the
    weights, the LoRA's gradient and AdamW's moments."""
    return r.peak - r.weights - 1.5 * r.optimizer_state


def test_the_plan_term_of_n_of_l_blocks_matches_the_fake_device(runs, monkeypatch):
    """The start of the backward with the first of 2 and of 3 blocks checkpointed, as the fake device holds it;
    the GPU's slope factor off, the activation term is the fake device's within 3 %."""
    kept, three = runs
    monkeypatch.setattr(plan_terms, "GPU_CHECKPOINTED_ACTIVATION_SCALE", 1.0)
    for layers, measured in ((2, kept["m2"]), (3, three)):
        planned = plan_terms.activation_bytes(preset_census("2511", with_encoders=False, num_layers=layers),
                                              _options(1))
        assert abs(planned / _activations(measured) - 1) < 0.03, (layers, planned / GiB, _activations(measured) / GiB)
    assert three.peak - kept["m2"].peak > kept["c2"].peak - kept["c1"].peak  # a plain block holds more


def test_the_preflight_mixes_checkpointed_and_plain_blocks_as_a_deeper_run_holds_them(runs):
    from diffsynth_qie.preflight.train_partial import mixed_verdict

    kept, three = runs
    scaled = mixed_verdict(kept, (1, 2), 3, 1, None).peak_bytes
    assert abs(scaled / three.peak - 1) < 0.01, (scaled / GiB, three.peak / GiB)


def test_the_preflight_of_30_of_60_blocks_runs_the_mix_and_agrees_with_the_plan(runs, monkeypatch):
    """qie train's preflight with --checkpoint_blocks 30 runs the three runs (the growth check on the shallow one),
    scales them to 30 of 60 and predicts the time from their kernels (the runs answered by the module's)."""
    from diffsynth_qie.preflight import train as preflight_mod
    from diffsynth_qie.training import checkpoint_auto

    kept, _ = runs
    by_shape = {(2, 1): kept["c1"], (2, 2): kept["c2"], (1, 2): kept["m2"]}
    calls = []

    def answered(cfg, preset, shapes, num_layers, steps=1, **_):
        calls.append((cfg.train.checkpoint_blocks, num_layers, steps))
        return by_shape[(cfg.train.checkpoint_blocks, num_layers)]

    monkeypatch.setattr(checkpoint_auto, "RESOLUTION", SIDE)
    monkeypatch.setattr(preflight_mod, "verify_train_step", answered)
    report = preflight_mod.preflight(run_config(checkpoint_blocks=30), get_preset("2511"), gpu_memory_gb=1000)
    assert sorted(calls) == [(1, 2, 1), (2, 1, 3), (2, 2, 1)]
    verdict = report.verdict
    assert "30 of 60 checkpointed" in verdict.scaled
    census = preset_census("2511", with_encoders=False)
    planned = {n: predict(census, _options(n)).gpu_peak - CUDA_OVERHEAD for n in (0, 30, 60)}
    assert abs(planned[30] / verdict.peak_bytes - 1) < 0.10, (planned[30] / GiB, verdict.peak_bytes / GiB)
    assert planned[60] < verdict.peak_bytes < planned[0]
    assert report.prediction.seconds > 0


@pytest.fixture(scope="module")
def real():
    return preset_census("2511", with_encoders=False)


def test_auto_picks_the_fewest_blocks_that_fit(real):
    from diffsynth_qie.training.checkpoint_auto import fewest_fitting

    base = PlanOptions(gradient_checkpointing=True)
    peaks = {n: predict(real, dataclasses.replace(base, checkpoint_blocks=n)).gpu_peak for n in range(61)}
    assert all(peaks[n] > peaks[n + 1] for n in range(59))  # each block checkpointed saves (the last: inputs)
    for n in (1, 17, 40):
        assert fewest_fitting(real, base, peaks[n])[0] == n  # fits exactly
        assert fewest_fitting(real, base, peaks[n] - 1)[0] == n + 1  # one byte less: one more block
    assert fewest_fitting(real, base, peaks[0])[0] == 0
    n, plan = fewest_fitting(real, base, 80 * GiB)
    assert plan.gpu_peak <= 80 * GiB < peaks[n - 1] and 0 < n < 60
    assert min(peaks.values()) == peaks[60] and fewest_fitting(real, base, peaks[60] - 1)[0] is None


def test_auto_resolves_before_the_load_and_refuses_a_gpu_nothing_fits(caplog):
    from diffsynth_qie.training.checkpoint_auto import resolve_checkpoint_blocks

    preset = get_preset("2511")
    with caplog.at_level("INFO", logger="diffsynth_qie.training.checkpoint_auto"):
        cfg = resolve_checkpoint_blocks(run_config(checkpoint_blocks="auto", gpu_memory_gb=80), preset)
    assert 0 < cfg.train.checkpoint_blocks < 60 and f"{cfg.train.checkpoint_blocks} of 60 blocks" in caplog.text
    selective = resolve_checkpoint_blocks(run_config(checkpoint_blocks="auto", gpu_memory_gb=80,
                                                     checkpoint_policy="selective", compile=True), preset)
    assert selective.train.checkpoint_blocks > cfg.train.checkpoint_blocks  # selective keeps more per block
    with pytest.raises(ValueError, match=r"even with all 60 blocks checkpointed.*24\.0 GiB.*--fp8_base.*"
                                         r"--blocks_to_swap N"):
        resolve_checkpoint_blocks(run_config(checkpoint_blocks="auto", gpu_memory_gb=24), preset)
    with pytest.raises(ValueError, match=r"--checkpoint_blocks 61: this DiT has 60 blocks; give 0\.\.60 or auto"):
        resolve_checkpoint_blocks(run_config(checkpoint_blocks=61), preset)
    with pytest.raises(ValueError, match=r"--checkpoint_blocks auto cannot be combined with --blocks_to_swap 4"):
        resolve_checkpoint_blocks(run_config(checkpoint_blocks="auto", blocks_to_swap=4), preset)
    with pytest.raises(ValueError, match=r"--no-gradient_checkpointing.*drop one"):
        resolve_checkpoint_blocks(run_config(checkpoint_blocks=3, gradient_checkpointing=False), preset)


def test_auto_without_a_gpu_checkpoints_every_block(monkeypatch, caplog):
    from diffsynth_qie.fakegpu import verdict
    from diffsynth_qie.training.checkpoint_auto import resolve_checkpoint_blocks

    monkeypatch.setattr(verdict, "visible_gpu_bytes", lambda: None)
    with caplog.at_level("INFO", logger="diffsynth_qie.training.checkpoint_auto"):
        cfg = resolve_checkpoint_blocks(run_config(checkpoint_blocks="auto"), get_preset("2511"))
    assert cfg.train.checkpoint_blocks is None and "no GPU" in caplog.text


def test_the_flag_parses_a_count_or_auto():
    import argparse

    from diffsynth_qie.commands import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    base = ["--cache_dir", "c", "--output_dir", "o"]
    assert train.config_from_args(parser.parse_args(base)).train.checkpoint_blocks is None
    assert train.config_from_args(parser.parse_args(base + ["--checkpoint_blocks", "30"])).train.checkpoint_blocks == 30
    assert train.config_from_args(parser.parse_args(base + ["--checkpoint_blocks", "auto"])).train.checkpoint_blocks \
        == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--checkpoint_blocks", "-1"])


def test_qie_plan_takes_the_count_and_auto(capfd, real):
    from diffsynth_qie.cli import main
    from diffsynth_qie.training.checkpoint_auto import fewest_fitting

    assert main(["plan", "--checkpoint_blocks", "auto", "--gpu_memory_gb", "80", "--no_time"]) == 0
    text = "".join(capfd.readouterr())
    n, plan = fewest_fitting(real, PlanOptions(gradient_checkpointing=True), 80 * GiB)
    assert f"auto: {n} of 60 blocks checkpointed, planned peak {plan.gpu_peak / GiB:.1f} GiB of 80.0 GiB" in text
    assert f"activations ({n} of 60 blocks checkpointed)" in text and f"--checkpoint_blocks {n}" in text


def test_the_blocks_checkpoint_as_counted_with_either_policy_and_compiled(monkeypatch):
    """prepare_blocks: the default (full, eager, every block) stays DiffSynth's checkpoint around each block; a count
    makes the first N blocks checkpoint themselves, with the policy, inside the compiled region with --compile."""
    import torch

    from diffsynth_qie.models.load import compile as compile_mod
    from diffsynth_qie.models.load.block_checkpoint import owns_checkpointing
    from diffsynth_qie.tiny.build import DIT_SIZES, TinyQwenImageDiT
    from diffsynth_qie.training.block_setup import prepare_blocks

    calls = []
    monkeypatch.setattr(compile_mod, "compile_blocks", lambda dit, **kw: calls.append(kw))

    def prepared(**train):
        with torch.device("meta"):
            dit = TinyQwenImageDiT(**{**DIT_SIZES, "num_layers": 3})
        prepare_blocks(dit, run_config(**train).train)
        return dit

    assert not owns_checkpointing(prepared())  # unchanged default
    assert owns_checkpointing(prepared(checkpoint_blocks=2))
    prepared(checkpoint_blocks=1, compile=True, checkpoint_policy="selective")
    prepared(checkpoint_blocks=0, compile=True)
    assert calls == [{"backend": "inductor", "checkpointed": [True, False, False], "policy": "selective"},
                     {"backend": "inductor", "checkpointed": [False, False, False], "policy": "full"}]
