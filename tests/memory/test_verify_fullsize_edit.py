"""The whole edit on the fake CUDA device: the real 20 B DiT, Qwen2.5-VL-7B and VAE, CFG, LoRA branches."""
from __future__ import annotations

from diffsynth_qie.memory.census import preset_census
from diffsynth_qie.memory.plan import PlanOptions, predict
from diffsynth_qie.models.presets import get_preset

GiB = 1024 ** 3


def test_full_size_2511_edit_matches_the_census_and_the_plan():
    from diffsynth_qie.preflight.edit_step import verify_edit

    census = preset_census("2511")
    r = verify_edit(get_preset("2511"), resolution=1024, steps=2, lora_rank=32)
    expected = (census.params + census.text_encoder_params + census.vae_params + census.lora_params(32)) * 2
    assert abs(r.weights - expected) < 0.01 * GiB, (r.weights / GiB, expected / GiB)
    options = PlanOptions(task="edit", lora_rank=32)
    predicted = predict(census, options).gpu_peak - options.overhead_bytes
    assert abs(predicted - r.peak) / r.peak < 0.10, (predicted / GiB, r.peak / GiB)
