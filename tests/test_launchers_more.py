"""End-to-end runs of the other launch scripts (2509, Qwen-Image-2.1 LBM) on the tiny models, asserting what they
saved; in a file of their own so that the suite's two workers share the launchers' minutes."""
from __future__ import annotations

import pytest
from PIL import Image

from test_launchers import check_common, run_script


@pytest.mark.slow
def test_2509_script_trains_without_zero_cond_t(tmp_path, demo_data_dir):
    out = run_script("Qwen-Image-Edit-2509.sh", tmp_path, demo_data_dir)
    check_common(out, zero_cond_t=False, loss="sft")


@pytest.mark.slow
def test_21_lbm_script_trains_and_writes_main_and_sub_images(tmp_path, demo_data_dir):
    out = run_script("Qwen-Image-2.1-LBM.sh", tmp_path, demo_data_dir)
    check_common(out, zero_cond_t=False, loss="lbm")
    assert Image.open(out / "after_sub.png").size == Image.open(out / "after.png").size


@pytest.mark.slow
def test_reward_script_trains_an_nft_lora(tmp_path, demo_data_dir):
    out = run_script("Qwen-Image-Edit-Reward.sh", tmp_path, demo_data_dir)
    meta = check_common(out, zero_cond_t=True, loss="nft")
    assert meta  # the LoRA records its run
    import json

    rows = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    assert all("reward_mean" in r for r in rows)
