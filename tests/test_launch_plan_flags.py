"""On a GPU the launchers train with the fastest options `qie plan` finds that fit (``plan_flags`` in
``scripts/launch_lib.sh``, ``qie plan --launch_flags``): the plan side with its time model replaced by a known
ranking, the launcher side with a stand-in python that answers the GPU questions and records the plan's call."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHOICE = "--gradient_checkpointing --checkpoint_policy selective --checkpoint_blocks 7 --compile"


def plan_flags(tmp_path: Path, gpus: int, user_args: str = "", gpu_name: str = "NVIDIA H200", **env_extra: str):
    """``plan_flags`` of the launcher library with the 2511 preset and the LBM launcher's flags; returns
    (PLAN_FLAGS, the stand-in's recorded calls, the process)."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "fake_torch" / "torch"  # the GPU's questions answered by a stand-in torch module
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import types\n"
        "cuda = types.SimpleNamespace(get_device_properties=lambda i: types.SimpleNamespace("
        f"total_memory=int(139.8 * 2 ** 30)), get_device_name=lambda i: {gpu_name!r})\n")
    stub = tmp_path / "python"
    stub.write_text(f'''#!/bin/bash
echo "$*" >> "{log}"
case "$*" in
  *" plan "*)
    case "$*" in *"--gpu NVIDIA A10G"*) echo "no time table" >&2; exit 2 ;; esac
    echo "a library's noise on stdout"; echo "{CHOICE}" ;;
  *) PYTHONPATH="{fake.parent}" exec "{sys.executable}" "$@" ;;
esac
''')
    stub.chmod(0o755)
    text = f'''
set -euo pipefail
source "{ROOT}/scripts/launch_lib.sh"
gpu_count() {{ echo {gpus}; }}
launch_defaults run 2511
PY="{stub}"
TRAIN_FLAGS=(--loss lbm --gradient_accumulation_steps 16 --gradient_checkpointing)
plan_flags "${{#TRAIN_FLAGS[@]}}" "${{TRAIN_FLAGS[@]}}" {user_args}
echo "PLAN_FLAGS=${{PLAN_FLAGS[*]+${{PLAN_FLAGS[*]}}}}"
'''
    env = {k: v for k, v in os.environ.items() if k not in ("DS_CONFIG", "NUM_GPUS", "NNODES", "QIE_GPU_MEMORY_GB")}
    env.update({"QIE_SKIP_SETUP": "1", "DATASET_METADATA": "m.json", "MODEL": "2511", "DS_CONFIG": "", **env_extra})
    proc = subprocess.run(["bash", "-c", text], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    flags = next(l for l in proc.stdout.splitlines() if l.startswith("PLAN_FLAGS=")).split("=", 1)[1]
    calls = log.read_text().splitlines() if log.exists() else []
    return flags, [c for c in calls if " plan " in f" {c} "], proc


def test_on_a_gpu_the_launcher_takes_the_plans_choice_for_its_run(tmp_path):
    flags, plans, proc = plan_flags(tmp_path, 1, "--lora_rank 64 --max_steps 10")
    assert flags == CHOICE
    assert len(plans) == 1
    call = plans[0]
    # the launcher's loss and the user's rank shape the plan; the budget is 90 % of the GPU's memory
    assert "--model 2511" in call and "--loss lbm" in call and "--lora_rank 64" in call
    assert "--gpu NVIDIA H200 --gpu_memory_gb 125.8 --launch_flags" in call
    assert "--max_steps" not in call and "--gradient_accumulation_steps" not in call
    assert "QIE_PLAN_FLAGS=0" in proc.stdout  # how to keep the launcher's own settings is said


def test_a_gpu_without_a_time_table_is_planned_on_the_nearest_memorys(tmp_path):
    flags, plans, _ = plan_flags(tmp_path, 1, gpu_name="NVIDIA A10G")
    assert flags == CHOICE
    assert [c.split("--gpu ")[1].split(" --gpu_memory_gb")[0] for c in plans] == ["NVIDIA A10G", "139.8"]


@pytest.mark.parametrize("case", ["cpu", "user_compile", "user_swap", "opt_out", "zero"])
def test_the_plan_is_not_asked_where_it_must_not_choose(tmp_path, case):
    gpus, user, env = 1, "", {}
    if case == "cpu":
        gpus = 0
    elif case == "user_compile":
        user = "--compile"
    elif case == "user_swap":
        user = "--blocks_to_swap=10"
    elif case == "opt_out":
        env = {"QIE_PLAN_FLAGS": "0"}
    else:
        env = {"DS_CONFIG": str(ROOT / "deepspeed_configs" / "zero2.yaml")}
    flags, plans, proc = plan_flags(tmp_path, gpus, user, **env)
    assert flags == "" and plans == []
    if case.startswith("user"):
        assert "qie plan's choice of options is not used" in proc.stdout


def test_qie_plan_launch_flags_prints_the_fastest_bf16_fit_as_train_flags(monkeypatch, capfd):
    """The time model replaced by a ranking in which the FP8 base would be fastest: the launcher's choice keeps the
    bf16 base, and the flags it prints parse, through `qie train`'s own parser, to the chosen options."""
    from diffsynth_qie.cli import build_parser, main
    from diffsynth_qie.commands import plan, plan_time
    from diffsynth_qie.memory.plan import GiB, predict

    def seconds(args, census, table, shapes, o):
        return (2.0 - 0.5 * o.compile - 0.2 * (o.checkpoint_policy == "selective") - 0.8 * o.fp8_base
                - 0.001 * (60 - (60 if o.checkpoint_blocks is None else o.checkpoint_blocks)) + 0.1 * o.blocks_to_swap)

    chosen = []
    real_fastest = plan_time.fastest_fit
    monkeypatch.setattr(plan_time, "step_seconds", seconds)
    monkeypatch.setattr(plan_time, "log_time", lambda *a, **k: None)
    monkeypatch.setattr(plan_time, "fastest_fit", lambda *a, **k: chosen.append((a, real_fastest(*a, **k))) or chosen[-1][1])
    assert main(["plan", "--model", "2511", "--gpu", "h200", "--gpu_memory_gb", "100", "--launch_flags"]) == 0
    line = capfd.readouterr().out.splitlines()[-1]
    (_, census, base), fit = chosen[0]
    o = fit.options
    assert not o.fp8_base and o.compile and o.checkpoint_policy == "selective"
    assert fit.gpu_peak <= 100 * GiB
    assert line.split() == plan.train_flags(o)
    train = build_parser().parse_args(["train", "--model", "2511", "--cache_dir", "c", "--output_dir", "o",
                                       *line.split()])
    assert (train.gradient_checkpointing, train.checkpoint_policy, train.checkpoint_blocks, train.compile,
            train.fp8_base, train.blocks_to_swap) == (o.gradient_checkpointing, o.checkpoint_policy,
                                                      o.checkpoint_blocks, o.compile, o.fp8_base, o.blocks_to_swap)
    # every faster option set of the ranking is over the budget or on the FP8 base
    faster = [p for p in plan_time.fitting_options(census, base, 100 * GiB)
              if seconds(None, None, None, None, p.options) < seconds(None, None, None, None, o)]
    assert faster and all(p.options.fp8_base for p in faster)
    assert predict(census, o).gpu_peak == fit.gpu_peak


def test_launch_flags_is_refused_without_a_gpu_to_fit(capfd):
    from diffsynth_qie.cli import main

    assert main(["plan", "--model", "2511", "--launch_flags"]) == 2
    assert "--launch_flags" in capfd.readouterr().err
