"""End-to-end runs of the other launch scripts (Qwen-Image-2.1 LBM, reward tuning) on the tiny models, asserting
what they saved, and the commands of the 2509 script; in a file of their own so that the suite's two workers share
the launchers' minutes."""
from __future__ import annotations

import os
import re
import subprocess

import pytest
from PIL import Image

from test_launchers import ROOT, check_common, run_script


def test_2509_script_runs_every_phase_without_zero_cond_t(tmp_path):
    """Qwen-Image-Edit-2509.sh is Qwen-Image-2511.sh (run end to end in test_launchers.py) with other flags: each
    `qie` command it runs (the Python entry point replaced by a stub that prints its arguments) parses with the real
    parser, and training and the edit after it both run without zero_cond_t."""
    import shlex

    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.commands import train

    text = f'''
set -euo pipefail
source "{ROOT}/scripts/launch_lib.sh"
gpu_count() {{ echo 0; }}
PY=echo
source "{tmp_path}/s.sh"
'''
    (tmp_path / "s.sh").write_text(re.sub(r"(?m)^source .*launch_lib\.sh.*$", ":",
                                          (ROOT / "Qwen-Image-Edit-2509.sh").read_text()))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "lora.safetensors").touch()  # after training looks for the LoRA
    env = {k: v for k, v in os.environ.items() if k not in ("DS_CONFIG", "NUM_GPUS", "NNODES", "MODEL")}
    env.update(QIE_SKIP_SETUP="1", DATASET_METADATA=str(tmp_path / "m.json"), OUTPUT_DIR=str(tmp_path / "o"))
    proc = subprocess.run(["bash", "-c", text], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = {argv[2]: argv[2:] for argv in map(shlex.split, proc.stdout.splitlines())
            if argv[:2] == ["-m", "diffsynth_qie.cli"]}
    assert list(runs) == ["cache", "train", "edit", "report"], proc.stdout
    parsed = {name: build_parser().parse_args(argv) for name, argv in runs.items()}
    config = train.config_from_args(parsed["train"])
    assert config.train.zero_cond_t is False and parsed["edit"].zero_cond_t is False
    assert config.train.cache_dir == [parsed["cache"].cache_dir] == [f"{tmp_path}/o/cache"]
    assert parsed["edit"].lora == [f"{tmp_path}/o/lora.safetensors"]


@pytest.mark.slow
def test_21_lbm_script_trains_and_writes_main_and_sub_images(tmp_path, demo_data_dir, warm_venv):
    out = run_script("Qwen-Image-2.1-LBM.sh", tmp_path, demo_data_dir, warm_venv)
    check_common(out, zero_cond_t=False, loss="lbm")
    assert Image.open(out / "after_sub.png").size == Image.open(out / "after.png").size


@pytest.mark.slow
def test_reward_script_trains_an_nft_lora(tmp_path, demo_data_dir, warm_venv):
    # two rollouts of two steps per source: the launcher's wiring, not the demo's learning (test_nft.py)
    out = run_script("Qwen-Image-Edit-Reward.sh", tmp_path, demo_data_dir, warm_venv, "--nft_group_size", "2",
                     "--nft_rollout_steps", "2")
    meta = check_common(out, zero_cond_t=True, loss="nft")
    assert meta  # the LoRA records its run
    import json

    rows = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    assert all("reward_mean" in r for r in rows)
