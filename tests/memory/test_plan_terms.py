"""`qie plan`'s terms for the prefix KV cache, the EMA, on-the-fly encoding, stacked LoRAs and LBM's optimizer:
each one counted from the model's own sizes, and each one moving the plan by what it holds."""
from __future__ import annotations

import dataclasses

import pytest

from diffsynth_qie.memory.census import preset_census
from diffsynth_qie.memory.plan import GiB, PlanOptions, kv_cache_bytes, predict, recommend

MiB = 1024 ** 2


@pytest.fixture(scope="module")
def q21():
    return preset_census("2.1", with_encoders=True)


@pytest.fixture(scope="module")
def q2511():
    return preset_census("2511", with_encoders=True)


def test_the_prefix_kv_cache_is_half_a_mib_per_prefix_token_and_prompt(q21, q2511):
    from diffsynth.models.qwen_image_21_dit import QwenImage21DiT
    import torch

    with torch.device("meta"):
        dit = QwenImage21DiT()
    assert q21.prefix_kv_width == dit.inner_dim and q2511.prefix_kv_width == 0  # 2511 recomputes every token
    one = PlanOptions(task="edit", ref_images=1, cfg=False)
    assert kv_cache_bytes(q21, one) == one.prefix_tokens * MiB // 2  # 32 blocks x K, V x 4096 x bf16
    # the figures measured on the fake device: 2.15 / 12.16 / 20.15 / 40.16 GiB
    for refs, cfg, measured in ((1, False, 2.15), (3, True, 12.16), (10, False, 20.15), (10, True, 40.16)):
        got = kv_cache_bytes(q21, PlanOptions(task="edit", ref_images=refs, cfg=cfg)) / GiB
        assert abs(got - measured) / measured < 0.02, (refs, cfg, got)
    plan = predict(q21, PlanOptions(task="edit", ref_images=10))
    off = predict(q21, PlanOptions(task="edit", ref_images=10, kv_cache="off"))
    assert plan.gpu_peak - off.gpu_peak == kv_cache_bytes(q21, PlanOptions(task="edit", ref_images=10))
    assert not any("KV" in name for name in predict(q2511, PlanOptions(task="edit")).gpu)


def test_a_budget_the_kv_cache_does_not_fit_turns_it_off(q21):
    base = PlanOptions(task="edit", ref_images=10)
    budget = predict(q21, dataclasses.replace(base, kv_cache="off", fp8_base=True)).gpu_peak / GiB + 0.1
    fit = recommend(q21, base, budget)
    assert fit is not None and fit.options.kv_cache == "off"
    assert recommend(q21, base, 200).options.kv_cache == "on"  # kept where it fits


def test_ema_shadow_and_validation_copy(q2511):
    n = q2511.lora_params(32)
    base = predict(q2511, PlanOptions())
    ema = predict(q2511, PlanOptions(ema=True))
    both = predict(q2511, PlanOptions(ema=True, validate_with="both"))
    assert ema.gpu_peak - base.gpu_peak == 4 * n
    assert both.gpu_peak - ema.gpu_peak == 4 * n
    z3 = predict(q2511, PlanOptions(ema=True, zero_stage=3, num_gpus=4))
    assert z3.gpu["EMA shadow (fp32)"] == 4 * n // 4
    with pytest.raises(ValueError, match="--validate_with ema needs --ema_decay"):
        predict(q2511, PlanOptions(validate_with="ema"))


def test_on_the_fly_counts_the_encode_working_set_where_the_vae_runs(q2511):
    gpu = predict(q2511, PlanOptions(on_the_fly=True))
    host = predict(q2511, PlanOptions(on_the_fly=True, vae_on_gpu=False))
    term = "on the fly: encode working set (one image, VAE)"
    assert 1.0 * GiB < gpu.gpu[term] < 1.5 * GiB  # measured: 1.13 GiB for one 1024² sample
    assert term not in host.gpu
    assert predict(q2511, PlanOptions(on_the_fly=True, resolution=2048)).gpu[term] == 4 * gpu.gpu[term]


def test_each_stacked_lora_is_counted(q2511):
    one = predict(q2511, PlanOptions(task="edit"))
    two = predict(q2511, PlanOptions(task="edit", loras=(32, 16)))
    assert two.gpu_peak - one.gpu_peak == q2511.lora_params(16) * 2
    assert sum(1 for name in two.gpu if name.startswith("LoRA branches")) == 2
    with pytest.raises(ValueError, match="every rank must be >= 1"):
        predict(q2511, PlanOptions(task="edit", loras=(0,)))


def test_qie_plan_plans_lbm_with_its_own_optimizer(capfd):
    from diffsynth_qie.cli import main
    from diffsynth_qie.training.losses.registry import loss_spec

    assert loss_spec("lbm").default_optimizer == "prodigy_sf"
    c = preset_census("2511", with_encoders=False)
    rows = {}
    for loss in ("sft", "lbm"):
        assert main(["plan", "--loss", loss, "--no_time"]) == 0  # (the rows are the memory plan's)
        text = "".join(capfd.readouterr())
        rows[loss] = next(line for line in text.splitlines() if "LoRA gradients + optimizer state" in line)
    adamw = predict(c, PlanOptions(gradient_checkpointing=True)).gpu["LoRA gradients + optimizer state"]
    prodigy = predict(c, PlanOptions(gradient_checkpointing=True, optimizer="prodigy_sf")).gpu[
        "LoRA gradients + optimizer state"]
    assert f"{adamw / GiB:.2f} GiB" in rows["sft"] and f"{prodigy / GiB:.2f} GiB" in rows["lbm"]


def test_qie_plan_takes_the_new_terms_flags(capfd):
    from diffsynth_qie.cli import main

    # (--no_time: the terms are the memory plan's; the time of a 2.1 edit and of an EMA step: test_plan_verify.py)
    assert main(["plan", "--model", "2.1", "--task", "edit", "--ref_images", "3", "--loras", "32", "16",
                 "--no_time"]) == 0
    text = "".join(capfd.readouterr())
    assert "prefix KV cache (positive + negative prompt)" in text and "(2 of 2, rank 16)" in text
    assert main(["plan", "--ema_decay", "0.999", "--validate_with", "both", "--on_the_fly", "--no_time"]) == 0
    text = "".join(capfd.readouterr())
    assert "EMA shadow (fp32)" in text and "EMA validation copy" in text and "encode working set" in text
