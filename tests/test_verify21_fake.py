"""Qwen-Image-2.1 at full size on the fake CUDA device, with the host-bookkeeping stand-in (``fakegpu/standin21.py``).

The real ``2.1`` preset's DiT (32 layers, width 4096) runs a LoRA training step (the edit:
``tests/memory/test_verify_edit21.py``).
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

GiB = 1024 ** 3
log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def preset21():
    from diffsynth_qie.models.presets import get_preset

    return get_preset("2.1")


def _train_config(preset, rank: int = 32):
    from diffsynth_qie.training.config import RunConfig

    cfg = RunConfig()
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, model=preset.name, cache_dir="-", output_dir="-"),
        lora=dataclasses.replace(cfg.lora, lora_rank=rank)).resolved(preset)


def test_a_21_lora_step_runs_and_its_peak_grows_by_one_block_at_a_time(preset21):
    """Forward, backward and the optimizer's step of a rank-32 LoRA at 1024² with one reference. Every block
    runs the same code and holds the same, so two depths give the full model's peak by extrapolation (a
    full-depth step takes about 30 s here; ``verify_train_step`` without ``num_layers`` runs it)."""
    from diffsynth_qie.preflight.train_step import batch_shapes
    from diffsynth_qie.preflight.train_step import verify_train_step as verify_train_step21

    cfg, shapes = _train_config(preset21), batch_shapes(1024, 1, 300, 1)
    r2, r3 = (verify_train_step21(cfg, preset21, shapes, num_layers=n) for n in (2, 3))
    assert r2.loss_dtype == "float32" and r3.weights > r2.weights
    per_block = r3.peak - r2.peak
    full = r2.peak + (32 - 2) * per_block
    log.info("2.1 LoRA step 1024², 1 ref, rank 32: steady-state peak %.2f GiB (2 blocks), %.2f GiB (3 blocks), "
             "%.2f GiB extrapolated to 32 blocks; %.1f s + %.1f s", r2.peak / GiB, r3.peak / GiB, full / GiB,
             r2.seconds, r3.seconds)
    assert per_block > (r3.weights - r2.weights)  # a block's weights, its LoRA's states and saved activations
    assert r2.activations > 0 and r2.after_step > r2.weights


def test_a_bug_outside_the_dit_is_named_at_our_line_not_the_standins(preset21, monkeypatch):
    """The stand-in's dispatch mode sees every operator of the run; an error it passes on must still name the
    line of ours that made it (here: noise drawn on the host and mixed with device latents)."""
    import diffsynth_qie.training.losses.common as common  # the SFT loss imports it when it runs
    from diffsynth_qie.fakegpu.device import FakeRunError
    from diffsynth_qie.preflight.train_step import batch_shapes
    from diffsynth_qie.preflight.train_step import verify_train_step as verify_train_step21

    monkeypatch.setattr(common, "sample_noise", lambda like, generator: torch.randn(like.shape, generator=generator))
    with pytest.raises(FakeRunError, match=r"device mismatch .* at diffsynth_qie/training/losses/common\.py:\d+ "
                                           r"\(add_noise\):") as caught:
        verify_train_step21(_train_config(preset21), preset21, batch_shapes(512, 1, 30, 1), num_layers=1)
    assert "standin21" not in str(caught.value)
