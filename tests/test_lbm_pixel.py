"""LBM's pixel-space perceptual loss (``--lbm_pixel_loss lpips --lbm_pixel_weight W``).

- ẑ_T = x_σ − σ·v̂ recovers the target exactly from the true velocity (no bridge noise);
- the crop is a random window of at most ``crop`` px, reproducible from the generator;
- the pixel term alone (loss with it minus loss without, same draws) equals W·LPIPS and
  its gradient reaches both LoRA matrices;
- ``qie train --loss lbm --lbm_pixel_loss lpips`` loads the VAE alone and logs
  ``loss = mse + W·lpips``; without the flag no VAE is loaded; without LPIPS weights
  the flag is refused naming the file; bad values are refused naming the flag.

LPIPS runs on a backbone file of random values placed in the torch hub cache
(``fake_lpips_home``): the real loading path, not real LPIPS values.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchmetrics")

from conftest import fresh_accelerate  # noqa: E402
from diffsynth_qie.metrics import lpips as L  # noqa: E402
from diffsynth_qie.models.samplers.bridge import bridge_interpolate, bridge_target  # noqa: E402
from diffsynth_qie.training.losses.lbm import LBMConfig  # noqa: E402
from diffsynth_qie.training.losses.lbm_pixel import PixelCritic, predicted_targets  # noqa: E402

W = 10.0


@pytest.fixture(scope="module")
def dit(tiny_model_dir):
    from diffsynth_qie.models.load.loading import load_pipeline

    return load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu",
                         torch_dtype=torch.float32).dit


def test_predicted_target_from_the_true_velocity_is_the_target():
    g = torch.Generator().manual_seed(0)
    targets = [torch.randn(16, 4, 6, generator=g) for _ in range(3)]
    priors = [torch.randn(16, 4, 6, generator=g) for _ in range(3)]
    sigmas = torch.tensor([0.25, 0.5, 1.0])
    noisy = [bridge_interpolate(t, p, s) for t, p, s in zip(targets, priors, sigmas)]
    velocity = [bridge_target(t, p) for t, p in zip(targets, priors)]
    for got, want in zip(predicted_targets(noisy, velocity, sigmas), targets):
        assert torch.allclose(got, want, atol=1e-5)


def test_crop_box_is_bounded_random_and_reproducible():
    critic = PixelCritic(vae=None, lpips=None, weight=W, crop=64)  # 8 latent pixels per side
    boxes = [critic.crop_box((16, 20, 12), torch.Generator().manual_seed(s)) for s in range(20)]
    assert all(h == 8 and w == 8 and 0 <= t <= 12 and 0 <= l <= 4 for t, l, h, w in boxes)
    assert len({(t, l) for t, l, _, _ in boxes}) > 1
    assert critic.crop_box((16, 20, 12), torch.Generator().manual_seed(3)) == boxes[3]
    assert critic.crop_box((16, 5, 6), torch.Generator().manual_seed(0)) == (0, 0, 5, 6)  # small: the whole latent


def test_pixel_term_equals_w_lpips_and_its_gradient_reaches_the_lora(dit, tiny_pipe, fake_lpips_home):
    from test_lbm import synthetic_batch
    from test_validation import run_config, training_module

    module = training_module(dit, run_config("lbm", lbm=LBMConfig(lbm_bridge_noise=0.0)))
    batch = synthetic_batch(n=2, h=8, w=10)
    base, m0 = module(batch, torch.Generator().manual_seed(0))
    vae = copy.deepcopy(tiny_pipe.vae).requires_grad_(False)
    module.pixel_critic = PixelCritic(vae=vae, lpips=L.require_lpips(), weight=W, crop=512)
    total, m1 = module(batch, torch.Generator().manual_seed(0))
    assert "lpips" not in m0 and float(m1["lpips"]) > 0
    assert float(m1["mse"]) == pytest.approx(float(m0["mse"]), rel=1e-6)  # same draws
    pixel = total - base
    assert pixel.item() == pytest.approx(W * float(m1["lpips"]), rel=1e-4)
    module.zero_grad(set_to_none=True)
    base.backward(retain_graph=True)  # which LoRA tensors the latent loss reaches (not the last block's text side)
    reached = {n for n, p in module.trainable_named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    pixel.backward()
    grads = {n: p.grad for n, p in module.trainable_named_parameters() if p.grad is not None}
    assert reached and set(grads) == reached
    for kind in ("lora_A", "lora_B"):
        assert sum(g.abs().sum().item() for n, g in grads.items() if kind in n) > 0, kind
    assert all(p.grad is None for p in vae.parameters())  # the VAE stays frozen


def _train(cache_dir, tiny_model_dir, out, *extra):
    from diffsynth_qie.cli import main

    with fresh_accelerate():
        return main(["train", "--model", "tiny", "--model_dir", str(tiny_model_dir), "--cache_dir", str(cache_dir),
                     "--output_dir", str(out), "--loss", "lbm", "--max_steps", "2", "--batch_size", "2",
                     "--lora_rank", "4", "--save_every", "0", "--no-gradient_checkpointing", "--device", "cpu",
                     *extra])


@pytest.fixture
def loaded(monkeypatch):
    """The components of every pipeline loaded (the real loader still runs)."""
    from diffsynth_qie.models.load import loading
    calls, real = [], loading.load_pipeline

    def spy(*args, **kwargs):
        calls.append(tuple(kwargs.get("components", ("dit", "text_encoder", "vae"))))
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "load_pipeline", spy)
    return calls


def test_train_with_pixel_loss_logs_mse_plus_w_lpips(cache_dir, tiny_model_dir, tmp_path, fake_lpips_home, loaded):
    from diffsynth_qie.training.tracking import read_loss_log

    assert _train(cache_dir, tiny_model_dir, tmp_path / "run", "--lbm_pixel_loss", "lpips",
                  "--lbm_pixel_weight", str(W)) == 0
    assert ("vae",) in loaded and not any("text_encoder" in c for c in loaded)
    records = read_loss_log(tmp_path / "run" / "loss.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["lpips"] > 0 and r["loss"] == pytest.approx(r["mse"] + W * r["lpips"], rel=1e-4)


def test_default_lbm_loads_no_vae_and_refuses_pixel_loss_without_weights(cache_dir, tiny_model_dir, tmp_path,
                                                                         monkeypatch, loaded, caplog):
    from diffsynth_qie.training.tracking import read_loss_log

    assert _train(cache_dir, tiny_model_dir, tmp_path / "plain") == 0
    assert loaded and not any("vae" in c for c in loaded)
    assert all("lpips" not in r for r in read_loss_log(tmp_path / "plain" / "loss.jsonl"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    assert _train(cache_dir, tiny_model_dir, tmp_path / "refused", "--lbm_pixel_loss", "lpips") == 2
    assert "alexnet-owt" in caplog.text and "TORCH_HOME" in caplog.text


@pytest.mark.parametrize("field, value, flag", [("lbm_pixel_loss", "l2", "--lbm_pixel_loss"),
                                                ("lbm_pixel_weight", -1.0, "--lbm_pixel_weight"),
                                                ("lbm_pixel_crop", 100, "--lbm_pixel_crop"),
                                                ("lbm_pixel_crop", 32, "--lbm_pixel_crop")])
def test_bad_pixel_flags_name_the_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        LBMConfig(**{field: value})
