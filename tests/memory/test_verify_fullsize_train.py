"""The whole 20 B training step on the fake CUDA device: `qie plan --verify`'s count against the plan.

One real 2511 LoRA step (60 blocks, bf16, rank 32, checkpointing, 1024² target + one 1024² reference + 300
prompt tokens), about a minute on a CPU core.
"""
from __future__ import annotations

from diffsynth_qie.memory.census import preset_census
from diffsynth_qie.memory.plan import PlanOptions, predict
from diffsynth_qie.models.presets import get_preset

GiB = 1024 ** 3


def test_full_size_2511_step_matches_the_census_and_the_plan():
    from test_verify import run_config

    from diffsynth_qie.preflight.train_step import batch_shapes, verify_train_step

    census = preset_census("2511", with_encoders=False)
    r = verify_train_step(run_config(gradient_checkpointing=True), get_preset("2511"), batch_shapes(1024, 1, 300, 1))
    # weights: the bf16 DiT (every parameter counted by the census) + the fp32 LoRA, nothing else of size
    expected = census.params * 2 + census.lora_params(32) * 4
    assert abs(r.weights - expected) < 0.01 * GiB, (r.weights / GiB, expected / GiB)
    assert abs(r.optimizer_state - census.lora_params(32) * 8) < 0.01 * GiB  # AdamW's two fp32 moments
    options = PlanOptions(lora_rank=32, gradient_checkpointing=True)
    predicted = predict(census, options).gpu_peak - options.overhead_bytes
    assert abs(predicted - r.peak) / r.peak < 0.10, (predicted / GiB, r.peak / GiB)
