"""Two processes (gloo, torchrun) loading in turns: one fails in its turn, and both stop at once naming it,
instead of the other waiting for the process group's timeout. torchrun and its two processes run in a python that has
imported torch already (tests/warm_python.py; a fresh torchrun is tests/test_train_ddp.py's)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
from conftest import free_port  # noqa: E402


@pytest.fixture(scope="module")
def torch_python(tmp_path_factory):
    """``python`` (a path) whose runs start with torch, torchrun and the loading turns imported."""
    from warm_python import warm_python

    with warm_python(tmp_path_factory.mktemp("warm-torch"), preload=(
            "torch", "torch.distributed.run", "diffsynth_qie.training.placement")) as folder:
        yield str(folder / "bin" / "python")


@pytest.mark.parametrize("failing", [0])  # process 1 waits for a turn that never ends
def test_one_process_failing_its_turn_stops_both(failing, torch_python):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QIE_DIST_TIMEOUT_MIN": "10", "PYTHONPATH": str(ROOT)}
    cmd = [torch_python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "tests" / "assets" / "turns_worker.py"), str(failing)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert proc.stdout.count("RAISED ") == 2, out[-3000:]  # both processes stopped, neither loaded
    assert "LOADED" not in proc.stdout
    own = f"RAISED ValueError: --model_dir /nowhere (process {failing}): no such directory"
    other = (f"RAISED ValueError: process {failing} failed while loading the DiT in its turn: ValueError: "
             f"--model_dir /nowhere (process {failing}): no such directory")
    assert own in proc.stdout and other in proc.stdout, out[-3000:]
    assert seconds < 60, f"{seconds:.0f} s"  # the group's timeout is 10 min here: nobody waited for it


def test_the_process_group_timeout_is_sized_for_a_load(monkeypatch):
    from datetime import timedelta

    from diffsynth_qie.training.placement import process_group_timeout

    monkeypatch.delenv("QIE_DIST_TIMEOUT_MIN", raising=False)
    assert process_group_timeout() == timedelta(minutes=60)  # torch's NCCL default is 10
    monkeypatch.setenv("QIE_DIST_TIMEOUT_MIN", "90")
    assert process_group_timeout() == timedelta(minutes=90)
    monkeypatch.setenv("QIE_DIST_TIMEOUT_MIN", "soon")
    with pytest.raises(ValueError, match="QIE_DIST_TIMEOUT_MIN='soon'"):
        process_group_timeout()
