"""Batch sampler: buckets, token budget, ranks, weighted mix, resume (pure python, no cache needed)."""
from __future__ import annotations

import argparse
import logging
import math
import random
from collections import Counter

import pytest

from diffsynth_qie.cache.store import EntryMeta
from diffsynth_qie.data.buckets import SampleInfo, build_batches, padding_fraction
from diffsynth_qie.data.sampling import BucketBatchSampler, SamplingConfig, sample_infos_from_store
from diffsynth_qie.data.weighting import (expected_mix, parse_dataset_weights, parse_src_img_num_weights,
                                          realised_mix, sample_weights)

TARGETS = [(8, 8), (8, 12), (12, 8), (16, 16), (16, 24), (24, 16)]  # latent (h, w)


def mixed_infos(n: int, seed: int = 0, datasets=("a", "b", "c"), max_sources: int = 3) -> list[SampleInfo]:
    """``n`` samples of random target sizes with 0..max_sources references of random sizes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(0, max_sources)
        out.append(SampleInfo.from_shapes(i, rng.choice(datasets), rng.choice(TARGETS),
                                          [rng.choice(TARGETS) for _ in range(k)]))
    return out


def grid_infos(sizes: dict[tuple[str, int], int]) -> list[SampleInfo]:
    """Samples with given counts per (dataset, number of sources); one fixed shape per group."""
    out = []
    for (ds, k), n in sizes.items():
        for _ in range(n):
            out.append(SampleInfo.from_shapes(len(out), ds, (8, 8), [(8, 8)] * k))
    return out


def all_indices(batches) -> list[int]:
    return [i for b in batches for i in b]


# ---------------------------------------------------------------- determinism

@pytest.mark.parametrize("weights", [None, "a=1,b=2,c=0.5"])
def test_deterministic_per_seed_and_epoch(weights):
    infos = mixed_infos(200)
    cfg = SamplingConfig(batch_size=4, seed=3, dataset_weights=weights)
    s1, s2 = BucketBatchSampler(infos, cfg), BucketBatchSampler(infos, cfg)
    assert s1.epoch_batches(0) == s2.epoch_batches(0)
    assert s1.epoch_batches(1) == s2.epoch_batches(1)
    assert s1.epoch_batches(0) != s1.epoch_batches(1)
    other_seed = BucketBatchSampler(infos, SamplingConfig(batch_size=4, seed=4, dataset_weights=weights))
    assert other_seed.epoch_batches(0) != s1.epoch_batches(0)
    # recomputing an epoch after others (cache eviction) gives the same batches
    first = [list(b) for b in s1.epoch_batches(0)]
    s1.epoch_batches(5)
    assert s1.epoch_batches(0) == first


def test_unweighted_epoch_is_a_permutation_in_full_batches():
    infos = mixed_infos(203)
    batches = BucketBatchSampler(infos, SamplingConfig(batch_size=4)).epoch_batches(0)
    assert sorted(all_indices(batches)) == list(range(203))
    # auto policy: every batch is full except at most one (the last leftover chunk)
    assert sum(len(b) < 4 for b in batches) <= 1


# ---------------------------------------------------------------- ranks

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_disjoint_and_cover_with_logged_repeats(world, caplog):
    infos = mixed_infos(101, seed=1)
    cfg = SamplingConfig(batch_size=4, seed=7)
    unsplit = BucketBatchSampler(infos, cfg).global_batches(0)  # the global list does not depend on the world size
    n_batches = len(unsplit)
    with caplog.at_level(logging.INFO, logger="diffsynth_qie.data.sampling"):
        ranks = [BucketBatchSampler(infos, cfg, num_replicas=world, rank=r).epoch_batches(0) for r in range(world)]
    extra = (-n_batches) % world
    assert len({len(b) for b in ranks}) == 1  # equal step counts
    # rank r has exactly the global batches r, r+W, ... of the (repeat-padded) list
    padded = unsplit + unsplit[:extra]
    assert [ranks[r] for r in range(world)] == [padded[r::world] for r in range(world)]
    repeated = Counter(all_indices(unsplit[:extra]))
    got = Counter(i for r in ranks for i in all_indices(r))
    assert set(got) == set(range(101))  # cover
    assert got - Counter(range(101)) == repeated  # disjoint except the logged repeats
    if extra:
        assert f"repeated {extra} batches to even ranks" in caplog.text
    else:
        assert "repeated" not in caplog.text


def test_some_world_size_needs_evening_out():
    """Guard: the parametrised test above really exercises repeats for some world size."""
    n = len(BucketBatchSampler(mixed_infos(101, seed=1), SamplingConfig(batch_size=4, seed=7)).global_batches(0))
    assert any(n % w for w in (2, 3, 4))


def test_drop_last_truncates_and_reports(caplog):
    infos = mixed_infos(101, seed=1)
    cfg = SamplingConfig(batch_size=4, seed=7, drop_last=True)
    unsplit = BucketBatchSampler(infos, SamplingConfig(batch_size=4, seed=7)).global_batches(0)
    world = next(w for w in (3, 4, 2) if len(unsplit) % w)
    dropped = len(unsplit) % world
    with caplog.at_level(logging.INFO, logger="diffsynth_qie.data.sampling"):
        ranks = [BucketBatchSampler(infos, cfg, num_replicas=world, rank=r).epoch_batches(0) for r in range(world)]
    got = [i for r in ranks for i in all_indices(r)]
    assert len(got) == len(set(got))  # disjoint
    lost = sorted(set(range(101)) - set(got))
    assert sorted(all_indices(unsplit[-dropped:])) == lost
    assert f"dropped {dropped} of {len(unsplit)} batches ({len(lost)} samples)" in caplog.text


def test_more_ranks_than_batches_repeat_cyclically():
    infos = mixed_infos(3)
    ranks = [BucketBatchSampler(infos, SamplingConfig(batch_size=8), num_replicas=4, rank=r).epoch_batches(0)
             for r in range(4)]
    assert all(len(b) == 1 for b in ranks)
    assert {i for r in ranks for i in all_indices(r)} == {0, 1, 2}
    with pytest.raises(ValueError, match="drop_last leaves no batches"):
        BucketBatchSampler(infos, SamplingConfig(batch_size=8, drop_last=True), num_replicas=4).epoch_batches(0)


# ---------------------------------------------------------------- buckets and budget

def test_padding_fraction_definition():
    infos = [SampleInfo.from_shapes(0, "a", (4, 4)), SampleInfo.from_shapes(1, "a", (4, 8)),
             SampleInfo.from_shapes(2, "a", (8, 8))]
    tokens = [s.tokens for s in infos]
    assert tokens == [4, 8, 16]
    assert padding_fraction([[0, 1], [2]], infos) == pytest.approx(1 - (4 + 8 + 16) / (2 * 8 + 16))
    assert padding_fraction([[0], [1], [2]], infos) == 0.0


@pytest.mark.parametrize("policy", ["auto", "tokens", "exact"])
def test_bucketing_pads_less_than_random_batching(policy):
    infos = mixed_infos(400, seed=2)
    batches = BucketBatchSampler(infos, SamplingConfig(batch_size=4, bucket_policy=policy)).epoch_batches(0)
    order = list(range(400))
    random.Random(0).shuffle(order)
    random_batches = [order[j:j + 4] for j in range(0, 400, 4)]
    bucketed, rand = padding_fraction(batches, infos), padding_fraction(random_batches, infos)
    assert rand > 0.3
    assert bucketed < 0.25 * rand
    if policy == "exact":
        assert bucketed == 0.0
        assert all(len({infos[i].layout for i in b}) == 1 for b in batches)
    else:  # full batches (the reason to pool leftovers)
        assert sum(len(b) < 4 for b in batches) <= 1


def test_auto_keeps_full_layout_buckets_padding_free():
    infos = mixed_infos(300, seed=5, max_sources=1)
    batches = BucketBatchSampler(infos, SamplingConfig(batch_size=2)).epoch_batches(0)
    counts = Counter(s.layout for s in infos)
    # layouts with >= 2 members: all but at most one of their members sit in single-layout batches
    for layout, n in counts.items():
        pure = sum(len(b) for b in batches if {infos[i].layout for i in b} == {layout})
        assert pure >= n - 1


def test_token_budget_respected_and_oversize_sample_alone(caplog):
    infos = mixed_infos(300, seed=3)
    big = SampleInfo.from_shapes(300, "a", (64, 64), [(64, 64)])  # 2048 tokens
    infos.append(big)
    budget = 600
    assert max(s.tokens for s in infos[:300]) <= budget < big.tokens
    cfg = SamplingConfig(max_tokens_per_batch=budget, batch_size=2)
    with caplog.at_level(logging.INFO, logger="diffsynth_qie.data.sampling"):
        batches = BucketBatchSampler(infos, cfg).epoch_batches(0)
    assert sorted(all_indices(batches)) == list(range(301))
    for b in batches:
        cost = len(b) * max(infos[i].tokens for i in b)
        assert cost <= budget or b == [300]
    assert [300] in batches
    assert "exceed --max_tokens_per_batch 600" in caplog.text and "index 300 with 2048 tokens" in caplog.text
    # the budget, not --batch_size, sets the batch sizes (and small samples do share batches)
    assert max(len(b) for b in batches) > 2
    # and batches are well filled: padded cost per batch mostly near the budget
    costs = [len(b) * max(infos[i].tokens for i in b) for b in batches if b != [300]]
    assert sum(costs) / len(costs) > 0.5 * budget


def test_build_batches_keeps_duplicates():
    s = SampleInfo.from_shapes(0, "a", (8, 8))
    batches = build_batches([s] * 5, random.Random(0), batch_size=2)
    assert sorted(len(b) for b in batches) == [1, 2, 2] and all_indices(batches) == [0] * 5


# ---------------------------------------------------------------- weighted mix

def _within(realised: dict, expected: dict, n: int, sigmas: float = 4.0) -> None:
    """Each share within ``sigmas`` binomial standard deviations sqrt(p(1-p)/n) of its expectation."""
    assert set(realised) == {k for k, p in expected.items() if p > 0}
    for k, p in expected.items():
        tol = sigmas * math.sqrt(p * (1 - p) / n)
        assert abs(realised.get(k, 0.0) - p) <= tol, (k, realised.get(k), p, tol)


def test_weighted_mix_follows_weights_not_group_sizes():
    # very unequal group sizes, full grid of (dataset, sources) so both marginals follow the weights
    sizes = {("a", 0): 400, ("a", 1): 30, ("a", 2): 5, ("a", 3): 50,
             ("b", 0): 3, ("b", 1): 200, ("b", 2): 20, ("b", 3): 10,
             ("c", 0): 100, ("c", 1): 100, ("c", 2): 100, ("c", 3): 100}
    infos = grid_infos(sizes)
    n = 20000
    cfg = SamplingConfig(batch_size=8, dataset_weights="a=0.5,b=1.5", src_img_num_weights="0=1,1=2,2=1,3=0",
                         samples_per_epoch=n, seed=11)
    sampler = BucketBatchSampler(infos, cfg)
    ds_w, src_w = {"a": 0.5, "b": 1.5}, {0: 1.0, 1: 2.0, 2: 1.0}
    want_ds = {d: w / sum(ds_w.values()) for d, w in ds_w.items()}
    want_src = {k: w / sum(src_w.values()) for k, w in src_w.items()}
    for epoch in (0, 1):
        batches = sampler.epoch_batches(epoch)
        mix = realised_mix(batches, infos)
        assert mix.samples == n == len(all_indices(batches))
        _within(mix.datasets, want_ds, n)  # c excluded (not named)
        _within(mix.sources, want_src, n)  # 3 sources excluded (weight 0)
    # the sampler's own expectation agrees with the weights on a full grid
    assert sampler.expected.datasets == pytest.approx(want_ds)
    assert sampler.expected.sources == pytest.approx(want_src)


def test_partial_support_follows_documented_formula():
    # dataset a lacks 2-source samples: P(a) ∝ w_a * (w_0 + w_1), P(b) ∝ w_b * (w_0 + w_1 + w_2)
    infos = grid_infos({("a", 0): 50, ("a", 1): 10, ("b", 0): 5, ("b", 1): 5, ("b", 2): 300})
    w_a, w_b, w0, w1, w2 = 1.0, 1.0, 1.0, 1.0, 2.0
    weights = sample_weights(infos, {"a": w_a, "b": w_b}, {0: w0, 1: w1, 2: w2})
    pa, pb = w_a * (w0 + w1), w_b * (w0 + w1 + w2)
    mix = expected_mix(infos, weights)
    assert mix.datasets == pytest.approx({"a": pa / (pa + pb), "b": pb / (pa + pb)})
    n = 20000
    sampler = BucketBatchSampler(infos, SamplingConfig(batch_size=4, dataset_weights="a=1,b=1",
                                                       src_img_num_weights="0=1,1=1,2=2", samples_per_epoch=n))
    _within(realised_mix(sampler.epoch_batches(0), infos).datasets, mix.datasets, n)
    _within(realised_mix(sampler.epoch_batches(0), infos).sources, mix.sources, n)


def test_dataset_weights_only_keep_natural_source_mix():
    infos = grid_infos({("a", 1): 900, ("a", 2): 100, ("b", 1): 10})
    n = 20000
    sampler = BucketBatchSampler(infos, SamplingConfig(dataset_weights="a=3,b=1", samples_per_epoch=n))
    mix = realised_mix(sampler.epoch_batches(0), infos)
    _within(mix.datasets, {"a": 0.75, "b": 0.25}, n)
    _within(mix.sources, {1: 0.75 * 0.9 + 0.25, 2: 0.75 * 0.1}, n)


def test_weighted_epoch_length_defaults_to_eligible_count(caplog):
    infos = grid_infos({("a", 0): 30, ("b", 0): 70})
    with caplog.at_level(logging.INFO):
        sampler = BucketBatchSampler(infos, SamplingConfig(batch_size=5, dataset_weights="a=1"))
        batches = sampler.epoch_batches(0)
    assert sum(len(b) for b in batches) == 30
    assert {infos[i].dataset for i in all_indices(batches)} == {"a"}
    assert "excludes dataset(s) (not named or weight 0): b (70 samples)" in caplog.text
    assert "mix: datasets a=1.000" in caplog.text


# ---------------------------------------------------------------- parsing

@pytest.mark.parametrize("text, match", [
    ("a", "bad entry 'a'"), ("a=", "bad entry 'a='"), ("=1", "bad entry '=1'"), ("a=1,,b=2", "bad entry ''"),
    ("a=x", "weight 'x' of 'a' is not a number"), ("a=-1", "finite number >= 0"), ("a=nan", "finite number"),
    ("a=1,a=2", "'a' is given twice"), ("a=1,z=2", r"unknown dataset\(s\) \['z'\]; the training data has datasets \['a', 'b'\]"),
])
def test_dataset_weight_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_dataset_weights(text, ["b", "a", "a"])


def test_parse_ok():
    assert parse_dataset_weights(" a = 0.5 , b=1.2", ["a", "b", "c"]) == {"a": 0.5, "b": 1.2}
    assert parse_dataset_weights("", ["a"]) is None and parse_dataset_weights(None, ["a"]) is None
    assert parse_src_img_num_weights("0=1,1=1,2=1,3=0") == {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.0}


@pytest.mark.parametrize("text, match", [
    ("x=1", "key 'x' is not a number of source images"), ("-1=1", "not a number of source images"),
    ("1.5=1", "not a number of source images"), ("1=1,01=2", "given twice"), ("1", "bad entry"),
])
def test_src_weight_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_src_img_num_weights(text)


def test_config_errors():
    infos = grid_infos({("a", 1): 3})
    with pytest.raises(ValueError, match="exclude every sample"):
        BucketBatchSampler(infos, SamplingConfig(src_img_num_weights="0=1,2=1"))
    with pytest.raises(ValueError, match="samples_per_epoch applies to weighted sampling only"):
        BucketBatchSampler(infos, SamplingConfig(samples_per_epoch=10))
    with pytest.raises(ValueError, match="--max_tokens_per_batch must be >= 1"):
        BucketBatchSampler(infos, SamplingConfig(max_tokens_per_batch=0))
    with pytest.raises(ValueError, match="index values must be unique"):
        BucketBatchSampler(infos + infos[:1], SamplingConfig())


# ---------------------------------------------------------------- resume and torch protocol

@pytest.mark.parametrize("weights", [None, "a=1,b=2"])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(weights):
    infos = mixed_infos(150, seed=4)
    cfg = SamplingConfig(batch_size=3, seed=5, dataset_weights=weights)
    run = BucketBatchSampler(infos, cfg, num_replicas=2, rank=1)
    run.set_epoch(2)
    full = run.epoch_batches(2)
    it = iter(run)
    seen = [next(it) for _ in range(7)]
    state = run.state_dict()
    assert state["epoch"] == 2 and state["batch"] == 7 and seen == full[:7]

    resumed = BucketBatchSampler(infos, cfg, num_replicas=2, rank=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the loop re-entering the resumed epoch keeps the position
    assert len(resumed) == len(full) - 7
    assert list(resumed) == full[7:]
    assert resumed.state_dict()["epoch"] == 3 and resumed.state_dict()["batch"] == 0
    assert list(resumed) == run.epoch_batches(3)

    with pytest.raises(ValueError, match="same --seed and number of processes"):
        BucketBatchSampler(infos, cfg, num_replicas=4, rank=1).load_state_dict(state)


def test_dataloader_batch_sampler_protocol():
    import torch

    infos = mixed_infos(40)
    sampler = BucketBatchSampler(infos, SamplingConfig(batch_size=4, seed=1))
    loader = torch.utils.data.DataLoader(list(range(40)), batch_sampler=sampler, collate_fn=list)
    assert len(loader) == len(sampler.epoch_batches(0))
    assert list(loader) == sampler.epoch_batches(0)
    sampler.set_epoch(0)  # already at epoch 1 after a full pass: set_epoch(0) restarts epoch 0
    assert list(loader) == sampler.epoch_batches(0)


# ---------------------------------------------------------------- store adapter and flags

def _meta(i: int, dataset: str, target: tuple[int, int], edits: list[tuple[int, int]]) -> EntryMeta:
    return EntryMeta(entry_id=f"e{i}", row_id=f"{dataset}:{i}", dataset=dataset, inverse=False, content_hash="h",
                     prompts=["p"], prompt_lengths=[5], empty_prompt_length=3, prompt_dim=8,
                     target_size=(target[0] * 8, target[1] * 8), target_shape=(16, *target),
                     edit_shapes=[(16, *e) for e in edits], has_back_mask=False, ref_gt_shape=None,
                     lbm_source="none", sub_noise_key="sub_noise/x", sub_noise_ref_gt_key=None, dtype="float32")


class _FakeStore:
    def __init__(self, metas):
        self.metas = metas

    def __len__(self):
        return len(self.metas)

    def meta(self, i):
        return self.metas[i]


def test_sample_infos_from_store_uses_meta_shapes():
    metas = [_meta(0, "a", (8, 8), []), _meta(1, "b", (8, 12), [(8, 8), (12, 8)]), _meta(2, "a", (16, 16), [(16, 16)])]
    store = _FakeStore(metas)
    infos = sample_infos_from_store(store)
    assert [s.tokens for s in infos] == [m.image_tokens for m in metas]
    assert infos[1] == SampleInfo(1, "b", 2, (8, 12), 16 + 24 + 24, ((8, 8), (12, 8)))
    sub = sample_infos_from_store(store, indices=[2, 0], offset=10, dataset="x")
    assert [(s.index, s.dataset, s.target_hw, s.num_sources) for s in sub] == [(10, "x", (16, 16), 1),
                                                                                 (11, "x", (8, 8), 0)]


def test_config_flags_share_batch_size_and_seed_with_train_config():
    from diffsynth_qie.training.config import TrainConfig
    from diffsynth_qie.utils.config_cli import add_dataclass_args, dataclass_from_args

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, TrainConfig)
    add_dataclass_args(parser, SamplingConfig)  # no duplicate --batch_size / --seed
    args = parser.parse_args(["--batch_size", "4", "--seed", "9", "--max_tokens_per_batch", "5000",
                              "--dataset_weights", "a=0.5,b=1.2", "--src_img_num_weights", "0=1,1=1",
                              "--drop_last", "--bucket_policy", "tokens"])
    cfg = dataclass_from_args(SamplingConfig, args)
    assert cfg == SamplingConfig(batch_size=4, seed=9, max_tokens_per_batch=5000, dataset_weights="a=0.5,b=1.2",
                                 src_img_num_weights="0=1,1=1", drop_last=True, bucket_policy="tokens")
    with pytest.raises(SystemExit):
        parser.parse_args(["--bucket_policy", "nope"])
