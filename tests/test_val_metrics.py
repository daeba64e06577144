"""Validation metrics: PSNR / SSIM / preservation PSNR / LPIPS, and how they reach ``loss.jsonl``.

- PSNR equals ``qie eval-edits``' PSNR on 8-bit images; SSIM equals torchmetrics' SSIM;
  the preservation PSNR sees only the pixels outside the mask;
- LPIPS loads through the real path (torchvision's hub cache under ``TORCH_HOME``) with
  a backbone file of random values placed there: it equals torchmetrics' own LPIPS metric
  on the same inputs; without the file it is skipped with one warning and nothing is
  downloaded;
- the validator's metrics are those of the decoded output vs the decoded target;
- the tracker merges them into their step's ``loss.jsonl`` line; training with
  ``--validate_every`` keeps one line per step.
"""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from diffsynth_qie.metrics import image as M
from conftest import fresh_accelerate
from diffsynth_qie.metrics import lpips as L


def random_images(n: int, size=(48, 40), seed=0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(n)]


def noisy(img: Image.Image, amount: float, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    a = np.asarray(img, dtype=np.float64) + rng.normal(0, amount, (img.height, img.width, 3))
    return Image.fromarray(np.clip(a, 0, 255).round().astype(np.uint8))


@pytest.fixture(scope="module")
def store(cache_dir):
    from diffsynth_qie.cache.store import CacheStore

    return CacheStore.open(cache_dir)


def test_psnr_is_eval_edits_psnr_and_per_sample():
    from diffsynth_qie.inference.evaluate import psnr as pil_psnr

    a = random_images(3, seed=1)
    b = [noisy(im, s, seed=k) for k, (im, s) in enumerate(zip(a, [2.0, 10.0, 40.0]))]
    got = M.psnr(M.to_pixels(a), M.to_pixels(b))
    assert got.shape == (3,)
    assert got.tolist() == pytest.approx([pil_psnr(x, y) for x, y in zip(a, b)], abs=1e-4)
    assert got[0] > got[1] > got[2]  # more noise, lower PSNR
    assert M.psnr(M.to_pixels(a), M.to_pixels(a)).tolist() == [M.MAX_PSNR] * 3


def test_ssim_matches_torchmetrics():
    tm = pytest.importorskip("torchmetrics.functional.image")
    a = M.to_pixels(random_images(2, seed=2))
    b = (a + 0.1 * torch.randn(a.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    got = M.ssim(a, b)
    want = torch.stack([tm.structural_similarity_index_measure(x[None], y[None], data_range=1.0)
                        for x, y in zip(a, b)])
    assert got.tolist() == pytest.approx(want.tolist(), abs=1e-5)
    assert M.ssim(a, a).tolist() == pytest.approx([1.0, 1.0], abs=1e-6)


def test_masked_psnr_sees_only_the_weighted_pixels():
    a = M.to_pixels(random_images(2, seed=3))
    b = a.clone()
    b[:, :, :, :20] = (b[:, :, :, :20] + 0.3).clamp(0, 1)  # change the left 20 columns only
    left = torch.zeros(2, 1, *a.shape[-2:])
    left[..., :20] = 1
    assert M.masked_psnr(a, b, 1 - left).tolist() == [M.MAX_PSNR] * 2  # the right part is untouched
    assert M.masked_psnr(a, b, left).tolist() == pytest.approx(
        M.psnr(a[..., :20].contiguous(), b[..., :20].contiguous()).tolist(), abs=1e-4)
    assert M.masked_psnr(a, b, torch.ones_like(left)).tolist() == pytest.approx(M.psnr(a, b).tolist(), abs=1e-4)
    assert torch.isnan(M.masked_psnr(a, b, torch.zeros_like(left))).all()
    # a latent mask [1, h, w] maps to pixels block by block
    up = M.mask_to_pixels(torch.tensor([[[1.0, 0.0]]]), (8, 16))
    assert up.shape == (1, 1, 8, 16) and up[..., :8].min() == 1 and up[..., 8:].max() == 0


def test_lpips_without_backbone_file_is_skipped_once(tmp_path, monkeypatch, caplog):
    pytest.importorskip("torchmetrics")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    monkeypatch.setattr(L, "_reported", set())
    with caplog.at_level(logging.WARNING, logger=L.__name__):
        assert L.load_lpips() is None
        assert L.load_lpips() is None
    skips = [r for r in caplog.records if "skipping LPIPS" in r.getMessage()]
    assert len(skips) == 1 and str(L.backbone_weights_path()) in skips[0].getMessage()
    assert not (tmp_path / "empty").exists()  # nothing was downloaded
    with pytest.raises(ValueError, match="alexnet-owt"):
        L.require_lpips()


def test_lpips_loads_from_the_hub_cache_and_equals_torchmetrics(fake_lpips_home):
    pytest.importorskip("torchmetrics")
    from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity

    model = L.load_lpips()
    assert model is not None
    backbone = torch.load(fake_lpips_home)
    # the backbone is the file's (random) weights: the real loading path
    assert torch.equal(model.net.slice1[0].weight, backbone["features.0.weight"])
    a = M.to_pixels(random_images(2, seed=4))
    b = M.to_pixels([noisy(im, 20.0, seed=5) for im in random_images(2, seed=4)])
    got = L.lpips_distance(model, a, b)
    reference = LearnedPerceptualImagePatchSimilarity(net_type="alex", normalize=True, reduction="none")
    want = reference(a, b).flatten()
    assert got.tolist() == pytest.approx(want.tolist(), rel=1e-5)
    assert (got > 0).all() and L.lpips_distance(model, a, a).abs().max() < 1e-6


def test_validator_metrics_are_output_vs_target(store, tiny_pipe, tiny_model_dir, tmp_path, fake_lpips_home):
    """``Validator.metrics`` = the means over outputs of PSNR/SSIM/LPIPS between the decoded
    output and target, and PSNR outside the edit mask for masked entries."""
    pytest.importorskip("torchmetrics")
    from test_validation import run_config, training_module, validator

    from diffsynth_qie.models.qwen_image_edit.encoding import decode_latents

    indices = list(range(min(3, len(store))))
    module = training_module(tiny_pipe.dit, run_config("sft"))
    v = validator(store, indices, tmp_path, tiny_model_dir, steps=2, cfg=1.0)
    v.run(3, module, torch.device("cpu"), torch.float32)
    renders = v.render(module, torch.device("cpu"), torch.float32)
    pipe, lp = v.decoder.pipe(), L.load_lpips()
    pairs = [(M.to_pixels([decode_latents(pipe, r.latents)]), M.to_pixels([decode_latents(pipe, r.target)]))
             for r in renders]  # one batch each: the held-out entries differ in size

    def mean(metric) -> float:
        return float(np.mean([metric(o, t).item() for o, t in pairs]))

    assert v.metrics["val_psnr"] == pytest.approx(mean(M.psnr), abs=1e-4)
    assert v.metrics["val_ssim"] == pytest.approx(mean(M.ssim), abs=1e-5)
    assert v.metrics["val_lpips"] == pytest.approx(mean(lambda o, t: L.lpips_distance(lp, o, t)), rel=1e-4)
    masks = [store.load(i).back_mask for i in indices]
    assert any(m is not None for m in masks), "the demo data has masked rows"
    want = np.mean([M.masked_psnr(o, t, 1 - M.mask_to_pixels(m, o.shape[-2:])).item()
                    for (o, t), m in zip(pairs, masks) if m is not None])
    assert v.metrics["val_psnr_preserve"] == pytest.approx(want, abs=1e-4)
    assert v.metrics["val_psnr_preserve"] != pytest.approx(v.metrics["val_psnr"], abs=1e-3)


def test_tracker_merges_validation_into_the_steps_line(tmp_path):
    from diffsynth_qie.training.tracking import Tracker, read_loss_log

    t = Tracker(tmp_path, enabled=True)
    t.log(1, {"loss": 0.5, "lr": 1e-3})
    t.log(2, {"loss": 0.4, "lr": 1e-3})
    t.log_validation(2, {"val_psnr": 21.5, "val_ssim": torch.tensor(0.75)})
    t.log_validation(3, {"val_psnr": 22.0})  # a step that logged no loss
    t.log(4, {"loss": 0.3, "lr": 1e-3})
    t.close()
    assert read_loss_log(tmp_path / "loss.jsonl") == [
        {"step": 1, "loss": 0.5, "lr": 1e-3},
        {"step": 2, "loss": 0.4, "lr": 1e-3, "val_psnr": 21.5, "val_ssim": 0.75},
        {"step": 3, "val_psnr": 22.0},
        {"step": 4, "loss": 0.3, "lr": 1e-3}]
    assert len((tmp_path / "loss.jsonl").read_text().splitlines()) == 4


def test_training_logs_validation_metrics_per_validation_step(cache_dir, tiny_model_dir, tmp_path):

    from diffsynth_qie.training.config import LoRAConfig, LossConfig, RunConfig, TrainConfig
    from diffsynth_qie.training.loop import train
    from diffsynth_qie.training.tracking import read_loss_log

    out = tmp_path / "run"
    cfg = RunConfig(train=TrainConfig(cache_dir=str(cache_dir), output_dir=str(out), model="tiny",
                                      model_dir=str(tiny_model_dir), batch_size=2, max_steps=2, save_every=0,
                                      gradient_checkpointing=False, validate_every=1, num_validation=2,
                                      validation_steps=2, device="cpu", mixed_precision="no", seed=0),
                    lora=LoRAConfig(lora_rank=4), loss=LossConfig(loss="sft"))
    with fresh_accelerate():
        train(cfg)
    records = read_loss_log(out / "loss.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {"loss", "val_psnr", "val_ssim"} <= set(r)
        assert 0 < r["val_psnr"] < M.MAX_PSNR and -1 <= r["val_ssim"] <= 1
    assert json.loads((out / "loss.jsonl").read_text().splitlines()[-1]) == records[-1]


def test_summary_means_overall_and_per_lbm_stream():
    from diffsynth_qie.training.validation_metrics import summarize

    lbm = summarize([("main", {"psnr": 20.0, "ssim": 0.5}), ("sub", {"psnr": 30.0, "ssim": 0.7}),
                     ("main", {"psnr": 22.0, "ssim": 0.6, "psnr_preserve": 40.0})])
    assert lbm == pytest.approx({"val_psnr": 24.0, "val_psnr_main": 21.0, "val_psnr_sub": 30.0, "val_ssim": 0.6,
                                 "val_ssim_main": 0.55, "val_ssim_sub": 0.7, "val_psnr_preserve": 40.0,
                                 "val_psnr_preserve_main": 40.0})
    assert summarize([(None, {"psnr": 10.0}), (None, {"psnr": 14.0})]) == {"val_psnr": 12.0}
    assert summarize([]) == {}
