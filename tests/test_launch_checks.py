"""The launchers' start-up checks on the way to a GPU run: caller-relative paths, a free port, a driver too old
for torch, the planner's multi-GPU default, and the DeepSpeed settings that keep gradients in fp32."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def launch(tmp_path: Path, gpus: int, cwd: Path, stub_py: bool = True, py: str = sys.executable, **env_extra: str):
    """Source the launcher library with `accelerate` (and, with ``stub_py``, the Python entry point ``py``)
    replaced by stubs that print their arguments; returns the finished process."""
    py = "echo" if stub_py else py
    text = f'''
set -euo pipefail
source "{ROOT}/scripts/launch_lib.sh"
gpu_count() {{ echo {gpus}; }}
accelerate() {{ echo "accelerate $*"; }}
PY={py}
launch_defaults run 2511
echo "OUTPUT_DIR=$OUTPUT_DIR CACHE_DIR=$CACHE_DIR DATASET_METADATA=$DATASET_METADATA MODEL=$MODEL DS_CONFIG=$DS_CONFIG MODEL_ARGS=${{MODEL_ARGS[*]}}"
qie_launch train
'''
    env = {k: v for k, v in os.environ.items() if k not in ("DS_CONFIG", "NUM_GPUS", "NNODES", "MASTER_PORT")}
    env.update(QIE_SKIP_SETUP="1", **env_extra)
    return subprocess.run(["bash", "-c", text], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_relative_paths_are_the_callers(tmp_path):
    (tmp_path / "models" / "my-2511").mkdir(parents=True)
    proc = launch(tmp_path, 1, cwd=tmp_path, OUTPUT_DIR="out/run", DATASET_METADATA="data/m.json",
                  CACHE_DIR="cache", MODEL="models/my-2511")
    assert proc.returncode == 0, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("OUTPUT_DIR="))
    assert f"OUTPUT_DIR={tmp_path}/out/run " in line and f"CACHE_DIR={tmp_path}/cache " in line
    assert f"DATASET_METADATA={tmp_path}/data/m.json " in line and f"MODEL={tmp_path}/models/my-2511 " in line
    assert "--model 2511 --model_dir" in proc.stdout  # a directory, not a preset name


def test_single_node_takes_a_free_port_and_an_explicit_one_is_kept(tmp_path):
    ports = set()
    for _ in range(2):
        proc = launch(tmp_path, 4, cwd=tmp_path, stub_py=False, DATASET_METADATA="m.json", DS_CONFIG="")
        assert proc.returncode == 0, proc.stderr
        port = proc.stdout.split("--main_process_port ")[1].split()[0]
        ports.add(int(port))
    assert 29500 not in ports
    proc = launch(tmp_path, 4, cwd=tmp_path, stub_py=False, DATASET_METADATA="m.json", DS_CONFIG="",
                  MASTER_PORT="31234")
    assert "--main_process_port 31234" in proc.stdout


def test_a_driver_too_old_for_torch_stops_with_the_fix(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$1" in -L) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-x)";;'
                   ' *) echo "550.54.15";; esac\n')
    smi.chmod(0o755)
    proc = launch(tmp_path, 0, cwd=tmp_path, DATASET_METADATA="m.json", PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert proc.returncode == 2
    assert "nvidia-smi lists 1 GPU(s)" in proc.stderr and "550.54.15" in proc.stderr
    assert "QIE_TORCH_SPEC=" in proc.stderr and "cu128" in proc.stderr
    assert "accelerate" not in proc.stdout and "train" not in proc.stdout  # nothing launched


def test_the_planner_picks_the_multi_gpu_default(tmp_path, capsys, warm_venv):
    """The launcher runs `qie plan --distribution` (for real, in an already imported python: tests/warm_python.py)
    and launches the config file it names: ZeRO-3 on 24 GiB GPUs. On 80 GiB GPUs the same command (in this
    process) names ZeRO-2."""
    from diffsynth_qie.cli import main

    proc = launch(tmp_path, 8, cwd=tmp_path, stub_py=False, py=str(warm_venv / "bin" / "python"),
                  DATASET_METADATA="m.json", QIE_GPU_MEMORY_GB="24")
    assert proc.returncode == 0, proc.stderr
    assert f"--config_file {ROOT}/deepspeed_configs/zero3.yaml" in proc.stdout
    assert "ZeRO-3: the unsharded run needs" in proc.stderr
    assert main(["plan", "--model", "2511", "--num_gpus", "8", "--gpu_memory_gb", "80", "--distribution"]) == 0
    said = capsys.readouterr()
    assert said.out.splitlines()[-1] == "zero2.yaml" and "ZeRO-2: the unsharded DiT run needs" in said.err


def test_choose_distribution_follows_the_plan():
    from diffsynth_qie.memory.census import preset_census
    from diffsynth_qie.memory.plan import PlanOptions, choose_distribution, predict

    census = preset_census("2511", with_encoders=False)
    base = PlanOptions(num_gpus=8, gradient_checkpointing=True)
    need = predict(census, PlanOptions(num_gpus=8, zero_stage=2, gradient_checkpointing=True)).gpu_peak / 2 ** 30
    assert choose_distribution(census, base, need + 0.5)[0] == 2
    assert choose_distribution(census, base, need - 0.5)[0] == 3


@pytest.mark.parametrize("name", ["zero2.json", "zero3.json", "zero3_offload.json"])
def test_deepspeed_accumulates_and_reduces_gradients_in_fp32(name):
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = json.loads((ROOT / "deepspeed_configs" / name).read_text())
    raw.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=16, gradient_clipping=0.0)
    config = DeepSpeedConfig(raw)  # as DeepSpeed itself parses it
    assert config.grad_accum_dtype == "fp32"
    assert config.communication_data_type == __import__("torch").float32


def test_deepspeed_floor_has_the_zero3_checkpointing_fix():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"deepspeed>=0.19.8,' in text


def test_zero3_param_offload_loads_the_frozen_dit_on_the_host():
    from diffsynth_qie.training.config import RunConfig
    from diffsynth_qie.training.placement import load_device

    offload = json.loads((ROOT / "deepspeed_configs" / "zero3_offload.json").read_text())
    plain = json.loads((ROOT / "deepspeed_configs" / "zero3.json").read_text())
    assert load_device(RunConfig(), "cuda:3", offload) == "cpu"
    assert load_device(RunConfig(), "cuda:3", plain) == "cuda:3"


def test_a_real_preset_is_refused_on_the_cpu_unless_asked():
    from diffsynth_qie.models.load.devices import check_device_for
    from diffsynth_qie.models.presets import get_preset

    with pytest.raises(ValueError, match="2511 would run on the CPU.*pass --device cpu"):
        check_device_for(get_preset("2511"), "cpu", explicit_cpu=False)
    check_device_for(get_preset("2511"), "cpu", explicit_cpu=True)
    check_device_for(get_preset("2511"), "cuda:0", explicit_cpu=False)
    check_device_for(get_preset("tiny"), "cpu", explicit_cpu=False)


@pytest.mark.parametrize("driver, index", [("575.51.03", "cu128"), ("565.57.01", "cu126"), ("580.82.07", None)])
def test_setup_picks_the_torch_index_for_the_driver(tmp_path, driver, index):
    """setup.sh's choice only (pip is a stub that prints what it would install)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho {driver}\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text('#!/bin/sh\n[ "$2" = pip ] && echo "pip $*" >> "$(dirname "$0")/log"; exit 0\n')
    for f in (bin_dir / "nvidia-smi", venv / "bin" / "python"):
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "QIE_TORCH_SPEC"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", QIE_VENV=str(venv))
    proc = subprocess.run(["bash", str(ROOT / "scripts/setup.sh")], env=env, capture_output=True, text=True, timeout=60)
    torch_line = next(l for l in (venv / "bin" / "log").read_text().splitlines() if "torch==" in l)
    if index:
        assert f"--index-url https://download.pytorch.org/whl/{index}" in torch_line, (torch_line, proc.stdout)
    else:
        assert "--index-url" not in torch_line
