"""``--timestep_sampling stratified``: one σ per stratum over each optimizer step, exact resumes."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import curve_script  # noqa: E402  (tests/assets/make_train_loss_curve.py)

PINNED = json.loads((Path(__file__).parent / "assets" / "train_loss_curve.json").read_text())


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield


def stratified_config(cache_dir, out, model_dir, **train):
    s = copy.deepcopy(PINNED["config"])
    s["timesteps"] = {"timestep_sampling": "stratified"}
    s["train"].update(train)
    return curve_script.run_config(s, cache_dir, out, model_dir)


class FakeRanks:
    """The part of an Accelerator that ``step_sample_starts`` uses, for one of several simulated ranks."""

    def __init__(self, rank: int, totals: list[int]):
        self.process_index, self.num_processes, self.device = rank, len(totals), torch.device("cpu")
        self._totals = totals

    def gather(self, tensor):
        assert int(tensor) == self._totals[self.process_index]
        return torch.tensor(self._totals, dtype=torch.int64)


def one_per_stratum(indices: list[int], count: int, lo: int = 0, hi: int = 1000) -> bool:
    """The i-th smallest index lies in the i-th of ``count`` equal strata of [lo, hi)."""
    width = (hi - lo) / count
    return len(indices) == count and all(
        math.floor(lo + i * width) <= x <= math.ceil(lo + (i + 1) * width) - 1 for i, x in enumerate(sorted(indices)))


@pytest.mark.parametrize("boundaries", [(0.0, 1.0), (0.2, 0.9)])
def test_one_step_covers_every_stratum_over_ranks_and_unequal_micro_batches(boundaries):
    from diffsynth_qie.training.accumulation import step_sample_starts
    from diffsynth_qie.training.config import TimestepConfig
    from diffsynth_qie.training.loop import micro_seed
    from diffsynth_qie.models.family import EDIT
    from diffsynth_qie.training.timesteps import Strata, draw_timesteps, micro_strata, step_strata

    cfg = TimestepConfig(timestep_sampling="stratified", min_timestep_boundary=boundaries[0],
                         max_timestep_boundary=boundaries[1])
    lo, hi = int(boundaries[0] * 1000), int(boundaries[1] * 1000)
    rank_sizes = [[2, 1, 3], [1, 4, 2]]  # two ranks, three unequal micro-batches each
    totals = [sum(s) for s in rank_sizes]
    for step in range(6):
        indices, starts_all = [], []
        for rank, sizes in enumerate(rank_sizes):
            starts, total = step_sample_starts(sizes, FakeRanks(rank, totals))
            assert total == sum(totals)
            starts_all += starts
            for m, strata in enumerate(micro_strata(step_strata(0, step, total), starts, sizes)):
                gen = torch.Generator().manual_seed(micro_seed(0, rank, step, m))
                for k in strata.strata:  # the loss draws sample by sample
                    d = draw_timesteps(1, cfg, gen, strata=Strata((k,), strata.count), family=EDIT)
                    indices.append(int(d.index[0]))
        assert sorted(starts_all) == [0, 2, 3, 6, 7, 11]  # every sample has its own global index
        assert one_per_stratum(indices, sum(totals), lo, hi), (step, sorted(indices))
    # the assignment of strata to samples changes from step to step, and only with (seed, step)
    assert step_strata(0, 1, 13) != step_strata(0, 2, 13) and step_strata(0, 1, 13) == step_strata(0, 1, 13)
    assert sorted(step_strata(5, 3, 13)) == list(range(13))
    # without a step's strata (a batch alone) the batch covers its own strata
    d = draw_timesteps(10, cfg, torch.Generator().manual_seed(0), family=EDIT)
    assert one_per_stratum(d.index.tolist(), 10, lo, hi)


def test_each_stratified_draw_is_marginally_uniform():
    """Strata spread the step's σ's; each sample's own distribution is still the uniform one."""
    from diffsynth_qie.training.config import TimestepConfig
    from diffsynth_qie.models.family import EDIT
    from diffsynth_qie.training.timesteps import draw_timesteps

    g = torch.Generator().manual_seed(0)
    strat = torch.cat([draw_timesteps(8, TimestepConfig(timestep_sampling="stratified"), g, family=EDIT).index
                       for _ in range(2000)]).float()
    unif = draw_timesteps(16000, TimestepConfig(), g, family=EDIT).index.float()
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):
        assert abs(float(strat.quantile(q)) - q * 1000) < 15, q  # uniform over [0, 1000)
        assert abs(float(strat.quantile(q)) - float(unif.quantile(q))) < 20, q
    # batch means vary far less than the uniform draw's (the variance stratification removes)
    means_s = strat.view(-1, 8).mean(1).std()
    means_u = unif.view(-1, 8).mean(1).std()
    assert float(means_s) < 0.3 * float(means_u), (float(means_s), float(means_u))


def test_training_draws_one_sigma_per_stratum_each_step(cache_dir, tiny_model_dir, tmp_path, monkeypatch):
    """The real loop (batch 2 × 2 micro-batches): each optimizer step's 4 σ's fall one per quarter."""
    from diffsynth_qie.training import timesteps  # the SFT loss draws its σ's from here when called
    from diffsynth_qie.training.loop import Hooks, train

    seen: list[int] = []
    per_step: list[list[int]] = []
    real = timesteps.draw_timesteps

    def spy(*args, **kwargs):
        d = real(*args, **kwargs)
        seen.extend(d.index.tolist())
        return d

    def end(step, record):
        per_step.append(list(seen))
        seen.clear()

    monkeypatch.setattr(timesteps, "draw_timesteps", spy)
    train(stratified_config(cache_dir, tmp_path / "run", tiny_model_dir, max_steps=4), Hooks(on_step_end=end))
    assert len(per_step) == 4
    for indices in per_step:
        assert one_per_stratum(indices, 4), indices


def test_stratified_run_resumes_exactly(cache_dir, tiny_model_dir, tmp_path):
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file

    from diffsynth_qie.training.loop import Hooks, train
    from diffsynth_qie.training.tracking import read_loss_log

    full = train(stratified_config(cache_dir, tmp_path / "full", tiny_model_dir, max_steps=6))

    class Crash(Exception):
        pass

    def crash_at_5(step, record):
        if step == 5:
            raise Crash

    out = tmp_path / "resumed"
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    with pytest.raises(Crash):
        train(stratified_config(cache_dir, out, tiny_model_dir, max_steps=6, save_every=3),
              Hooks(on_step_end=crash_at_5))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    train(stratified_config(cache_dir, out, tiny_model_dir, max_steps=6, save_every=3, resume="latest"))
    curve = [r["loss"] for r in read_loss_log(out / "loss.jsonl")]
    assert curve == pytest.approx(full.losses, rel=1e-6, abs=1e-7)
    a, b = load_file(str(out / "lora.safetensors")), load_file(str(full.lora_path))
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    # and the flag changed the draws: the pinned uniform run's curve is not this one
    assert curve != pytest.approx(PINNED["losses"][:6], rel=1e-3)


def test_stratified_is_refused_for_the_lbm_loss(tmp_path):
    from diffsynth_qie.training.config import LossConfig, RunConfig, TimestepConfig, TrainConfig, validate

    cfg = RunConfig(train=TrainConfig(cache_dir=str(tmp_path), output_dir=str(tmp_path / "o"), max_steps=1),
                    timesteps=TimestepConfig(timestep_sampling="stratified"), loss=LossConfig(loss="lbm"))
    with pytest.raises(ValueError, match="--timestep_sampling stratified.*--lbm_sigma_sampling"):
        validate(cfg)
