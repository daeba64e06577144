"""Qwen-Image-2.1 at full size on the fake CUDA device, with the host-bookkeeping stand-in (``memory/standin21.py``).

The real ``2.1`` preset's DiT (32 layers, width 4096) runs a 2-step edit through ``velocity21`` with the prefix
KV cache and a LoRA training step; the check must catch the host timesteps of the first 2.1 release at
``models/qwen_image_21/qwen21.py``, and the fake device's peaks and KV cache must agree with the cache's own arithmetic.
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


def test_a_full_size_21_edit_runs_with_its_prefix_kv_cache(preset21):
    from diffsynth_qie.inference.verify21 import verify_edit21

    r = verify_edit21(preset21, resolution=1024, ref_images=1, steps=2, cfg=1.0, lora_rank=32)
    log.info("2.1 edit 1024², 1 ref, CFG 1, rank 32, all blocks: weights %.2f GiB, denoise peak %.2f GiB, "
             "KV cache %.3f GiB (%d prefix tokens), %.1f s", r.weights / GiB, r.denoise_peak / GiB, r.kv_cache / GiB,
             r.prefix_tokens, r.seconds)
    # keys and values of every block at the DiT's width in bf16: 0.5 MiB per prefix token and prompt
    assert r.kv_per_prefix_token == 2 * 32 * 4096 * 2 == 512 * 1024
    assert r.kv_cache == r.prefix_tokens * r.kv_per_prefix_token  # the whole prefix, nothing of the target
    assert r.prefix_tokens > 64 * 64  # the reference's 4096 tokens and the prompt's
    assert r.denoise_peak > r.weights + r.kv_cache  # the cache is alive while the target steps run


def test_cfg_keeps_a_second_prefix_kv_cache(preset21):
    from diffsynth_qie.inference.verify21 import verify_edit21

    one = verify_edit21(preset21, resolution=512, ref_images=2, steps=2, cfg=1.0, num_layers=2)
    two = verify_edit21(preset21, resolution=512, ref_images=2, steps=2, cfg=4.0, num_layers=2)
    without = verify_edit21(preset21, resolution=512, ref_images=2, steps=1, cfg=1.0, num_layers=2, kv_cache=False)
    negative_prefix = two.kv_cache - one.kv_cache
    assert one.kv_cache == one.prefix_tokens * one.kv_per_prefix_token
    # the negative prompt has the references' slots and no prompt text
    assert 0 < negative_prefix < one.kv_cache and negative_prefix % one.kv_per_prefix_token == 0
    assert without.kv_cache == 0 and without.denoise_peak < one.denoise_peak


def _forward21_with_host_timesteps(dit, latents, timesteps, prompts, ref_latents, caches=None,
                                   use_gradient_checkpointing=False):
    """``models/qwen_image_21/qwen21.py forward21`` as the first 2.1 release had it: the sampler's timesteps stay on the host."""
    from diffsynth.pipelines.qwen_image_21 import model_fn_qwen_image_21

    dtype = next(dit.parameters()).dtype
    return [model_fn_qwen_image_21(
        dit, latents=x[None], timestep=timesteps[b].reshape(1).to(dtype), prompt_embeds=prompts[b].emb[None],
        prompt_embeds_mask=None, edit_image_pad_mask=prompts[b].pad_mask[None].to(x.device),
        edit_latents=[z[None] for z in ref_latents[b]] or None, kv_cache=None if caches is None else caches[b],
        use_gradient_checkpointing=use_gradient_checkpointing)[0] for b, x in enumerate(latents)]


def test_the_check_catches_the_samplers_host_timesteps_at_our_line(preset21, monkeypatch):
    import diffsynth_qie.models.qwen_image_21.qwen21 as qwen21
    from diffsynth_qie.inference.verify21 import verify_edit21
    from diffsynth_qie.memory.fake_device import FakeRunError

    monkeypatch.setattr(qwen21, "forward21", _forward21_with_host_timesteps)
    with pytest.raises(FakeRunError, match=r"device mismatch in aten\.\w+.* at diffsynth_qie/models/qwen_image_21/qwen21\.py:\d+ "
                                           r"\(velocity\) \(in DiffSynth's 2\.1 DiT forward"):
        verify_edit21(preset21, resolution=512, ref_images=1, steps=1, num_layers=2)


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
    from diffsynth_qie.training.verify import batch_shapes
    from diffsynth_qie.training.verify import verify_train_step as verify_train_step21

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
    from diffsynth_qie.memory.fake_device import FakeRunError
    from diffsynth_qie.training.verify import batch_shapes
    from diffsynth_qie.training.verify import verify_train_step as verify_train_step21

    monkeypatch.setattr(common, "sample_noise", lambda like, generator: torch.randn(like.shape, generator=generator))
    with pytest.raises(FakeRunError, match=r"device mismatch .* at diffsynth_qie/training/losses/common\.py:\d+ "
                                           r"\(add_noise\):") as caught:
        verify_train_step21(_train_config(preset21), preset21, batch_shapes(512, 1, 30, 1), num_layers=1)
    assert "standin21" not in str(caught.value)
