"""End-to-end runs of the real launch scripts on the tiny model (CPU), asserting what they saved.

Each script runs phase 1 (`qie cache`), phase 2 (`qie train`) and the after-training
`qie edit` with the new LoRA, exactly as a user runs it, shortened by extra `qie train`
flags (the scripts pass their arguments to phase 2 last, so they win). Their Python
processes start already imported (the `warm_venv` fixture, tests/warm_python.py).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--max_steps", "2", "--gradient_accumulation_steps", "1", "--save_every", "1", "--validate_every", "0"]


def run_script(script: str, tmp_path: Path, demo_data_dir: Path, venv: Path, *args: str, **env_extra: str) -> Path:
    out = tmp_path / "run"
    env = dict(os.environ, QIE_SKIP_SETUP="1", OUTPUT_DIR=str(out), CACHE_DIR=str(tmp_path / "cache"),
               DATASET_METADATA=str(Path(demo_data_dir) / "metadata.json"), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               QIE_VENV=str(venv), **env_extra)
    env.pop("DS_CONFIG", None)
    proc = subprocess.run(["bash", str(ROOT / script), *SHORT, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"LoRA:          {out}/lora.safetensors" in proc.stdout
    assert proc.stdout.rstrip().endswith(f"report:        {out}/report.html") and (out / "report.html").is_file()
    return out


def check_common(out: Path, zero_cond_t: bool, loss: str) -> dict:
    from diffsynth_qie.lora import load_lora_state

    state = load_lora_state(out / "lora.safetensors")
    assert state.modules, "the LoRA holds no modules"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    log = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]
    assert all(r["loss"] == r["loss"] and r["loss"] < 1e3 for r in log)  # finite
    before_after = Image.open(out / "before_after.png")
    after = Image.open(out / "after.png")
    assert before_after.size == (3 * after.width, after.height)
    # The launcher decided zero_cond_t at training time; the LoRA records it.
    assert str(state.metadata.get("zero_cond_t")).lower() == str(zero_cond_t).lower()
    assert state.metadata.get("loss") == loss
    return state.metadata


@pytest.mark.slow
def test_2511_script_trains_a_lora_with_zero_cond_t(tmp_path, demo_data_dir, warm_venv):
    out = run_script("Qwen-Image-Edit-2511.sh", tmp_path, demo_data_dir, warm_venv)
    check_common(out, zero_cond_t=True, loss="sft")


@pytest.mark.slow
def test_lbm_script_trains_and_writes_main_and_sub_images(tmp_path, demo_data_dir, warm_venv):
    out = run_script("Qwen-Image-Edit-LBM.sh", tmp_path, demo_data_dir, warm_venv)
    check_common(out, zero_cond_t=True, loss="lbm")
    assert Image.open(out / "after_sub.png").size == Image.open(out / "after.png").size


def launch_plan(tmp_path: Path, gpus: int, script: str = "", **env_extra: str) -> str:
    """What a launcher would run for `qie train` with ``gpus`` visible GPUs (``accelerate``, ``gpu_count`` and
    the Python entry point replaced by stubs that print their arguments): no model, no GPU needed."""
    prelude = f'''
set -euo pipefail
source "{ROOT}/scripts/launch_lib.sh"
gpu_count() {{ echo {gpus}; }}
accelerate() {{ echo "accelerate $*"; }}
PY=echo
choose_zero() {{ echo "zero3.yaml"; }}  # the planner's choice is tested in test_launch_checks.py
split_training() {{ qie_launch train "${{TRAIN_FLAGS[@]}}"; }}
after_training() {{ :; }}
'''
    env = {k: v for k, v in os.environ.items() if k not in ("DS_CONFIG", "NUM_GPUS", "NNODES")}
    env.update(QIE_SKIP_SETUP="1", DATASET_METADATA=str(tmp_path / "m.json"), OUTPUT_DIR=str(tmp_path / "o"),
               **env_extra)
    if script:  # the script without its own `source launch_lib.sh` line, which would replace the stubs
        (tmp_path / "s.sh").write_text(re.sub(r"(?m)^source .*launch_lib\.sh.*$", ":", (ROOT / script).read_text()))
        text = prelude + f'source "{tmp_path}/s.sh"'
    else:
        text = prelude + "launch_defaults run 2511; qie_launch train"
    proc = subprocess.run(["bash", "-c", text], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_launchers_use_zero_only_with_several_gpu_processes(tmp_path):
    one_gpu = launch_plan(tmp_path, 1)
    assert not one_gpu.startswith("accelerate") and "train" in one_gpu  # a plain process, no ZeRO
    assert "deepspeed_configs/zero3.yaml" in launch_plan(tmp_path, 4)
    assert not launch_plan(tmp_path, 0).startswith("accelerate")  # CPU
    asked = launch_plan(tmp_path, 1, DS_CONFIG="deepspeed_configs/zero2.yaml")  # unless the user asks for it
    assert asked.startswith("accelerate") and "deepspeed_configs/zero2.yaml --num_machines" in asked
    # LBM (ProdigyPlusScheduleFree): DDP on several GPUs, a single process on one
    lbm = launch_plan(tmp_path, 4, "Qwen-Image-Edit-LBM.sh")
    assert "--multi_gpu" in lbm and "--config_file" not in lbm and "--loss lbm" in lbm
    assert not launch_plan(tmp_path, 1, "Qwen-Image-Edit-LBM.sh").startswith("accelerate")


@pytest.mark.parametrize("model, base", [("tiny", "Qwen-Image-Edit-tiny-pretrained"),
                                         ("tiny-2.1", "Qwen-Image-2.1-tiny-pretrained")])
def test_the_cpu_demo_trains_on_the_models_pretrained_base(tmp_path, model, base):
    """With no dataset, a tiny preset's demo installs that preset's pretrained base and trains on it."""
    text = f'''
set -euo pipefail
source "{ROOT}/scripts/launch_lib.sh"
gpu_count() {{ echo 0; }}
PY=echo
launch_defaults run {'2.1' if model == 'tiny-2.1' else '2511'} {model}
echo "MODEL_ARGS: ${{MODEL_ARGS[*]}}"
'''
    env = {k: v for k, v in os.environ.items() if k not in ("DS_CONFIG", "NUM_GPUS", "NNODES", "DATASET_METADATA",
                                                             "MODEL")}
    env.update(QIE_SKIP_SETUP="1", QIE_HOME=str(tmp_path / "home"), OUTPUT_DIR=str(tmp_path / "o"))
    proc = subprocess.run(["bash", "-c", text], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where = f"{tmp_path}/home/models/{base}"
    assert f"make-tiny --model {model} --pretrained --out {where}" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == f"MODEL_ARGS: --model {model} --model_dir {where}"
