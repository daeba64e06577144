"""Phase-2 training on the tiny model (CPU, fp32): losses, batching, LoRA, checkpoints, resume.

One cache is built per module from the session's demo data; the reference run (the
pinned loss curve in tests/assets/train_loss_curve.json) is trained once and shared.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import curve_script  # noqa: E402  (tests/assets/make_train_loss_curve.py)

ASSETS = Path(__file__).parent / "assets"
PINNED = json.loads((ASSETS / "train_loss_curve.json").read_text())


# --- fixtures ------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture(scope="module")
def store(cache_dir):
    from diffsynth_qie.cache.store import CacheStore

    return CacheStore.open(cache_dir)


def make_config(cache_dir, out, model_dir, sections=None, **train):
    """The pinned reference config, with section overrides and train-field overrides."""
    s = copy.deepcopy(PINNED["config"])
    for name, values in (sections or {}).items():
        s.setdefault(name, {}).update(values)
    s["train"].update(train)
    return curve_script.run_config(s, cache_dir, out, model_dir)


@pytest.fixture(scope="module")
def reference_run(cache_dir, tiny_model_dir, tmp_path_factory):
    """The pinned run, trained once: (config, TrainResult)."""
    from accelerate.state import AcceleratorState, GradientState

    from diffsynth_qie.training.loop import train

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    cfg = make_config(cache_dir, tmp_path_factory.mktemp("reference"), tiny_model_dir)
    return cfg, train(cfg)


def fresh_dit(model_dir):
    from diffsynth_qie.models.load.loading import load_pipeline

    return load_pipeline("tiny", model_dir=model_dir, components=("dit",), device="cpu",
                         torch_dtype=torch.float32).dit


def resolved(cfg):
    from diffsynth_qie.models.presets import get_preset

    return cfg.resolved(get_preset(cfg.train.model, zero_cond_t=cfg.train.zero_cond_t))


@torch.no_grad()
def eval_loss(dit, store, zero_cond_t=False, sigmas=(0.3, 0.7)) -> float:
    """Deterministic flow-matching loss over the whole cache at fixed σ and noise."""
    from diffsynth_qie.models.qwen_image_edit.forward import dit_forward

    g = torch.Generator().manual_seed(123)
    losses = []
    for i in range(len(store)):
        e = store.load(i)
        for s in sigmas:
            noise = torch.randn(e.target_latents.shape, generator=g)
            x = (1 - s) * e.target_latents + s * noise
            v = dit_forward(dit, [x], torch.tensor([s * 1000.0]), [e.prompt_embs[0]], [e.edit_latents],
                            zero_cond_t=zero_cond_t)[0]
            losses.append(float(((v - (noise - e.target_latents)) ** 2).mean()))
    return sum(losses) / len(losses)


# --- pure helpers: schedule, timesteps, loss pieces ----------------------------------
def test_lr_schedule_warmup_and_cosine_values():
    from diffsynth_qie.training.config import OptimConfig
    from diffsynth_qie.training.optim import build_lr_scheduler, lr_factor

    assert [lr_factor(s, 4, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # cosine: 1 right after warmup, min_lr_ratio at the last step, halfway in the middle
    assert lr_factor(2, 2, 12, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(11, 2, 12, "cosine", 0.1) == pytest.approx(0.1)
    mid = lr_factor(2 + 9 / 2, 2, 12, "cosine", 0.1)
    assert mid == pytest.approx(0.1 + 0.9 * 0.5)
    # the LambdaLR the loop steps once per optimizer step yields exactly these factors
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2e-3)
    sched = build_lr_scheduler(opt, OptimConfig(learning_rate=2e-3, warmup_steps=2, lr_schedule="cosine",
                                                min_lr_ratio=0.1), total_steps=10)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [2e-3 * lr_factor(s, 2, 10, "cosine", 0.1) for s in range(10)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert seen[0] == pytest.approx(1e-3) and seen[-1] == pytest.approx(2e-4)


def test_clipping_guard_refuses_prodigy_with_clipping(cache_dir, tiny_model_dir, tmp_path):
    from diffsynth_qie.training.config import OptimConfig
    from diffsynth_qie.training.loop import train
    from diffsynth_qie.training.optim import check_clipping

    sf = OptimConfig(optimizer="prodigy_sf")
    check_clipping(sf)  # default: no clipping for prodigy_sf
    check_clipping(sf, {"gradient_clipping": 0})
    check_clipping(OptimConfig(optimizer="adamw", max_grad_norm=1.0), {"gradient_clipping": 1.0})
    with pytest.raises(ValueError, match="max_grad_norm"):
        check_clipping(OptimConfig(optimizer="prodigy_sf", max_grad_norm=1.0))
    with pytest.raises(ValueError, match="gradient_clipping"):
        check_clipping(sf, {"gradient_clipping": 0.5})
    # --max_grad_norm is the one place clipping is configured: it is written into the DeepSpeed config
    from diffsynth_qie.training.optim import configure_deepspeed

    for shipped in ({}, {"gradient_clipping": "auto"}):  # accelerate would turn either into 1.0
        ds = dict(shipped)
        configure_deepspeed(ds, sf, 3)
        assert ds == {"gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 3}
    ds = {"gradient_clipping": "auto"}
    configure_deepspeed(ds, OptimConfig(optimizer="adamw"), 2)
    assert ds["gradient_clipping"] == 1.0  # adamw's default
    with pytest.raises(ValueError, match=r"gradient_clipping to 1.0 but --max_grad_norm is 0.5"):
        check_clipping(OptimConfig(optimizer="adamw", max_grad_norm=0.5), {"gradient_clipping": 1.0})
    # and train() refuses before touching the model
    cfg = make_config(cache_dir, tmp_path, tiny_model_dir, {"optim": {"optimizer": "prodigy_sf", "max_grad_norm": 0.5,
                                                                      "learning_rate": 1.0}})
    with pytest.raises(ValueError, match="must not clip"):
        train(cfg)


def test_config_defaults_come_from_preset_and_flags(tmp_path):
    import argparse

    from diffsynth_qie.commands import train as train_cmd
    from diffsynth_qie.models.presets import LORA_TARGETS_2511, get_preset

    parser = argparse.ArgumentParser()
    train_cmd.add_arguments(parser)
    args = parser.parse_args(["--cache_dir", "c", "--output_dir", "o", "--model", "2511", "--batch_size", "3",
                              "--optimizer", "prodigy_sf", "--mask_loss_weights", "2", "0.5", "--lora_rank", "8"])
    cfg = train_cmd.config_from_args(args)
    assert cfg.train.batch_size == 3 and cfg.loss.mask_loss_weights == (2.0, 0.5)
    r = cfg.resolved(get_preset("2511"))
    assert r.train.zero_cond_t is True
    assert r.lora.lora_target_modules == list(LORA_TARGETS_2511)
    assert {"img_in", "txt_in", "proj_out"} <= set(r.lora.lora_target_modules)
    assert r.lora.lora_alpha == 8.0
    assert (r.optim.learning_rate, r.optim.max_grad_norm, r.optim.weight_decay) == (1.0, 0.0, 0.0)
    # an explicit override wins over the preset; 2509 has no zero_cond_t
    assert cfg.resolved(get_preset("2511", zero_cond_t=False)).train.zero_cond_t is False
    assert cfg.resolved(get_preset("2509")).train.zero_cond_t is False
    with pytest.raises(SystemExit):  # the flag declares its range: argparse's one-line usage error
        parser.parse_args(["--cache_dir", "c", "--output_dir", "o", "--cfg_dropout", "1.5"])
    good = parser.parse_args(["--cache_dir", "c", "--output_dir", "o"])
    bad = train_cmd.config_from_args(good)
    bad.train.cfg_dropout = 1.5  # a config built in Python is checked too
    with pytest.raises(ValueError, match="cfg_dropout"):
        bad.resolved()


def test_timesteps_are_per_sample_from_the_qwen_schedule():
    from diffsynth.diffusion.flow_match import FlowMatchScheduler

    from diffsynth_qie.training.config import TimestepConfig
    from diffsynth_qie.models.family import EDIT
    from diffsynth_qie.training.timesteps import draw_timesteps

    ref = FlowMatchScheduler("Qwen-Image")
    ref.set_timesteps(1000, training=True)
    d = draw_timesteps(64, TimestepConfig(), torch.Generator().manual_seed(0), family=EDIT)
    assert len(set(d.index.tolist())) > 40  # per sample, not one per batch
    assert torch.equal(d.sigmas, ref.sigmas[d.index].float())
    assert torch.allclose(d.timesteps, d.sigmas * 1000)
    for t, w in zip(d.timesteps, d.weights):  # DiffSynth's own per-timestep weight
        assert float(ref.training_weight(t)) == pytest.approx(float(w))
    # boundaries and logit-normal stay inside the table
    high = draw_timesteps(256, TimestepConfig(min_timestep_boundary=0.5), torch.Generator().manual_seed(1),
                          family=EDIT)
    assert int(high.index.min()) >= 500 and float(high.sigmas.max()) <= float(ref.sigmas[500]) + 1e-6
    ln = draw_timesteps(4096, TimestepConfig(timestep_sampling="logit_normal"), torch.Generator().manual_seed(2),
                        family=EDIT)
    assert 0 <= int(ln.index.min()) and int(ln.index.max()) <= 999
    frac_mid = float(((ln.index > 250) & (ln.index < 750)).float().mean())
    assert frac_mid > 0.6  # logit-normal(0, 1) puts ~68 % of mass in the middle half of u


def test_mask_weights_keep_the_loss_scale_and_ratio():
    from diffsynth_qie.training.losses.common import mask_weights, per_sample_mse

    pred = torch.zeros(16, 8, 8)
    target = torch.full((16, 8, 8), 2.0)  # uniform squared error 4
    for area in (1, 10, 40, 63):
        m = torch.zeros(1, 8, 8)
        m.view(-1)[:area] = 1
        w = mask_weights(m, 3.0, 1.0)
        assert per_sample_mse(pred, target, w) == pytest.approx(4.0)  # scale independent of mask size
        assert float(w.view(-1)[0] / w.view(-1)[-1]) == pytest.approx(3.0)  # inside/outside ratio
    # equal weights = plain MSE; (1, 0) = mean over the edit region only
    m = torch.zeros(1, 8, 8)
    m[:, :4] = 1
    err = torch.zeros(16, 8, 8)
    err[:, :4] = 1.0
    assert per_sample_mse(err, torch.zeros_like(err), mask_weights(m, 1.0, 1.0)) == pytest.approx(0.5)
    assert per_sample_mse(err, torch.zeros_like(err), mask_weights(m, 1.0, 0.0)) == pytest.approx(1.0)
    assert per_sample_mse(err, torch.zeros_like(err), mask_weights(m, 0.0, 1.0)) == pytest.approx(0.0)


def test_flow_points_are_per_sample_and_share_sigma_and_noise_with_a_paired_image():
    """common.draw_flow_points: σ_b then ε_b per sample (a batch of 2 draws what two batches of 1 draw from one
    generator), x_σ = (1-σ)·x0 + σ·ε in the latents' dtype, target ε - x0 in fp32, and ``at`` noises other
    latents (DPO's rejected image) at each sample's own σ and ε."""
    from diffsynth_qie.models.family import EDIT
    from diffsynth_qie.training.config import TimestepConfig
    from diffsynth_qie.training.losses.common import draw_flow_points
    from diffsynth_qie.training.timesteps import Strata

    g = torch.Generator().manual_seed(3)
    x = [torch.randn(4, 2, 3, generator=g).to(torch.bfloat16) for _ in range(2)]
    other = [torch.randn(4, 2, 3, generator=g) for _ in range(2)]
    cfg = TimestepConfig(timestep_sampling="stratified")
    both = draw_flow_points(x, cfg, torch.Generator().manual_seed(5), family=EDIT, strata=Strata((1, 0), 2))
    one = torch.Generator().manual_seed(5)
    alone = [draw_flow_points([xb], cfg, one, family=EDIT, strata=Strata((k,), 2)) for xb, k in zip(x, (1, 0))]
    assert torch.equal(both.sigmas, torch.cat([a.sigmas for a in alone]))
    assert torch.equal(both.weights, torch.cat([a.weights for a in alone])) and both.weights.shape == (2,)
    assert torch.allclose(both.timesteps, 1000 * both.sigmas)
    assert float(both.sigmas[0]) < float(both.sigmas[1])  # stratum 1 of 2: the table's second half, nearer the data
    noisy_other, target_other = both.at(other)
    for b in range(2):
        eps, s = both.noise[b].float(), float(both.sigmas[b])
        assert torch.equal(eps, alone[b].noise[0].float()) and both.noisy[b].dtype == torch.bfloat16
        assert torch.allclose(both.noisy[b].float(), ((1 - s) * x[b].float() + s * eps).bfloat16().float())
        assert both.target[b].dtype == torch.float32 and torch.equal(both.target[b], eps - x[b].float())
        assert torch.allclose(noisy_other[b], (1 - s) * other[b] + s * eps)
        assert torch.equal(target_other[b], eps - other[b])


def test_pixel_weights_read_the_masks_only_with_the_flag():
    from diffsynth_qie.training.losses.common import mask_weights, pixel_weights

    masks = [torch.rand(1, 4, 4), None]
    assert pixel_weights(None, masks, 2) == [None, None]
    assert pixel_weights((1.0, 0.5), None, 2) == [None, None]  # a batch without masks
    w = pixel_weights((2.0, 0.5), masks, 2)
    assert torch.equal(w[0], mask_weights(masks[0], 2.0, 0.5)) and w[1] is None


# --- data ------------------------------------------------------------------------------
def test_dataset_dropout_and_prompt_choice_are_deterministic(store):
    from diffsynth_qie.training.data import CacheDataset, SampleKey

    ds = CacheDataset(store, seed=7, cfg_dropout=0.5)
    draws = [ds[SampleKey(i, e)]["dropped"] for e in range(40) for i in range(len(ds))]
    assert 0.35 < sum(draws) / len(draws) < 0.65
    a, b = ds[SampleKey(3, 5)], ds[SampleKey(3, 5)]
    assert a["dropped"] == b["dropped"] and torch.equal(a["prompt_emb"], b["prompt_emb"])
    for e in range(40):
        s = ds[SampleKey(0, e)]
        entry = store.load(0)
        expected = entry.empty_prompt_emb if s["dropped"] else entry.prompt_embs[s["prompt_index"]]
        assert torch.equal(s["prompt_emb"], expected)
    none = CacheDataset(store, cfg_dropout=0.0)
    assert not any(none[SampleKey(i, 0)]["dropped"] for i in range(len(none)))


def test_iterating_from_a_saved_position_continues_the_stream(store):
    from diffsynth_qie.data.sampling import BucketBatchSampler, SamplingConfig
    from diffsynth_qie.training.data import CacheDataset, DataPosition, iterate_batches

    ds = CacheDataset(store)
    sampler = BucketBatchSampler(ds.sample_infos(), SamplingConfig(batch_size=2, seed=3))
    n = len(sampler.epoch_batches(0))
    # crosses an epoch boundary: the stream goes on with epoch 1's batches
    full = [(p, [int(i) for i in b["index"]]) for (b, p), _ in zip(iterate_batches(ds, sampler, DataPosition()), range(n + 4))]
    assert [idx for _, idx in full[:n]] == sampler.epoch_batches(0)
    start = full[3][0]
    resumed = [(p, [int(i) for i in b["index"]]) for (b, p), _ in zip(iterate_batches(ds, sampler, start), range(n))]
    assert resumed == full[4:n + 4]


# --- the training module -----------------------------------------------------------------
def test_trainable_parameters_are_exactly_the_lora_set(tiny_model_dir, cache_dir, tmp_path):
    from diffsynth_qie.models.presets import LORA_TARGETS_2511
    from diffsynth_qie.training.module import QIETrainingModule

    cfg = resolved(make_config(cache_dir, tmp_path, tiny_model_dir, {"lora": {"lora_target_modules": list(LORA_TARGETS_2511)}}))
    dit = fresh_dit(tiny_model_dir)
    linear = [n for n, m in dit.named_modules() if isinstance(m, torch.nn.Linear)]
    targets = [n for n in linear if any(n == t or n.endswith("." + t) for t in LORA_TARGETS_2511)]
    module = QIETrainingModule(dit, cfg, "tiny")
    expected = {f"dit.{n}.lora_{ab}.default.weight" for n in targets for ab in "AB"}
    assert module.trainable_param_names() == expected
    assert {"img_in", "txt_in", "proj_out"} <= set(module.lora_module_names())
    assert all(n.startswith("dit.") for n in module.trainable_param_names())
    # full fine-tuning of a chosen module adds exactly its parameters
    cfg2 = resolved(make_config(cache_dir, tmp_path, tiny_model_dir, {"lora": {"full_finetune_modules": ["norm_out"]}}))
    m2 = QIETrainingModule(fresh_dit(tiny_model_dir), cfg2, "tiny")
    assert {n for n in m2.trainable_param_names() if "lora_" not in n} == {"dit.norm_out.linear.weight",
                                                                            "dit.norm_out.linear.bias"}
    # a single target keeps suffix matching (DiffSynth would turn ["to_q"] into a full-name regex)
    single = QIETrainingModule(fresh_dit(tiny_model_dir), resolved(make_config(
        cache_dir, tmp_path, tiny_model_dir, {"lora": {"lora_target_modules": ["to_q"]}})), "tiny")
    assert single.lora_module_names() == [n for n in linear if n.endswith(".attn.to_q")]
    with pytest.raises(ValueError, match="match no module"):
        QIETrainingModule(fresh_dit(tiny_model_dir), resolved(make_config(
            cache_dir, tmp_path, tiny_model_dir, {"lora": {"lora_target_modules": ["to_q", "no_such_layer"]}})), "tiny")


def test_prodigy_schedule_free_is_refused_under_sharded_deepspeed():
    """Prodigy's d would be estimated per ZeRO shard with several processes: refused, naming DDP / AdamW."""
    from diffsynth_qie.training.config import OptimConfig
    from diffsynth_qie.training.optim import check_schedule_free_sharding

    sf, adamw = OptimConfig(optimizer="prodigy_sf"), OptimConfig(optimizer="adamw")
    for stage in (2, 3):
        ds = {"zero_optimization": {"stage": stage}, "gradient_clipping": 0}
        with pytest.raises(ValueError, match=r"(?s)prodigy_sf.*2 processes.*--multi_gpu.*adamw"):
            check_schedule_free_sharding(sf, ds, 2)
        check_schedule_free_sharding(sf, ds, 1)      # one process holds the whole flat group: same d
        check_schedule_free_sharding(adamw, ds, 8)   # AdamW has no global step-size estimate
    check_schedule_free_sharding(sf, None, 8)        # DDP: whole parameters, averaged gradients


def test_schedule_free_eval_refuses_an_engine_it_cannot_sync():
    """An engine whose module weights cannot receive the average x is an error, not a silent save of y;
    the optimizer is left in training mode."""
    import types

    from diffsynth_qie.training.config import OptimConfig
    from diffsynth_qie.training.optim import build_optimizer, schedule_free_eval

    p = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer([p], OptimConfig(optimizer="prodigy_sf", learning_rate=1.0))
    engine = types.SimpleNamespace(optimizer=object())  # neither ZeRO-1/2 nor ZeRO-3
    with pytest.raises(ValueError, match="schedule-free average"):
        with schedule_free_eval(opt, engine):
            pass
    assert opt.param_groups[0]["train_mode"] is True
    with schedule_free_eval(opt, None) as held:  # no engine: eval() moves the parameters themselves
        assert held == "schedule-free average x"


def _grads(module):
    return {n: p.grad.detach().clone() for n, p in module.trainable_named_parameters() if p.grad is not None}


@pytest.mark.parametrize("same_shape", [True, False], ids=["equal-shapes", "mixed-shapes"])
def test_batch_of_two_equals_two_batches_of_one(tiny_model_dir, cache_dir, tmp_path, store, same_shape):
    from diffsynth_qie.training.data import CacheDataset, SampleKey, collate
    from diffsynth_qie.training.module import QIETrainingModule

    cfg = resolved(make_config(cache_dir, tmp_path, tiny_model_dir, gradient_checkpointing=False))
    module = QIETrainingModule(fresh_dit(tiny_model_dir), cfg, "tiny")
    with torch.no_grad():  # non-zero LoRA B so every LoRA tensor gets a gradient
        for n, p in module.trainable_named_parameters():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    ds = CacheDataset(store, cfg_dropout=0.0)
    shapes = [store.meta(i).target_shape for i in range(len(store))]
    a = 0
    b = next(i for i in range(1, len(store)) if (shapes[i] == shapes[a]) == same_shape
             and store.meta(i).n_edit == store.meta(a).n_edit)
    sa, sb = ds[SampleKey(a, 0)], ds[SampleKey(b, 0)]

    module.zero_grad()
    loss2, _ = module(collate([sa, sb]), torch.Generator().manual_seed(5))
    loss2.backward()
    g2 = _grads(module)

    module.zero_grad()
    gen = torch.Generator().manual_seed(5)
    la, _ = module(collate([sa]), gen)
    (la / 2).backward()
    lb, _ = module(collate([sb]), gen)
    (lb / 2).backward()
    g11 = _grads(module)
    assert float(loss2.detach()) == pytest.approx(float((la.detach() + lb.detach()) / 2), rel=1e-5)
    # only the last block's text-only outputs (discarded by the DiT) get no gradient
    dead = module.trainable_param_names() - set(g2)
    assert set(g11) == set(g2) and all(".transformer_blocks.1." in n for n in dead), sorted(dead)
    for n in g2:
        assert torch.allclose(g2[n], g11[n], rtol=1e-4, atol=1e-7), n


def test_zero_cond_t_reaches_the_dit_during_training(cache_dir, tiny_model_dir, tmp_path, monkeypatch):
    """train() with zero_cond_t on passes a per-token modulate_index to every DiT block; off passes none."""
    from diffsynth.models.qwen_image_dit import QwenImageTransformerBlock

    from diffsynth_qie.training.loop import train

    seen = []
    original = QwenImageTransformerBlock.forward

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("modulate_index"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(QwenImageTransformerBlock, "forward", spy)
    losses = {}
    for flag in (True, False):
        seen.clear()
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        cfg = make_config(cache_dir, tmp_path / str(flag), tiny_model_dir, max_steps=1, gradient_accumulation_steps=1,
                          zero_cond_t=flag, gradient_checkpointing=True)
        losses[flag] = train(cfg).losses[0]
        if flag:
            assert seen and all(idx is not None for idx in seen)
            idx = seen[0]  # [B, S]: 0 on target tokens, 1 on reference tokens
            assert idx.ndim == 2 and set(idx.unique().tolist()) == {0, 1}
        else:
            assert seen and all(idx is None for idx in seen)
    assert losses[True] != losses[False]  # same seed, same data: only the flag differs


# --- end to end: the reference run ----------------------------------------------------------
def test_reference_loss_curve_matches_pinned_values(reference_run):
    _, result = reference_run
    got, want = result.losses, PINNED["losses"]
    assert len(got) == len(want)
    # rel 5e-5, measured on this run (max relative deviation over the 8 steps): multiplying every DiT weight by
    # (1 + 1e-6·N(0,1)) -- more than the few-ulp differences another BLAS build or thread count makes (2 threads
    # vs 1 gave 0.0) -- moves the curve by 4e-7; the smallest real regressions tried move it by 4e-4 (mask
    # weight outside 1.0 -> 1.02), 5e-4 (no CFG dropout), 9e-4 (lora_alpha +1 %), 1.5e-3 (lr +1 %), 9e-3 (one
    # more warmup step). 5e-5 sits 100x above the noise and 8x below the smallest regression.
    assert got == pytest.approx(want, rel=5e-5, abs=0), (
        "the fixed-seed loss curve changed; if intended, regenerate tests/assets/train_loss_curve.json with "
        "`python tests/assets/make_train_loss_curve.py`")


@pytest.mark.filterwarnings("ignore:Alpha detected in the LoRA file")
def test_training_lowers_the_loss_and_the_lora_changes_the_output(reference_run, store, tiny_model_dir):
    from diffsynth_qie.models.qwen_image_edit.forward import dit_forward
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.lora import apply_lora, load_lora_state

    cfg, result = reference_run
    assert result.lora_path.is_file() and result.steps == cfg.train.max_steps
    base = fresh_dit(tiny_model_dir)
    before = eval_loss(base, store)
    tuned = fresh_dit(tiny_model_dir)
    apply_lora(tuned, load_lora_state(result.lora_path))
    after = eval_loss(tuned, store)
    assert after < 0.93 * before, (before, after)

    # the edit output changes, and DiffSynth's own pipe.load_lora reads the file identically
    e = store.load(0)
    x = torch.randn(e.target_latents.shape, generator=torch.Generator().manual_seed(0))
    args = ([x], torch.tensor([600.0]), [e.prompt_embs[0]], [e.edit_latents])
    with torch.no_grad():
        out_base = dit_forward(base, *args)[0]
        out_ours = dit_forward(tuned, *args)[0]
        pipe = load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu",
                             torch_dtype=torch.float32)
        pipe.load_lora(pipe.dit, str(result.lora_path))
        out_diffsynth = dit_forward(pipe.dit, *args)[0]
    assert float((out_ours - out_base).abs().max()) > 1e-3
    assert torch.allclose(out_ours, out_diffsynth, atol=1e-5)


def test_saved_lora_reproduces_the_trained_module(reference_run, tiny_model_dir, store):
    """Checkpoint LoRA (alpha != rank) merged into a plain DiT == the PEFT module it came from."""
    from diffsynth_qie.models.qwen_image_edit.forward import dit_forward
    from diffsynth_qie.lora import apply_lora, load_lora_state
    from diffsynth_qie.training.checkpoint import LORA_NAME, TRAINABLE_NAME, list_checkpoints
    from diffsynth_qie.training.module import QIETrainingModule

    cfg, result = reference_run
    ckpt = list_checkpoints(cfg.train.output_dir)[-1]
    module = QIETrainingModule(fresh_dit(tiny_model_dir), resolved(cfg), "tiny")
    from safetensors.torch import load_file

    raw = load_file(str(ckpt / TRAINABLE_NAME))
    assert set(raw) == module.trainable_param_names()
    module.load_state_dict(raw, strict=False)
    merged = fresh_dit(tiny_model_dir)
    state = load_lora_state(ckpt / LORA_NAME)
    assert state.metadata["preset"] == "tiny" and float(state.metadata["alpha"]) == 8.0
    apply_lora(merged, state)
    e = store.load(3)
    x = torch.randn(e.target_latents.shape, generator=torch.Generator().manual_seed(1))
    args = ([x], torch.tensor([400.0]), [e.prompt_embs[0]], [e.edit_latents])
    with torch.no_grad():
        assert torch.allclose(dit_forward(module.dit, *args)[0], dit_forward(merged, *args)[0], atol=1e-5)


def test_resumed_run_matches_uninterrupted_run(reference_run, cache_dir, tiny_model_dir, tmp_path):
    """Crash after a checkpoint (steps past it are lost), resume 'latest': the same curve and LoRA."""
    from safetensors.torch import load_file

    from diffsynth_qie.training.checkpoint import list_checkpoints
    from diffsynth_qie.training.loop import Hooks, train
    from diffsynth_qie.training.tracking import read_loss_log

    ref_cfg, ref = reference_run
    out = tmp_path / "run"

    class Crash(Exception):
        pass

    def crash_at_5(step, record):
        if step == 5:
            raise Crash

    with pytest.raises(Crash):
        train(make_config(cache_dir, out, tiny_model_dir, save_every=3, keep_last=1), Hooks(on_step_end=crash_at_5))
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3"]
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed = train(make_config(cache_dir, out, tiny_model_dir, save_every=3, keep_last=1, resume="latest"))
    assert len(resumed.losses) == ref_cfg.train.max_steps - 3
    curve = [r["loss"] for r in read_loss_log(out / "loss.jsonl")]
    assert [r["step"] for r in read_loss_log(out / "loss.jsonl")] == list(range(1, ref_cfg.train.max_steps + 1))
    assert curve == pytest.approx(ref.losses, rel=1e-6, abs=1e-7)
    a, b = load_file(str(out / "lora.safetensors")), load_file(str(ref.lora_path))
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    assert [p.name for p in list_checkpoints(out)] == [f"checkpoint-{ref_cfg.train.max_steps}"]  # keep_last=1


def test_prodigy_schedule_free_saves_the_average_and_validation_renders(cache_dir, tiny_model_dir, tmp_path,
                                                                        monkeypatch):
    """prodigy_sf: the checkpoint LoRA is eval()'s average x = lerp(y, z, 1 - 1/beta1), not the training
    point y (which trainable.safetensors keeps for resuming). Validation writes one PNG per held-out entry;
    WandB (offline) and loss.jsonl both receive the run."""
    from PIL import Image
    from safetensors.torch import load_file

    from diffsynth_qie.cache.store import CacheStore
    from diffsynth_qie.lora import load_lora_state, peft_state_dict
    from diffsynth_qie.training.checkpoint import LORA_NAME, STATE_DIR, TRAINABLE_NAME, read_trainer_state
    from diffsynth_qie.training.loop import train
    from diffsynth_qie.training.module import QIETrainingModule, canonical_param_name

    out = tmp_path / "sf"
    # lr is Prodigy's multiplier of its own step-size estimate; 100 makes 2 steps move the weights visibly
    cfg = make_config(cache_dir, out, tiny_model_dir, {"optim": {"optimizer": "prodigy_sf", "learning_rate": 100.0,
                                                                 "lr_schedule": "constant", "warmup_steps": 0}},
                      max_steps=2, gradient_accumulation_steps=1, validate_every=2, num_validation=2,
                      validation_steps=2, validation_cfg_scale=2.0, report_to="wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_NAME", "qie-test-run")
    result = train(cfg)
    assert result.losses and all(math.isfinite(v) for v in result.losses)
    ckpt = Path(out) / "checkpoint-2"
    assert read_trainer_state(ckpt).extra["weights_in_lora"] == "schedule-free average x"
    x = peft_state_dict(load_lora_state(ckpt / LORA_NAME), peft_scale=2.0)
    y = load_file(str(ckpt / TRAINABLE_NAME))
    opt = torch.load(str(ckpt / STATE_DIR / "optimizer.bin"), weights_only=False)
    assert opt["param_groups"][0]["train_mode"] is True  # saved in training mode: resumes from y
    order = [n for n, _ in QIETrainingModule(fresh_dit(tiny_model_dir), resolved(cfg), "tiny").trainable_named_parameters()]
    moved = 0.0
    for i, name in enumerate(order):
        yi = y[name]
        z = opt["state"].get(i, {}).get("z", yi)  # no state: a LoRA without gradient (last block's text side)
        expected = torch.lerp(yi, z, 1 - 1 / 0.9)
        assert torch.allclose(x[canonical_param_name(name)], expected, atol=1e-7), name
        moved = max(moved, float((expected - yi).abs().max()))
    assert moved > 1e-5  # x really differs from y
    images = sorted((out / "validation" / "step-2").glob("*.png"))
    assert len(images) == 2
    store = CacheStore.open(cache_dir)

    def strip_size(meta):  # [reference scaled to the target height | target | output] (tests/test_validation.py)
        (height, width), (ref_h, ref_w) = meta.target_size, meta.edit_shapes[0][1:]
        return round(ref_w * height / ref_h) + 2 * width, height

    sizes = {strip_size(store.meta(i)) for i in range(len(store))}
    assert all(Image.open(p).size in sizes for p in images)
    from diffsynth_qie.training.tracking import read_loss_log

    assert [r["step"] for r in read_loss_log(out / "loss.jsonl")] == [1, 2]
    assert "prodigy_d" in read_loss_log(out / "loss.jsonl")[0]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert (out / "wandb_run_id").read_text().strip() in runs[0].name


def test_lora_checkpoint_initialises_the_run(reference_run, cache_dir, tiny_model_dir, tmp_path, store):
    from diffsynth_qie.models.qwen_image_edit.forward import dit_forward
    from diffsynth_qie.lora import apply_lora, load_lora_state
    from diffsynth_qie.training.module import QIETrainingModule

    _, ref = reference_run
    cfg = resolved(make_config(cache_dir, tmp_path, tiny_model_dir, {"lora": {"lora_checkpoint": str(ref.lora_path),
                                                                              "lora_alpha": 2.0}}))
    module = QIETrainingModule(fresh_dit(tiny_model_dir), cfg, "tiny")  # other alpha: A is rescaled
    merged = fresh_dit(tiny_model_dir)
    apply_lora(merged, load_lora_state(ref.lora_path))
    e = store.load(2)
    x = torch.randn(e.target_latents.shape, generator=torch.Generator().manual_seed(2))
    args = ([x], torch.tensor([500.0]), [e.prompt_embs[0]], [e.edit_latents])
    with torch.no_grad():
        assert torch.allclose(dit_forward(module.dit, *args)[0], dit_forward(merged, *args)[0], atol=1e-5)
    with pytest.raises(ValueError, match="rank"):
        QIETrainingModule(fresh_dit(tiny_model_dir), resolved(make_config(
            cache_dir, tmp_path, tiny_model_dir, {"lora": {"lora_checkpoint": str(ref.lora_path), "lora_rank": 8}})),
            "tiny")


def test_deepspeed_configs_are_explicit():
    """Shipped DeepSpeed configs: bf16, explicit numeric buckets, clipping "auto" (filled from --max_grad_norm)."""
    import yaml

    from diffsynth_qie.training.config import OptimConfig
    from diffsynth_qie.training.optim import check_clipping

    root = Path(__file__).resolve().parents[1] / "deepspeed_configs"
    names = {p.stem for p in root.glob("*.json")}
    assert names and names == {p.stem for p in root.glob("*.yaml")}  # each DeepSpeed config has its launcher
    for name in names:
        ds = json.loads((root / f"{name}.json").read_text())
        zero = ds["zero_optimization"]
        assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
        assert ds["gradient_clipping"] == "auto"
        assert "optimizer" not in ds and "scheduler" not in ds  # no per-optimizer copies: they come from the flags
        assert zero["overlap_comm"] is True and zero["reduce_bucket_size"] == 5e8
        assert all(v != "auto" for k, v in zero.items() if "bucket" in k or "threshold" in k)
        offload = name.endswith("_offload")
        assert zero["offload_optimizer"]["device"] == ("cpu" if offload else "none")
        if zero["stage"] == 3:
            assert zero["stage3_prefetch_bucket_size"] == 5e8
            assert zero["offload_param"]["device"] == ("cpu" if offload else "none")
            assert zero["stage3_gather_16bit_weights_on_model_save"] is False  # we never gather the DiT
        else:
            assert zero["allgather_bucket_size"] == 5e8
        launcher = yaml.safe_load((root / f"{name}.yaml").read_text())
        assert launcher["distributed_type"] == "DEEPSPEED"
        assert launcher["deepspeed_config"]["deepspeed_config_file"] == f"deepspeed_configs/{name}.json"
        assert launcher["deepspeed_config"]["zero3_init_flag"] == (zero["stage"] == 3)
        assert "mixed_precision" not in launcher  # accelerate refuses it next to a JSON file
        for optim, clip in ((OptimConfig(optimizer="prodigy_sf"), 0.0), (OptimConfig(optimizer="adamw"), 1.0)):
            assert check_clipping(optim, ds) == clip


def test_train_step_alone_is_the_loops_first_step(reference_run, cache_dir, tiny_model_dir, tmp_path):
    """`train_step` is one optimizer step a test can call on a set-up run: the same loss as the loop's first
    logged step (exactly), the step counter and data position advanced, the LoRA changed."""
    from accelerate.state import AcceleratorState, GradientState

    from diffsynth_qie.training.data import iterate_batches
    from diffsynth_qie.training.loop import _step_record, train_step
    from diffsynth_qie.training.run_setup import setup

    ref_cfg, ref = reference_run
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    run = setup(make_config(cache_dir, tmp_path / "step", tiny_model_dir))
    try:
        stream = iterate_batches(run.dataset, run.sampler, run.state.position, 0)
        before = {k: v.detach().clone() for k, v in run.module.named_parameters() if v.requires_grad}
        run.wrapped.train()
        out = train_step(run, [next(stream) for _ in range(run.cfg.train.gradient_accumulation_steps)])
        record = _step_record(run.accelerator, out.micro, out.lr, run.optimizer, out.grad_norm, run.engine, run.state)
        assert run.state.step == 1 and (run.state.position.epoch, run.state.position.batch) != (0, 0)
        assert record["loss"] == ref.losses[0]
        after = dict(run.module.named_parameters())
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        run.tracker.close()
        run.lock.release()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
