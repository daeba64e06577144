"""`qie plan`: counts from the meta-built DiT, the search. The predictions are checked against full-size runs on
the fake CUDA device in tests/memory/test_verify*.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from diffsynth_qie.memory.plan import GiB, PlanOptions, activation_bytes, candidates, predict, recommend
from diffsynth_qie.memory.census import census_from_files, census_from_module, preset_census
from diffsynth_qie.models.presets import LORA_TARGETS_2511


@pytest.fixture(scope="module")
def real():
    return preset_census("2511", with_encoders=False)


def test_real_dit_counts_from_meta(real):
    from diffsynth.models.qwen_image_dit import QwenImageDiT

    with torch.device("meta"):
        dit = QwenImageDiT()
    assert real.params == sum(p.numel() for p in dit.parameters())
    assert real.num_layers == len(dit.transformer_blocks) == 60 and real.dim == 3072
    assert abs(real.params - 20.4e9) < 0.05e9  # the published "20 B" model
    assert real.block_params == sum(p.numel() for p in dit.transformer_blocks[0].parameters())
    # LoRA parameters: r * (in + out) summed over every targeted linear, counted by hand from the modules
    lora = sum(m.in_features + m.out_features for n, m in dit.named_modules()
               if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith("." + t) for t in LORA_TARGETS_2511))
    assert real.lora_params(32) == 32 * lora
    # to_q/k/v, to_out.0, img_mlp.net.2 on image tokens (same count on text tokens)
    assert real.lora_token_targets == 5


def test_census_from_safetensors_header_matches_module(tiny_model_dir):
    from diffsynth_qie.tiny.build import DIT_FILE, DIT_SIZES, TinyQwenImageDiT

    with torch.device("meta"):
        module = census_from_module(TinyQwenImageDiT(**DIT_SIZES), LORA_TARGETS_2511)
    assert census_from_files([tiny_model_dir / DIT_FILE], LORA_TARGETS_2511) == module


def test_more_swap_less_gpu_more_host(real):
    plans = [predict(real, PlanOptions(gradient_checkpointing=True, blocks_to_swap=n)) for n in range(0, 60, 4)]
    gpu = [p.gpu_peak for p in plans]
    host = [p.host_peak for p in plans]
    assert all(a > b for a, b in zip(gpu, gpu[1:]))  # 4 swapped blocks outweigh 2 prefetch buffers
    assert all(a < b for a, b in zip(host, host[1:]))
    # each further swapped block frees one block's bf16 weights
    assert gpu[2] - gpu[3] == 4 * real.block_params * 2


def test_fp8_halves_linear_weights_and_zero_divides(real):
    bf16 = predict(real, PlanOptions())
    fp8 = predict(real, PlanOptions(fp8_base=True))
    w16, w8 = bf16.gpu["DiT weights"], fp8.gpu["DiT weights"]
    assert w16 == real.params * 2
    assert w16 - w8 == real.linear_weight_params - 4 * real.linear_out_features
    assert 0.49 < w8 / w16 < 0.52
    z2 = predict(real, PlanOptions(zero_stage=2, num_gpus=4))
    assert z2.gpu["LoRA gradients + optimizer state"] * 4 == bf16.gpu["LoRA gradients + optimizer state"]
    z3 = predict(real, PlanOptions(zero_stage=3, num_gpus=8))
    assert z3.gpu_peak < z2.gpu_peak and z3.host_peak == bf16.host_peak  # no process holds the state dict
    assert bf16.host_peak < 0.2 * w16 and not bf16.shared and fp8.shared


def test_activation_prediction_scales_with_tokens(real):
    one = activation_bytes(real, PlanOptions())
    assert activation_bytes(real, PlanOptions(batch_size=2)) == pytest.approx(2 * one, rel=1e-9)
    tokens = PlanOptions(ref_images=2).tokens / PlanOptions().tokens
    assert activation_bytes(real, PlanOptions(ref_images=2)) == pytest.approx(tokens * one, rel=1e-9)


@pytest.mark.parametrize("budget", [24, 48, 80])
def test_recommendation_fits_and_is_the_cheapest(real, budget):
    base = PlanOptions()
    plan = recommend(real, base, budget)
    assert plan is not None and plan.gpu_peak <= budget * GiB
    order = candidates(real, base)
    earlier = order[: order.index(plan.options)]
    assert all(predict(real, o).gpu_peak > budget * GiB for o in earlier)


def test_nothing_fits_a_tiny_budget(real):
    assert recommend(real, PlanOptions(), 4) is None


def test_invalid_options_name_the_flag(real):
    with pytest.raises(ValueError, match="--blocks_to_swap 61"):  # 1..60 swap, as the swapper accepts
        predict(real, PlanOptions(blocks_to_swap=61))
    with pytest.raises(ValueError, match="--blocks_to_swap cannot be combined with --zero_stage 2"):
        predict(real, PlanOptions(blocks_to_swap=4, zero_stage=2, num_gpus=2))
    with pytest.raises(ValueError, match="--fp8_base cannot be combined with --zero_stage 3"):
        predict(real, PlanOptions(fp8_base=True, zero_stage=3, num_gpus=2))
    with pytest.raises(ValueError, match="--zero_stage 3"):
        predict(real, PlanOptions(blocks_to_swap=4, zero_stage=3, num_gpus=2))
    with pytest.raises(ValueError, match="--resolution 1000"):
        predict(real, PlanOptions(resolution=1000))


def test_qie_plan_prints_a_fitting_configuration(capfd):
    from diffsynth_qie.cli import main

    assert main(["plan", "--model", "2511", "--gpu_memory_gb", "24"]) == 0
    out, err = capfd.readouterr()
    text = out + err
    assert "cheapest options that fit 24.0 GiB" in text
    peaks = [float(line.split()[-2]) for line in text.splitlines() if "predicted peak GPU memory" in line]
    assert len(peaks) == 2 and peaks[1] <= 24 < peaks[0]


def test_candidates_are_only_what_qie_train_accepts(real):
    """No swapping under DeepSpeed, no FP8 under ZeRO-3 (both refused by `qie train`), and DDP (stage 0) tried
    first on several GPUs."""
    options = candidates(real, PlanOptions(num_gpus=8))
    assert options and options[0].zero_stage == 0
    assert not [o for o in options if o.zero_stage and o.blocks_to_swap]
    assert not [o for o in options if o.zero_stage == 3 and o.fp8_base]
    assert {o.zero_stage for o in options} == {0, 2, 3}
    plan = recommend(real, PlanOptions(num_gpus=8), 24)
    assert plan is not None and plan.gpu_peak <= 24 * GiB


def test_the_fastest_fit_search_offers_compiled_and_selective_sets_that_fit(real):
    """`qie plan --gpu`'s candidates: beside each eager option set, --compile and --compile --checkpoint_policy
    selective, each with the plan's memory (selective keeps activations: more than full), only where it fits;
    a compiled set on the FP8 base only where the same without FP8 does not fit with as few swapped blocks."""
    from diffsynth_qie.commands.plan_time import fitting_options

    base = PlanOptions(gradient_checkpointing=True)  # qie plan's default: checkpointing, full policy, eager
    full, selective = (predict(real, PlanOptions(gradient_checkpointing=True, compile=True, checkpoint_policy=p)).gpu_peak
                       for p in ("full", "selective"))
    assert selective > full + 10 * GiB

    def offered(budget, partial=False):
        return {(p.options.compile, p.options.checkpoint_policy, p.options.fp8_base): p
                for p in fitting_options(real, base, budget) if (p.options.checkpoint_blocks is not None) == partial}

    roomy = offered(selective + GiB)
    assert {(True, "full", False), (True, "selective", False), (False, "full", False)} <= set(roomy)
    assert roomy[(True, "selective", False)].gpu_peak == selective
    assert not any(c and fp8 for c, _, fp8 in roomy)  # the bf16 base fits: no compiled set on the FP8 base
    assert all(p.gpu_peak <= selective + GiB and not p.options.blocks_to_swap for p in roomy.values())
    tight = offered((full + selective) / 2)
    assert (True, "full", False) in tight and not any(policy == "selective" and not fp8 for _, policy, fp8 in tight)
    assert all(p.gpu_peak <= (full + selective) / 2 for p in tight.values())
    # --checkpoint_blocks: beside each checkpointed set, the fewest checkpointed blocks that fit (compiled, selective)
    partly = offered(selective + GiB, partial=True)
    assert {(False, "full", False), (True, "full", False), (True, "selective", False)} <= set(partly)
    for p in partly.values():
        fewer = dataclasses.replace(p.options, checkpoint_blocks=p.options.checkpoint_blocks - 1)
        assert 0 < p.options.checkpoint_blocks < 60 and p.gpu_peak <= selective + GiB < predict(real, fewer).gpu_peak
