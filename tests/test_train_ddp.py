"""Two-process DDP on CPU (gloo) through `torchrun -m diffsynth_qie.cli train`: sharded data, barriers, resume.

A run of 4 optimizer steps (2 micro-batches each, a checkpoint every 2) through torchrun is the reference; a
second run resumes from its ``checkpoint-2`` into another directory and must log the same
losses for steps 3 and 4 (the loss is averaged over both ranks, so each rank's data
position, σ/noise seeds and the shared optimizer state must all be restored). torchrun
rather than ``accelerate launch``: accelerate needs MPI for multi-process CPU runs. The resumed and the on-the-fly
runs are two-process runs too, their ranks forked from the test process with torchrun's variables
(conftest.forked_ranks): the same process group and ``qie train`` main, without each rank importing torch anew.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
from conftest import curve_script, forked_ranks, free_port  # noqa: E402  (tests/assets/make_train_loss_curve.py)

pytestmark = pytest.mark.slow


def torchrun(args: list[str], port: int) -> None:
    env = {**os.environ, "DIFFSYNTH_SKIP_DOWNLOAD": "True", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "diffsynth_qie.cli", "train", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _common(tiny_model_dir) -> list[str]:
    return ["--model", "tiny", "--model_dir", str(tiny_model_dir), "--device", "cpu", "--batch_size", "2",
            "--gradient_accumulation_steps", "2", "--max_steps", "4", "--lora_rank", "4", "--learning_rate", "5e-3",
            "--save_every", "2", "--cfg_dropout", "0.3", "--no-gradient_checkpointing"]


@pytest.fixture(scope="module")
def ddp_reference(cache_dir, tiny_model_dir, tmp_path_factory) -> Path:
    """4 steps of two-process DDP from the cache."""
    ref = tmp_path_factory.mktemp("ddp") / "ref"
    torchrun(["--cache_dir", str(cache_dir), *_common(tiny_model_dir), "--output_dir", str(ref)], port=free_port())
    return ref


def test_ddp_two_processes_train_and_resume_exactly(ddp_reference, cache_dir, tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    from diffsynth_qie.training.checkpoint import STATE_DIR, list_checkpoints
    from diffsynth_qie.training.tracking import read_loss_log

    ref, resumed = ddp_reference, tmp_path / "resumed"
    assert [p.name for p in list_checkpoints(ref)] == ["checkpoint-2", "checkpoint-4"]
    state = ref / "checkpoint-2" / STATE_DIR
    assert (state / "random_states_0.pkl").is_file() and (state / "random_states_1.pkl").is_file()
    ref_log = read_loss_log(ref / "loss.jsonl")
    assert [r["step"] for r in ref_log] == [1, 2, 3, 4]

    forked_ranks(["train", "--cache_dir", str(cache_dir), *_common(tiny_model_dir), "--output_dir", str(resumed),
                  "--resume", str(ref / "checkpoint-2")], 2, tmp_path / "logs")
    log = read_loss_log(resumed / "loss.jsonl")
    assert [r["step"] for r in log] == [3, 4]
    assert [r["loss"] for r in log] == pytest.approx([r["loss"] for r in ref_log[2:]], rel=1e-6, abs=1e-7)
    a, b = load_file(str(resumed / "lora.safetensors")), load_file(str(ref / "lora.safetensors"))
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_ddp_on_the_fly_each_rank_encodes_its_share_with_the_cached_numbers(ddp_reference, demo_data_dir,
                                                                           tiny_model_dir, tmp_path):
    """Two ranks train on the fly from the metadata: the step losses (averaged over both ranks) of the cached run."""
    from diffsynth_qie.training.tracking import read_loss_log

    live = tmp_path / "live"
    forked_ranks(["train", "--on_the_fly", "--dataset_metadata", str(Path(demo_data_dir) / "metadata.json"),
                  "--max_pixels", str(curve_script.CACHE_MAX_PIXELS), *_common(tiny_model_dir), "--output_dir",
                  str(live)], 2, tmp_path / "logs")
    got, ref = read_loss_log(live / "loss.jsonl"), read_loss_log(ddp_reference / "loss.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
