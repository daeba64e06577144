"""Latent Bridge Matching: bridge math, stream choice, σ sampling, the loss as the DiT sees it,
a toy problem trained with the loss and sampled with the bridge sampler, the clipping
guard, and an LBM LoRA from `qie train --loss lbm` driving the Editor.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from diffsynth_qie.models.samplers import sampling as samplers
from diffsynth_qie.training.config import LossConfig, OptimConfig, RunConfig, TrainConfig
from diffsynth_qie.models.samplers.bridge import bridge_interpolate, bridge_target
from diffsynth_qie.training.losses.lbm import (LBMConfig, draw_sigmas, lbm_loss,
                                        make_bridge_batch, stream_ends)
from diffsynth_qie.training.losses.common import mask_weights, per_sample_mse
from diffsynth_qie.training.losses.registry import get_loss
from diffsynth_qie.training.optim import check_clipping

ROOT = Path(__file__).resolve().parents[1]
CACHE_ROWS = [0, 1, 2, 3]


def run_config(lbm_config: LBMConfig | None = None, zero_cond_t: bool = True, **loss) -> RunConfig:
    return RunConfig(train=TrainConfig(cache_dir="unused", output_dir="unused", zero_cond_t=zero_cond_t,
                                       gradient_checkpointing=False),
                     loss=LossConfig(loss="lbm", **loss), lbm=lbm_config).resolved()


def synthetic_batch(n: int = 3, seed: int = 0, h: int = 4, w: int = 6) -> dict:
    """A collated batch like training/data.py's (lists per sample), random latents."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "entry_id": [f"row{i}" for i in range(n)],
        "target_latents": [rnd(16, h, w) for _ in range(n)],
        "edit_latents": [[rnd(16, h, w)] for _ in range(n)],
        "prompt_emb": [rnd(5 + i, 32) for i in range(n)],
        "lbm_source_latents": [rnd(16, h, w) for _ in range(n)],
        "sub_noise": [torch.full((16, h, w), 0.7) for _ in range(n)],
        "ref_gt_latents": [None] * n,
        "sub_noise_ref_gt": [None] * n,
        "back_mask": [None] * n,
    }


@pytest.fixture(scope="module")
def dit(tiny_model_dir):
    from diffsynth_qie.models.load.loading import load_pipeline

    return load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu",
                         torch_dtype=torch.float32).dit


@pytest.fixture
def spy(monkeypatch):
    """Records what the loss feeds ``dit_forward`` (then runs the real forward). The loss reaches it through the
    family's ops (``EditOps.forward``), so it is patched where the ops look it up."""
    from diffsynth_qie.models.qwen_image_edit import edit_ops, forward
    calls = []
    real = forward.dit_forward

    def record(dit, latents, timesteps, prompt_embs, edit_latents=None, **kw):
        calls.append({"latents": [x.clone() for x in latents], "timesteps": timesteps.clone(),
                      "prompt_embs": prompt_embs, "edit_latents": edit_latents, **kw})
        out = real(dit, latents, timesteps, prompt_embs, edit_latents, **kw)
        calls[-1]["pred"] = [p.detach().clone() for p in out]
        return out

    monkeypatch.setattr(forward, "dit_forward", record)
    monkeypatch.setattr(edit_ops, "dit_forward", record)
    return calls


# --- pure math -----------------------------------------------------------------------
def test_bridge_endpoints_target_sign_and_sampler_parity():
    g = torch.Generator().manual_seed(0)
    z_t, z_p, eps = (torch.randn(16, 4, 6, generator=g) for _ in range(3))
    assert torch.equal(bridge_interpolate(z_t, z_p, 0.0, 0.0, eps), z_t)
    assert torch.equal(bridge_interpolate(z_t, z_p, 1.0, 0.0, eps), z_p)
    assert torch.equal(bridge_interpolate(z_t, z_p, 1.0, 0.3, eps), z_p)  # the noise vanishes at both ends
    assert torch.equal(bridge_interpolate(z_t, z_p, 0.0, 0.3, eps), z_t)
    assert torch.allclose(bridge_interpolate(z_t, z_p, 0.5, 0.1, eps), 0.5 * (z_t + z_p) + 0.05 * eps, atol=1e-6)
    # v* = z_prior - z_T: moving +h along σ moves the bridge by h·v*, and one step σ 1 -> 0 lands on z_T
    v = bridge_target(z_t, z_p)
    assert torch.equal(v, z_p - z_t)
    step = bridge_interpolate(z_t, z_p, 0.75) - bridge_interpolate(z_t, z_p, 0.5)
    assert torch.allclose(step, 0.25 * v, atol=1e-6)
    assert torch.allclose(samplers.bridge_step(z_p, v, 1.0, 0.0), z_t, atol=1e-6)
    # the default training grid is the σ set of the 1-, 2- and 4-step samplers
    sampler_sigmas = {round(float(s), 6) for n in (1, 2, 4) for s in samplers.bridge_sigmas(n)}
    assert sampler_sigmas == set(LBMConfig().lbm_sigma_grid)


def test_draw_sigmas_grid_and_uniform():
    g = torch.Generator().manual_seed(0)
    grid = draw_sigmas(2000, LBMConfig(), g)
    assert set(grid.tolist()) == {0.25, 0.5, 0.75, 1.0}  # only grid values, and all of them
    counts = torch.stack([(grid == s).sum() for s in (0.25, 0.5, 0.75, 1.0)]).float()
    assert counts.min() > 400  # ≈ 500 each
    assert set(draw_sigmas(200, LBMConfig(lbm_sigma_grid=[1.0]), g).tolist()) == {1.0}
    uni = draw_sigmas(4000, LBMConfig(lbm_sigma_sampling="uniform"), g)
    assert uni.min() > 0 and uni.max() <= 1
    assert len(set(uni.tolist())) > 3900 and abs(float(uni.mean()) - 0.5) < 0.03
    assert float((uni < 0.25).float().mean()) == pytest.approx(0.25, abs=0.03)
    # reproducible from the generator
    assert torch.equal(draw_sigmas(8, LBMConfig(), torch.Generator().manual_seed(3)),
                       draw_sigmas(8, LBMConfig(), torch.Generator().manual_seed(3)))


def test_config_flags_defaults_and_validation():
    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.commands.train import config_from_args

    parser = build_parser()
    base = ["train", "--cache_dir", "c", "--output_dir", "o"]
    cfg = config_from_args(parser.parse_args(base + ["--loss", "lbm"]))
    assert cfg.lbm == LBMConfig()
    assert (cfg.lbm.lbm_p_sub, cfg.lbm.lbm_sub_target, cfg.lbm.lbm_sigma_sampling, cfg.lbm.lbm_bridge_noise) == \
        (0.5, "target", "grid", 0.005)
    opt = cfg.resolved().optim  # LBM defaults to ProdigyPlusScheduleFree, lr 1, no decay, no clipping
    assert (opt.optimizer, opt.learning_rate, opt.weight_decay, opt.max_grad_norm) == ("prodigy_sf", 1.0, 0.0, 0.0)
    assert get_loss(cfg.loss.loss) is lbm_loss
    cfg = config_from_args(parser.parse_args(base + [
        "--loss", "lbm", "--lbm_p_sub", "0.25", "--lbm_sub_target", "ref_gt", "--lbm_sigma_sampling", "uniform",
        "--lbm_sigma_grid", "1", "0.5", "--lbm_bridge_noise", "0", "--optimizer", "adamw", "--weight_decay", "0.1"]))
    assert cfg.lbm == LBMConfig(0.25, "ref_gt", "uniform", [1.0, 0.5], 0.0)
    assert (cfg.resolved().optim.optimizer, cfg.resolved().optim.weight_decay) == ("adamw", 0.1)
    assert config_from_args(parser.parse_args(base)).resolved().optim.optimizer == "adamw"  # SFT unchanged
    assert json.loads(json.dumps(cfg.resolved().to_json()))["lbm"]["lbm_p_sub"] == 0.25
    for bad, flag in (({"lbm_p_sub": 1.5}, "--lbm_p_sub"), ({"lbm_sigma_grid": [0.0, 1.0]}, "--lbm_sigma_grid"),
                      ({"lbm_sigma_grid": []}, "--lbm_sigma_grid"), ({"lbm_bridge_noise": -1.0}, "--lbm_bridge_noise"),
                      ({"lbm_sub_target": "white"}, "--lbm_sub_target")):
        with pytest.raises(ValueError, match=flag):
            LBMConfig(**bad)


# --- stream choice -------------------------------------------------------------------
def test_stream_choice_fallback_and_errors():
    batch = synthetic_batch(3)
    for b in range(3):
        main, sub = stream_ends(batch, b, want_sub=False), stream_ends(batch, b, want_sub=True)
        assert main.stream == "main" and main.prior is batch["lbm_source_latents"][b]
        assert main.target is batch["target_latents"][b]
        assert sub.stream == "sub" and sub.prior is batch["sub_noise"][b] and sub.target is batch["target_latents"][b]
    # a row without a source image (t2i) falls back to the sub-stream, one without white latents to main
    batch["lbm_source_latents"][1] = None
    batch["sub_noise"][2] = None
    assert stream_ends(batch, 1, want_sub=False).stream == "sub"
    assert stream_ends(batch, 2, want_sub=True).stream == "main"
    batch["sub_noise"][1] = None
    with pytest.raises(ValueError, match="entry_id='row1'"):
        stream_ends(batch, 1, want_sub=True)
    # p_sub 0 / 1 route every sample that can go there; the draws follow the fallback
    batch = synthetic_batch(4)
    batch["lbm_source_latents"][3] = None
    g = torch.Generator().manual_seed(0)
    assert make_bridge_batch(batch, LBMConfig(lbm_p_sub=0.0), g).streams == ["main", "main", "main", "sub"]
    assert make_bridge_batch(batch, LBMConfig(lbm_p_sub=1.0), g).streams == ["sub"] * 4
    many = make_bridge_batch(synthetic_batch(200, h=2, w=2), LBMConfig(lbm_p_sub=0.3), g).streams
    assert 0.2 < many.count("sub") / 200 < 0.4
    # --lbm_sub_target ref_gt: white latents at ref_gt's size -> ref_gt where the row has one
    batch = synthetic_batch(2)
    ref_gt, white_ref = torch.randn(16, 6, 4), torch.full((16, 6, 4), 0.6)
    batch["ref_gt_latents"][0], batch["sub_noise_ref_gt"][0] = ref_gt, white_ref
    batch["back_mask"] = [torch.ones(1, 4, 6), None]
    e = stream_ends(batch, 0, want_sub=True, sub_target="ref_gt")
    assert e.prior is white_ref and e.target is ref_gt and tuple(e.back_mask.shape) == (1, 6, 4)
    e = stream_ends(batch, 1, want_sub=True, sub_target="ref_gt")  # no ref_gt: the target
    assert e.prior is batch["sub_noise"][1] and e.target is batch["target_latents"][1]
    assert stream_ends(batch, 0, want_sub=True, sub_target="target").target is batch["target_latents"][0]


# --- the loss as the DiT sees it ------------------------------------------------------
def test_sub_stream_starts_exactly_at_sub_noise(dit, spy):
    batch = synthetic_batch(3)
    cfg = run_config(LBMConfig(lbm_p_sub=1.0, lbm_sigma_grid=[1.0]))  # s = 0.005 (vanishes at σ = 1)
    loss, metrics = lbm_loss(dit, batch, cfg, torch.Generator().manual_seed(0))
    (call,) = spy
    for b in range(3):
        assert torch.equal(call["latents"][b], batch["sub_noise"][b])
    assert call["timesteps"].tolist() == [1000.0] * 3
    assert all(p is q for p, q in zip(call["prompt_embs"], batch["prompt_emb"], strict=True))
    assert call["edit_latents"] is batch["edit_latents"]
    assert call["zero_cond_t"] is True
    # weight 1: the loss is the plain mean of per-sample MSEs against v* = z_W - z_T
    expected = torch.stack([((p - (w - t)) ** 2).mean() for p, w, t in
                            zip(call["pred"], batch["sub_noise"], batch["target_latents"])]).mean()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    assert metrics["frac_sub"] == 1.0 and "mse_main" not in metrics
    assert float(metrics["mse_sub"]) == pytest.approx(float(expected), rel=1e-5)
    # main stream: starts at the source latents; no zero_cond_t when the run says so
    spy.clear()
    lbm_loss(dit, batch, run_config(LBMConfig(lbm_p_sub=0.0, lbm_sigma_grid=[1.0]), zero_cond_t=False))
    assert all(torch.equal(x, s) for x, s in zip(spy[0]["latents"], batch["lbm_source_latents"]))
    assert spy[0]["zero_cond_t"] is False


def test_loss_bridge_noise_mixed_streams_and_mask(dit, spy):
    batch = synthetic_batch(4)
    batch["back_mask"] = [None, torch.zeros(1, 4, 6), None, torch.zeros(1, 4, 6)]
    batch["back_mask"][1][..., :3] = 1
    batch["back_mask"][3][..., 2:] = 1
    lbm_config = LBMConfig(lbm_sigma_grid=[0.5], lbm_bridge_noise=0.2)
    bridge = make_bridge_batch(batch, lbm_config, torch.Generator().manual_seed(1))
    loss, metrics = lbm_loss(dit, batch, run_config(lbm_config, mask_loss_weights=(1.0, 0.0)),
                             torch.Generator().manual_seed(1))
    (call,) = spy
    assert set(bridge.streams) == {"main", "sub"}  # this seed draws both streams
    assert call["timesteps"].tolist() == [500.0] * 4
    for b, e in enumerate(bridge.ends):
        expected_x = 0.5 * e.target + 0.5 * e.prior + 0.2 * 0.5 * bridge.noise[b]
        assert torch.allclose(call["latents"][b], expected_x, atol=1e-6)
        assert not torch.allclose(call["latents"][b], 0.5 * (e.target + e.prior), atol=1e-3)  # noise is there
    weights = [None if m is None else mask_weights(m, 1.0, 0.0) for m in batch["back_mask"]]
    per = [per_sample_mse(p, e.prior - e.target, w) for p, e, w in zip(call["pred"], bridge.ends, weights)]
    assert float(loss.detach()) == pytest.approx(float(torch.stack(per).mean()), rel=1e-5)
    # masked rows count only inside the mask: the error outside is ignored
    inside = batch["back_mask"][1].bool().expand(16, -1, -1)
    e = bridge.ends[1]
    assert float(per[1]) == pytest.approx(float(((call["pred"][1] - (e.prior - e.target))[inside] ** 2).mean()),
                                          rel=1e-5)
    subs = [i for i, s in enumerate(bridge.streams) if s == "sub"]
    assert metrics["frac_sub"] == len(subs) / 4
    assert float(metrics["mse_sub"]) == pytest.approx(float(torch.stack([per[i] for i in subs]).mean()), rel=1e-5)


# --- toy problem: the loss trains, the bridge sampler lands near the target ------------
def test_toy_problem_training_lowers_loss_and_one_step_beats_the_prior(dit):
    from diffsynth_qie.training.optim import build_optimizer

    model = copy.deepcopy(dit).requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    n = 4
    src = [torch.randn(16, 4, 4, generator=g) for _ in range(n)]
    tgt = [0.3 - 0.5 * s.flip(-1) for s in src]  # an "edit": mirrored, negated, offset
    white = torch.full((16, 4, 4), 0.7)
    prompt = [torch.randn(5, 32, generator=g) for _ in range(n)]
    batch = {"entry_id": [f"toy{i}" for i in range(n)], "target_latents": tgt, "edit_latents": [[s] for s in src],
             "prompt_emb": prompt, "lbm_source_latents": src, "sub_noise": [white] * n,
             "ref_gt_latents": [None] * n, "sub_noise_ref_gt": [None] * n, "back_mask": [None] * n}
    cfg = run_config(LBMConfig())
    assert cfg.optim.optimizer == "prodigy_sf"

    def held_out_loss() -> float:
        with torch.no_grad():
            return sum(float(lbm_loss(model, batch, cfg, torch.Generator().manual_seed(1000 + k))[0])
                       for k in range(8)) / 8

    before = held_out_loss()
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    gen = torch.Generator().manual_seed(1)
    for _ in range(80):
        loss, _ = lbm_loss(model, batch, cfg, gen)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    optimizer.eval()  # schedule-free: evaluate the average x
    after = held_out_loss()
    assert after < 0.5 * before, (before, after)

    T, S, W = torch.stack(tgt), torch.stack(src), white.expand(n, -1, -1, -1).clone()
    cond = samplers.Conditioning(prompt_embs=prompt, edit_latents=[[s] for s in src], zero_cond_t=True)
    velocity = samplers.dit_velocity(model, cond)
    for prior in (S, W):  # main stream and sub-stream
        x = samplers.sample_bridge(velocity, prior, 1, 0.005, torch.Generator().manual_seed(0))
        mse, prior_mse = float(((x - T) ** 2).mean()), float(((prior - T) ** 2).mean())
        assert mse < 0.7 * prior_mse, (mse, prior_mse)
    # the untrained DiT does not: the gain comes from training
    x0 = samplers.sample_bridge(samplers.dit_velocity(dit, cond), S, 1, 0.0)
    assert float(((x0 - T) ** 2).mean()) > 0.7 * float(((S - T) ** 2).mean())


# --- the clipping guard ---------------------------------------------------------------
def _ds_json(yaml_name: str) -> dict:
    import yaml

    spec = yaml.safe_load((ROOT / "deepspeed_configs" / yaml_name).read_text())
    return json.loads((ROOT / spec["deepspeed_config"]["deepspeed_config_file"]).read_text())


def test_clipping_guard_with_lbm_settings(monkeypatch, tmp_path):
    from accelerate.state import AcceleratorState

    from diffsynth_qie.training import loop, run_setup

    lbm_optim = run_config().optim
    check_clipping(lbm_optim)  # defaults: prodigy_sf, no clipping
    with pytest.raises(ValueError, match="--max_grad_norm"):
        check_clipping(OptimConfig(optimizer="prodigy_sf", max_grad_norm=1.0))
    for name in ("zero2.yaml", "zero3.yaml"):  # the shipped configs take their clipping from --max_grad_norm
        ds = _ds_json(name)
        assert ds["gradient_clipping"] == "auto"
        assert check_clipping(lbm_optim, ds) == 0.0
        with pytest.raises(ValueError, match="gradient_clipping"):
            check_clipping(lbm_optim, {**ds, "gradient_clipping": 1.0})

    # the trainer refuses before reading the cache or loading the DiT
    missing = str(tmp_path / "no-cache")
    cfg = RunConfig(train=TrainConfig(cache_dir=missing, output_dir=str(tmp_path / "o"), model="tiny", device="cpu"),
                    loss=LossConfig(loss="lbm"), optim=OptimConfig(max_grad_norm=1.0))
    try:
        with pytest.raises(ValueError, match="--max_grad_norm"):
            loop.train(cfg)
        AcceleratorState._reset_state(True)
        monkeypatch.setattr(run_setup, "deepspeed_config", lambda accelerator: {"gradient_clipping": 1.0})
        with pytest.raises(ValueError, match="gradient_clipping"):
            loop.train(RunConfig(train=cfg.train, loss=cfg.loss))
    finally:
        AcceleratorState._reset_state(True)


# --- qie train --loss lbm -> LoRA -> Editor --------------------------------------------
@pytest.fixture(scope="module")
def lbm_cache(tmp_path_factory, demo_data_dir, tiny_model_dir, tiny_pipe):
    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.formats import DatasetConfig

    data = tmp_path_factory.mktemp("lbm-data")
    shutil.copytree(Path(demo_data_dir) / "images", data / "images")
    rows = json.loads((Path(demo_data_dir) / "metadata.json").read_text())
    (data / "metadata.json").write_text(json.dumps([rows[i] for i in CACHE_ROWS]))
    cache_dir = tmp_path_factory.mktemp("lbm-cache")
    write_cache(CacheConfig(cache_dir=str(cache_dir), model="tiny", model_dir=str(tiny_model_dir), max_pixels=4096,
                            device="cpu", dtype="float32", num_workers=1,
                            dataset=DatasetConfig(dataset_metadata=str(data / "metadata.json"))), pipe=tiny_pipe)
    return cache_dir, data


def test_cache_batch_feeds_both_streams(lbm_cache, dit, spy):
    from diffsynth_qie.cache.store import CacheStore
    from diffsynth_qie.training.data import CacheDataset, collate

    store = CacheStore.open(lbm_cache[0])
    batch = collate([CacheDataset(store)[i] for i in range(len(store))])
    assert all(x is not None for k in ("lbm_source_latents", "sub_noise", "ref_gt_latents") for x in batch[k])
    bridge = make_bridge_batch(batch, LBMConfig(lbm_p_sub=1.0, lbm_sub_target="ref_gt"))
    assert all(e.prior is w and e.target is r for e, w, r in
               zip(bridge.ends, batch["sub_noise_ref_gt"], batch["ref_gt_latents"]))
    lbm_loss(dit, batch, run_config(LBMConfig(lbm_p_sub=1.0, lbm_sigma_grid=[1.0])))
    assert all(torch.equal(x, w) for x, w in zip(spy[-1]["latents"], batch["sub_noise"]))
    lbm_loss(dit, batch, run_config(LBMConfig(lbm_p_sub=0.0, lbm_sigma_grid=[1.0])))
    assert all(torch.equal(x, s) for x, s in zip(spy[-1]["latents"], batch["lbm_source_latents"]))


def test_qie_train_lbm_lora_loads_and_changes_lbm_edits(lbm_cache, tiny_model_dir, tmp_path):
    from accelerate.state import AcceleratorState
    from PIL import Image

    from diffsynth_qie.cli import main
    from diffsynth_qie.inference import EditRequest, Editor
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.lora import load_lora_state
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.checkpoint import read_trainer_state

    cache_dir, data = lbm_cache
    out = tmp_path / "lbm-run"
    try:
        code = main(["train", "--model", "tiny", "--model_dir", str(tiny_model_dir), "--cache_dir", str(cache_dir),
                     "--output_dir", str(out), "--loss", "lbm", "--zero_cond_t", "--max_steps", "4",
                     "--batch_size", "2", "--lora_rank", "4", "--save_every", "0", "--no-gradient_checkpointing",
                     "--device", "cpu"])
    finally:
        AcceleratorState._reset_state(True)
    assert code == 0
    records = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all("mse" in r and "frac_sub" in r and "prodigy_d" in r for r in records)
    assert {"mse_main", "mse_sub"} <= {k for r in records for k in r}
    saved = read_trainer_state(out / "checkpoint-4").extra["config"]
    assert saved["loss"]["loss"] == "lbm" and saved["lbm"] == json.loads(json.dumps(LBMConfig().__dict__))
    assert (saved["optim"]["optimizer"], saved["optim"]["max_grad_norm"]) == ("prodigy_sf", 0.0)

    lora = out / "lora.safetensors"
    state = load_lora_state(lora)  # the loader SFT LoRAs go through
    assert state.ranks == {4}
    pipe = load_pipeline("tiny", model_dir=tiny_model_dir, device="cpu", torch_dtype=torch.float32)
    editor = Editor(pipe, zero_cond_t=True)
    row = json.loads((data / "metadata.json").read_text())[0]
    image = Image.open(data / row["edit_image"][0]).convert("RGB")
    request = EditRequest([image], "make it blue", lbm_steps=1, height=32, width=32, seed=1)
    base = editor.edit(request)
    (report,) = editor.set_loras([(lora, 1.0)])
    targets = get_preset("tiny").lora_target_modules
    expected = {n for n, m in pipe.dit.named_modules() if isinstance(m, torch.nn.Linear)
                and any(n == t or n.endswith("." + t) for t in targets)}
    assert set(report.lora_modules) == expected and report.full_weights == []
    with_lora = editor.edit(request)
    assert with_lora.sub_image is not None and with_lora.latents.shape == (2, 16, 4, 4)
    diff = (with_lora.latents - base.latents).abs().amax(dim=(1, 2, 3))
    # 4 Prodigy steps move the LoRA little (d starts at 1e-6): ≈1.5e-5 here, 250x the fp32 rounding
    # of latents ≈ 0.5 (6e-8); the base model's run-to-run difference is exactly 0 on CPU
    assert (diff > 2e-6).all(), diff
    editor.set_loras([])
    assert torch.equal(editor.edit(request).latents, base.latents)
