"""Real batches in `qie train` (issue 6): the bucketing sampler, several caches, JSONL rows of every kind.

Two small caches are built once per module with the tiny encoders (CPU, fp32,
64x64-pixel budget): a FireRed-style JSONL demo cached with ``t2i_mode`` (edit,
two-source, inverse and text-to-image rows, two prompts each) and a DiffSynth-format
demo (which has edit masks). Training runs are a handful of steps of the tiny DiT.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from pathlib import Path

import pytest
import torch

CACHE_MAX_PIXELS = 64 * 64


# --- fixtures ------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _cache(pipe, metadata: Path, out: Path, t2i_mode: bool = False) -> Path:
    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.formats import DatasetConfig

    write_cache(CacheConfig(cache_dir=str(out), model="tiny", max_pixels=CACHE_MAX_PIXELS, num_workers=1,
                            dataset=DatasetConfig(dataset_metadata=str(metadata), t2i_mode=t2i_mode)),
                pipe=pipe, rank=0, world_size=1)
    return out


@pytest.fixture(scope="module")
def jsonl_cache(tiny_pipe, tmp_path_factory):
    """FireRed JSONL demo, cached with t2i_mode: 4 pairs of mixed sizes (one with two sources, three with
    inverse texts) + 2 text-to-image rows = 9 entries."""
    from diffsynth_qie.data.demo import make_demo_jsonl

    data = make_demo_jsonl(tmp_path_factory.mktemp("firered"), num_pairs=4, seed=1, mixed_sizes=True, num_t2i=2)
    return _cache(tiny_pipe, data / "metadata.jsonl", tmp_path_factory.mktemp("firered-cache"), t2i_mode=True)


@pytest.fixture(scope="module")
def demo_cache(tiny_pipe, tmp_path_factory):
    """A DiffSynth-format demo with edit masks: 4 rows (one with two sources), cached."""
    from diffsynth_qie.data.demo import make_demo_data

    data = make_demo_data(tmp_path_factory.mktemp("demo"), num_pairs=4, seed=2, mixed_sizes=True)
    return _cache(tiny_pipe, data / "metadata.json", tmp_path_factory.mktemp("demo-cache"))


def _store(path):
    from diffsynth_qie.cache.store import CacheStore

    return CacheStore.open(path)


def _name(path) -> str:
    """The dataset name a cache's entries hold (one per cache here)."""
    store = _store(path)
    names = {store.meta(i).dataset for i in range(len(store))}
    assert len(names) == 1
    return names.pop()


def run_config(cache_dir, out, model_dir, sampling=None, loss=None, **train):
    from diffsynth_qie.data.sampling import SamplingConfig
    from diffsynth_qie.training import config as tc

    t = dict(model="tiny", model_dir=str(model_dir), batch_size=4, gradient_accumulation_steps=1, max_steps=4,
             mixed_precision="no", gradient_checkpointing=False, cfg_dropout=0.0, save_every=0, seed=0, device="cpu")
    t.update(train)
    return tc.RunConfig(train=tc.TrainConfig(cache_dir=cache_dir, output_dir=str(out), **t),
                        lora=tc.LoRAConfig(lora_rank=4), optim=tc.OptimConfig(learning_rate=1e-2),
                        loss=tc.LossConfig(**(loss or {})), sampling=SamplingConfig(**(sampling or {})))


def resolved(cfg):
    from diffsynth_qie.models.presets import get_preset

    return cfg.resolved(get_preset(cfg.train.model, zero_cond_t=cfg.train.zero_cond_t))


def spy_batches(monkeypatch) -> list[dict]:
    """Record every batch the training module's forward receives (what the loop actually trains on)."""
    from diffsynth_qie.training.module import QIETrainingModule

    seen: list[dict] = []
    original = QIETrainingModule.forward

    def forward(self, batch=None, generator=None, **kw):
        if batch is not None:
            seen.append({"position": list(batch["position"]), "entry_id": list(batch["entry_id"]),
                         "prompt_index": list(batch["prompt_index"]),
                         "target": [tuple(t.shape) for t in batch["target_latents"]],
                         "edits": [[tuple(e.shape) for e in es] for es in batch["edit_latents"]]})
        return original(self, batch, generator, **kw)

    monkeypatch.setattr(QIETrainingModule, "forward", forward)
    return seen


def tokens_of(target, edits) -> int:
    return sum((h // 2) * (w // 2) for _, h, w in [target, *edits])


def fresh_dit(model_dir):
    from diffsynth_qie.models.load.loading import load_pipeline

    return load_pipeline("tiny", model_dir=model_dir, components=("dit",), device="cpu",
                         torch_dtype=torch.float32).dit


# --- flags and config ------------------------------------------------------------------
def test_train_flags_fill_the_sampling_config_and_several_caches(tmp_path):
    from diffsynth_qie.commands import train as train_cmd
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.config import RunConfig, TrainConfig
    from diffsynth_qie.training.data import parse_cache_spec

    parser = argparse.ArgumentParser()
    train_cmd.add_arguments(parser)
    args = parser.parse_args(["--cache_dir", "c/a", "x=c/b", "--output_dir", "o", "--batch_size", "4", "--seed", "7",
                              "--max_tokens_per_batch", "900", "--dataset_weights", "a=0.5,x=1.2",
                              "--src_img_num_weights", "0=1,1=2", "--bucket_policy", "tokens", "--drop_last",
                              "--samples_per_epoch", "50"])
    cfg = train_cmd.config_from_args(args)
    s = cfg.sampling
    assert cfg.train.cache_dir == ["c/a", "x=c/b"]
    assert (s.batch_size, s.seed, s.max_tokens_per_batch, s.dataset_weights, s.src_img_num_weights,
            s.bucket_policy, s.drop_last, s.samples_per_epoch) == (4, 7, 900, "a=0.5,x=1.2", "0=1,1=2", "tokens",
                                                                   True, 50)
    # TrainConfig's batch_size / seed always win over the sampling section's (copied by resolved())
    r = RunConfig(train=TrainConfig(cache_dir="one", output_dir="o", batch_size=3, seed=5)).resolved(get_preset("tiny"))
    assert (r.sampling.batch_size, r.sampling.seed, r.train.cache_dir) == (3, 5, ["one"])
    bad = parser.parse_args(["--cache_dir", "c", "--output_dir", "o", "--samples_per_epoch", "10"])
    with pytest.raises(ValueError, match="samples_per_epoch"):
        train_cmd.config_from_args(bad).resolved(get_preset("tiny"))
    # NAME=DIR names a cache; an existing directory with '=' in its name stays a path
    odd = tmp_path / "k=v"
    odd.mkdir()
    assert parse_cache_spec("x=c/b") == ("x", "c/b")
    assert parse_cache_spec("c/b") == (None, "c/b")
    assert parse_cache_spec(str(odd)) == (None, str(odd))
    with pytest.raises(ValueError, match="NAME=DIR"):
        parse_cache_spec("x=")


# --- JSONL rows of every kind: cache and train -------------------------------------------
def test_jsonl_rows_of_every_kind_cache_and_train_at_batch_4(jsonl_cache, tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.data import build_training_data
    from diffsynth_qie.training.loop import train
    from diffsynth_qie.training.tracking import read_loss_log

    store = _store(jsonl_cache)
    metas = {store.meta(i).entry_id: store.meta(i) for i in range(len(store))}
    kinds = {
        "t2i": {e for e, m in metas.items() if m.n_edit == 0},
        "edit": {e for e, m in metas.items() if m.n_edit == 1 and not m.inverse},
        "multi-source": {e for e, m in metas.items() if m.n_edit == 2},
        "inverse": {e for e, m in metas.items() if m.inverse},
        "two prompts": {e for e, m in metas.items() if m.n_prompts == 2},
    }
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}  # the cache holds every kind
    assert kinds["two prompts"] == set(metas)  # instruction + instruction_cn (inverse: both inverse texts)

    cfg = run_config(str(jsonl_cache), tmp_path / "run", tiny_model_dir, zero_cond_t=True)
    steps = len(build_training_data(cfg.train.cache_dir, get_preset("tiny"),
                                    resolved(cfg).sampling).sampler.epoch_batches(0))  # one epoch
    seen = spy_batches(monkeypatch)
    out = tmp_path / "run"
    result = train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps)))

    assert len(seen) == steps and max(len(b["entry_id"]) for b in seen) == 4
    trained = [e for b in seen for e in b["entry_id"]]
    assert sorted(trained) == sorted(metas)  # an unweighted epoch: every entry once, so every kind was in a batch
    assert any(len(set(b["target"])) > 1 or len({len(e) for e in b["edits"]}) > 1 for b in seen)  # mixed shapes
    chosen = {p for b in seen for e, p in zip(b["entry_id"], b["prompt_index"]) if e in kinds["two prompts"]}
    assert chosen == {0, 1}  # both prompt alternatives picked
    assert all(math.isfinite(v) for v in result.losses) and len(result.losses) == steps
    lora = load_file(str(result.lora_path))
    b_norm = sum(float(v.norm()) for k, v in lora.items() if "lora_B" in k or "lora_up" in k)
    assert b_norm > 0  # LoRA B starts at zero: training changed the LoRA

    # loss.jsonl carries each step's padding fraction (token-weighted over the step's batch)
    log_rows = read_loss_log(out / "loss.jsonl")
    for row, b in zip(log_rows, seen):
        toks = [tokens_of(t, e) for t, e in zip(b["target"], b["edits"])]
        assert row["padding_fraction"] == pytest.approx(1 - sum(toks) / (len(toks) * max(toks)), abs=1e-6)
    assert any(r["padding_fraction"] > 0 for r in log_rows)


def test_max_tokens_per_batch_bounds_the_batches_the_loop_sees(jsonl_cache, tiny_model_dir, tmp_path, monkeypatch):
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.data import build_training_data
    from diffsynth_qie.training.loop import train

    store = _store(jsonl_cache)
    tokens = sorted(store.meta(i).image_tokens for i in range(len(store)))
    budget = 3 * tokens[len(tokens) // 2]  # about three median samples per batch
    cfg = resolved(run_config(str(jsonl_cache), tmp_path, tiny_model_dir, sampling={"max_tokens_per_batch": budget}))
    expected = build_training_data(cfg.train.cache_dir, get_preset("tiny"), cfg.sampling).sampler.epoch_batches(0)
    seen = spy_batches(monkeypatch)
    train(run_config(str(jsonl_cache), tmp_path, tiny_model_dir, sampling={"max_tokens_per_batch": budget},
                     max_steps=len(expected)))
    assert [b["position"] for b in seen] == expected  # the loop trains exactly the sampler's batches
    for b in seen:
        toks = [tokens_of(t, e) for t, e in zip(b["target"], b["edits"])]
        assert len(toks) == 1 or len(toks) * max(toks) <= budget, (toks, budget)
    assert max(len(b["position"]) for b in seen) > 1 and len({len(b["position"]) for b in seen}) > 1


# --- batch 4 (mixed shapes, sources, masks) == 4 single-sample steps ----------------------
def _grads(module):
    return {n: p.grad.detach().clone() for n, p in module.trainable_named_parameters() if p.grad is not None}


def test_batch_of_four_mixed_equals_four_single_steps(jsonl_cache, demo_cache, tiny_model_dir, tmp_path):
    from diffsynth_qie.training.data import CacheDataset, CachePart, SampleKey, collate
    from diffsynth_qie.training.module import QIETrainingModule

    cfg = resolved(run_config(str(jsonl_cache), tmp_path, tiny_model_dir, zero_cond_t=True,
                              loss={"mask_loss_weights": (2.0, 0.5)}))
    module = QIETrainingModule(fresh_dit(tiny_model_dir), cfg, "tiny")
    with torch.no_grad():  # non-zero LoRA B so every LoRA tensor gets a gradient
        for n, p in module.trainable_named_parameters():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    a, b = _store(jsonl_cache), _store(demo_cache)
    ds = CacheDataset.from_parts([CachePart(a, tuple(range(len(a)))), CachePart(b, tuple(range(len(b))))])

    used: set = set()

    def pick(pred):  # the first match, preferring a target size not picked yet
        matches = [p for p in range(len(ds)) if pred(ds.meta(p))]
        p = next((p for p in matches if ds.meta(p).target_shape not in used), matches[0])
        used.add(ds.meta(p).target_shape)
        return p

    picks = [pick(lambda m: m.n_edit == 0),                                    # text-to-image
             pick(lambda m: m.inverse),                                        # inverse edit
             pick(lambda m: m.has_back_mask and m.n_edit == 2),                # two sources, masked
             pick(lambda m: m.has_back_mask and m.n_edit == 1)]                # one source, masked
    samples = [ds[SampleKey(p, 0)] for p in picks]
    layouts = {(tuple(s["target_latents"].shape), tuple(tuple(e.shape) for e in s["edit_latents"])) for s in samples}
    assert len(layouts) == 4 and len({tuple(s["target_latents"].shape) for s in samples}) >= 3

    module.zero_grad()
    loss4, _ = module(collate(samples), torch.Generator().manual_seed(5))
    loss4.backward()
    g4 = _grads(module)

    module.zero_grad()
    gen = torch.Generator().manual_seed(5)  # the loss draws σ and noise sample by sample: same draws
    singles = []
    for s in samples:
        l1, _ = module(collate([s]), gen)
        (l1 / 4).backward()
        singles.append(float(l1.detach()))
    g1 = _grads(module)
    assert float(loss4.detach()) == pytest.approx(sum(singles) / 4, rel=1e-5)
    assert set(g1) == set(g4) and len(g4) > 0
    for n in g4:
        assert torch.allclose(g4[n], g1[n], rtol=1e-4, atol=1e-7), n


# --- mask-aware loss through the loss function ----------------------------------------------
@torch.no_grad()
def test_mask_loss_weights_follow_the_per_sample_formula(demo_cache, tiny_model_dir, tmp_path):
    """Through flow_match_sft_loss with a real cached mask: L(i, o) = (i·A·L10 + o·(1-A)·L01) / (i·A + o·(1-A)),
    A = mean mask (per-sample normalisation: scale-free, ratio i/o); a sample without a mask is unweighted."""
    from diffsynth_qie.training.data import CacheDataset, SampleKey, collate
    from diffsynth_qie.training.losses.sft import flow_match_sft_loss

    store = _store(demo_cache)
    ds = CacheDataset(store)
    masked = next(i for i in range(len(store)) if store.meta(i).has_back_mask)
    sample = ds[SampleKey(masked, 0)]
    area = float(sample["back_mask"].float().clamp(0, 1).mean())
    assert 0.02 < area < 0.98
    dit = fresh_dit(tiny_model_dir)

    def loss(weights, samples=(sample,)):
        cfg = resolved(run_config(str(demo_cache), tmp_path, tiny_model_dir, loss={"mask_loss_weights": weights}))
        return float(flow_match_sft_loss(dit, collate(list(samples)), cfg, torch.Generator().manual_seed(3))[0])

    l10, l01, plain = loss((1.0, 0.0)), loss((0.0, 1.0)), loss(None)
    assert l10 != pytest.approx(l01, rel=1e-3)
    for i, o in ((2.0, 1.0), (1.0, 3.0), (5.0, 0.5)):
        expected = (i * area * l10 + o * (1 - area) * l01) / (i * area + o * (1 - area))
        assert loss((i, o)) == pytest.approx(expected, rel=1e-4)
        assert loss((10 * i, 10 * o)) == pytest.approx(loss((i, o)), rel=1e-5)  # only the ratio matters
    assert loss((1.0, 1.0)) == pytest.approx(plain, rel=1e-5)
    # in a batch, a row without a mask keeps its plain loss whatever the weights
    other = dict(ds[SampleKey((masked + 1) % len(store), 0)], back_mask=None)
    gen = torch.Generator().manual_seed(3)
    cfg = resolved(run_config(str(demo_cache), tmp_path, tiny_model_dir, loss={"mask_loss_weights": (4.0, 1.0)}))
    la = float(flow_match_sft_loss(dit, collate([sample]), cfg, gen)[0])
    lb = float(flow_match_sft_loss(dit, collate([other]), resolved(run_config(
        str(demo_cache), tmp_path, tiny_model_dir)), gen)[0])
    assert loss((4.0, 1.0), (sample, other)) == pytest.approx((la + lb) / 2, rel=1e-5)


# --- several caches: weights, exclusion, names, resume ------------------------------------------
def test_dataset_weights_over_two_caches_realise_the_mix(jsonl_cache, demo_cache, caplog):
    from diffsynth_qie.data.sampling import SamplingConfig, realised_mix
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.data import build_training_data

    a, b = _name(jsonl_cache), _name(demo_cache)
    assert a != b
    dirs = [str(jsonl_cache), str(demo_cache)]
    epochs, draws = 10, 400
    caplog.set_level(logging.INFO, logger="diffsynth_qie")
    data = build_training_data(dirs, get_preset("tiny"), SamplingConfig(
        batch_size=4, seed=0, dataset_weights=f"{a}=1,{b}=3", samples_per_epoch=draws))
    infos = data.dataset.sample_infos()
    assert len(data.dataset) == len(_store(jsonl_cache)) + len(_store(demo_cache))
    mixes = [realised_mix(data.sampler.global_batches(e), infos) for e in range(epochs)]
    share_a = sum(m.datasets.get(a, 0.0) * m.samples for m in mixes) / sum(m.samples for m in mixes)
    # 4000 draws with p = 0.25: standard deviation 0.007; tolerance 0.03 (> 4 sd)
    assert share_a == pytest.approx(0.25, abs=0.03)
    assert all(m.samples == draws for m in mixes)
    epoch_logs = [r.getMessage() for r in caplog.records if "padding" in r.getMessage() and "mix" in r.getMessage()]
    assert len(epoch_logs) == epochs  # one line per epoch (rank 0): padding fraction and realised mix

    # a dataset the weights don't name is excluded (logged)
    caplog.clear()
    only_b = build_training_data(dirs, get_preset("tiny"), SamplingConfig(batch_size=4, dataset_weights=f"{b}=1"))
    names = {infos[i].dataset for e in range(3) for batch in only_b.sampler.global_batches(e) for i in batch}
    assert names == {b}
    assert any("excludes dataset" in r.getMessage() and a in r.getMessage() for r in caplog.records)
    # NAME=DIR names caches explicitly (here the same cache twice, as two datasets)
    named = build_training_data([f"x={jsonl_cache}", f"y={jsonl_cache}"], get_preset("tiny"),
                                SamplingConfig(batch_size=2, dataset_weights="x=1,y=1", samples_per_epoch=draws))
    mix = realised_mix([bt for e in range(epochs) for bt in named.sampler.global_batches(e)],
                       named.dataset.sample_infos())
    assert set(mix.datasets) == {"x", "y"} and mix.datasets["x"] == pytest.approx(0.5, abs=0.03)
    with pytest.raises(ValueError, match="unknown dataset"):
        build_training_data(dirs, get_preset("tiny"), SamplingConfig(dataset_weights="nope=1"))


def test_stream_resumes_exactly_with_the_bucket_sampler(jsonl_cache, demo_cache):
    """The checkpointed DataPosition restores the same remaining batches (weighted, two caches, epoch ends)."""
    from diffsynth_qie.data.sampling import SamplingConfig
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.data import DataPosition, build_training_data, iterate_batches

    cfg = SamplingConfig(batch_size=3, seed=4, dataset_weights=f"{_name(jsonl_cache)}=1,{_name(demo_cache)}=2",
                         samples_per_epoch=12)
    data = build_training_data([str(jsonl_cache), str(demo_cache)], get_preset("tiny"), cfg, seed=4, cfg_dropout=0.3)

    def take(start, n):
        stream = iterate_batches(data.dataset, data.sampler, start)
        out = [(pos, b["position"], b["entry_id"], b["dropped"]) for (b, pos), _ in zip(stream, range(n))]
        stream.close()
        return out

    per_epoch = len(data.sampler.epoch_batches(0))
    full = take(DataPosition(), 3 * per_epoch)
    assert [e[1] for e in full[:per_epoch]] == data.sampler.epoch_batches(0)
    for cut in (2, per_epoch - 1, per_epoch + 1):
        assert take(full[cut][0], 5) == full[cut + 1:cut + 6]


# --- unequal micro-batches: every sample of the optimizer step counts once ------------------------
def test_micro_loss_scale_weighs_every_sample_of_the_step_once():
    """Simulated ranks with unequal micro-batches: after accelerate's 1/G and the DDP rank average,
    each sample's weight in the step's gradient is 1/N (N = samples of the step over all ranks)."""
    from diffsynth_qie.training.accumulation import micro_loss_scale, step_mean, step_sample_count

    for sizes_per_rank in ([[1, 3]], [[1, 3], [2, 2]], [[4, 1, 2], [1, 1, 1], [3, 3, 3]]):
        world, accumulation = len(sizes_per_rank), len(sizes_per_rank[0])
        total = sum(step_sample_count(sizes) for sizes in sizes_per_rank)
        weights = []  # what one sample of micro-batch m contributes: scale · (1/n_m) · (1/G) · (1/W)
        for sizes in sizes_per_rank:
            for n in sizes:
                scale = micro_loss_scale(n, total, accumulation, world)
                weights += [scale / n / accumulation / world] * n
        assert len(weights) == total
        assert weights == pytest.approx([1 / total] * total, rel=1e-12)
        # the logged loss: mean over ranks of each rank's step_mean = Σ n_m·loss_m / N
        losses = [[torch.tensor(float(7 * r + m + 1)) for m in range(accumulation)] for r in range(world)]
        logged = sum(float(step_mean(ls, [micro_loss_scale(n, total, accumulation, world) for n in sizes]))
                     for ls, sizes in zip(losses, sizes_per_rank)) / world
        expected = sum(float(l) * n for ls, sizes in zip(losses, sizes_per_rank) for l, n in zip(ls, sizes)) / total
        assert logged == pytest.approx(expected, rel=1e-6)
    # equal micro-batches: the scale is exactly 1 (today's numbers, the pinned curve, stay bit for bit)
    assert micro_loss_scale(2, 2 * 2 * 3, 2, 3) == 1.0


def test_unequal_micro_batches_give_the_gradient_of_one_batch(cache_dir, tiny_model_dir, tmp_path, monkeypatch):
    """Micro-batches of 1 and 3 samples accumulated into one step give the gradient (and the logged loss)
    of the per-sample mean over the 4 samples, i.e. of one batch of 4 with the same draws."""
    from accelerate.utils import set_seed

    from diffsynth_qie.cache.store import CacheStore
    from diffsynth_qie.data.sampling import BucketBatchSampler
    from diffsynth_qie.training import optim
    from diffsynth_qie.training.data import CacheDataset, SampleKey, collate
    from diffsynth_qie.training.loop import micro_seed, train
    from diffsynth_qie.training.module import QIETrainingModule

    micro_batches = [[0], [1, 2, 3]]
    monkeypatch.setattr(BucketBatchSampler, "epoch_batches", lambda self, epoch: [list(b) for b in micro_batches])
    spies = []

    class GradSpy(torch.optim.SGD):  # records the accumulated gradients the optimizer step sees
        def __init__(self, params, config, deepspeed=False):
            super().__init__(list(params), lr=0.0)
            self.grads = []
            spies.append(self)

        def step(self, closure=None):
            self.grads.append([p.grad.detach().clone() if p.grad is not None else None
                               for g in self.param_groups for p in g["params"]])
            return super().step(closure)

    monkeypatch.setattr(optim, "build_optimizer", GradSpy)
    cfg = run_config(str(cache_dir), tmp_path / "run", tiny_model_dir, batch_size=3, gradient_accumulation_steps=2,
                     max_steps=1, zero_cond_t=True)
    result = train(cfg)
    (got,) = spies[0].grads

    set_seed(cfg.train.seed)  # the LoRA init, as the loop makes it
    module = QIETrainingModule(fresh_dit(tiny_model_dir), resolved(cfg), "tiny")
    module.upcast_trainable(torch.float32)
    ds = CacheDataset(CacheStore.open(cache_dir), seed=cfg.train.seed)
    total = sum(len(b) for b in micro_batches)
    losses = []
    for m, positions in enumerate(micro_batches):
        gen = torch.Generator().manual_seed(micro_seed(cfg.train.seed, 0, 0, m))
        loss, _ = module(collate([ds[SampleKey(p, 0)] for p in positions]), gen)
        (loss * len(positions) / total).backward()  # the batch mean times its share = sum over samples / 4
        losses.append(float(loss.detach()))
    want = [p.grad for p in module.trainable_modules()]
    assert len(got) == len(want) and sum(g is not None for g in want) > 0
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert torch.allclose(g, w, rtol=1e-4, atol=1e-8), float((g - w).abs().max())
    assert result.losses[0] == pytest.approx((losses[0] * 1 + losses[1] * 3) / total, rel=1e-5)
    assert abs(losses[0] - losses[1]) > 1e-3  # the two micro-batch means differ: a plain mean would not match
