"""ZeRO-3 through the real launcher: `accelerate launch -m diffsynth_qie.cli train` on DeepSpeed's CPU accelerator.

bf16 only (docs/DIFFSYNTH_NOTES.md: ZeRO-3 shards are bf16 on CPU). One process: with several processes
on a machine without CUDA, accelerate 1.15 initialises DeepSpeed's process group (world
size 2) but reports ``num_processes == 1`` and ``process_index == 0`` on every rank
(``AcceleratorState._prepare_backend`` only knows multi-process DeepSpeed on GPUs), so
both ranks would act as the main process. Parameters are still built partitioned
(``zero.Init``) and saved through ``GatheredParameters``. The DeepSpeed JSON is the shipped
``deepspeed_configs/zero3.json`` with ``stage3_param_persistence_threshold`` lowered to 0
(the tiny model's tensors would otherwise all stay unpartitioned). It keeps
``stage3_gather_16bit_weights_on_model_save: false``, under which
``accelerator.get_state_dict`` raises: a run that gathered the whole DiT to save could not
pass. The first run on a machine JIT-compiles DeepSpeed's shm op (~30 s, then cached).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
from conftest import free_port  # noqa: E402

pytestmark = pytest.mark.slow


def launcher_config(tmp: Path, num_processes: int) -> Path:
    ds = json.loads((ROOT / "deepspeed_configs" / "zero3.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds["gradient_clipping"] == "auto" and ds["bf16"]["enabled"] is True
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp / "zero3.json").write_text(json.dumps(ds))
    yaml = (ROOT / "deepspeed_configs" / "zero3.yaml").read_text()
    yaml = yaml.replace("deepspeed_configs/zero3.json", str(tmp / "zero3.json"))
    yaml = yaml.replace("num_processes: 8", f"num_processes: {num_processes}").replace("use_cpu: false", "use_cpu: true")
    path = tmp / "zero3.yaml"
    path.write_text(yaml)
    return path


def launch(config: Path, args: list[str], timeout: int = 600,
           python: str = sys.executable) -> subprocess.CompletedProcess:
    env = {**os.environ, "DIFFSYNTH_SKIP_DOWNLOAD": "True", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [python, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_cpu_threads_per_process", "1", "--main_process_port", str(free_port()), "-m", "diffsynth_qie.cli", "train", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def test_zero3_trains_saves_a_loadable_lora_and_resumes(cache_dir, tiny_model_dir, tmp_path, warm_venv):
    from diffsynth_qie.models.qwen_image_edit.forward import dit_forward
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.lora import apply_lora, load_lora_state
    from diffsynth_qie.training.checkpoint import STATE_DIR, TRAINABLE_NAME, list_checkpoints
    from diffsynth_qie.training.tracking import read_loss_log

    config = launcher_config(tmp_path, num_processes=1)
    out = tmp_path / "out"
    common = ["--cache_dir", str(cache_dir), "--output_dir", str(out), "--model", "tiny", "--model_dir",
              str(tiny_model_dir), "--batch_size", "2", "--lora_rank", "4", "--lora_alpha", "8",
              "--learning_rate", "1e-2", "--save_every", "1", "--keep_last", "2", "--no-gradient_checkpointing"]
    proc = launch(config, [*common, "--max_steps", "2"])
    assert "streamed the DiT's weights into its ZeRO-3 partitions" in proc.stdout + proc.stderr  # memory/zero3_load.py
    ckpts = list_checkpoints(out)
    assert [p.name for p in ckpts] == ["checkpoint-1", "checkpoint-2"]
    assert (ckpts[-1] / STATE_DIR / "pytorch_model").is_dir()  # DeepSpeed engine checkpoint (frozen weights excluded)
    assert not (ckpts[-1] / TRAINABLE_NAME).exists()
    log = read_loss_log(out / "loss.jsonl")
    assert [r["step"] for r in log] == [1, 2] and all(r["loss"] == r["loss"] for r in log)

    # the LoRA loads with our loader into a plain fp32 DiT and changes its output
    state = load_lora_state(out / "lora.safetensors")
    assert len(state.modules) == 24 and state.ranks == {4}
    from safetensors.torch import load_file as read_tensors

    # DeepSpeed's fp32 masters, not the module's bf16 copies
    assert {t.dtype for t in read_tensors(str(out / "lora.safetensors")).values()} == {torch.float32}
    assert any(float(m.B.float().abs().max()) > 0 for m in state.modules.values())
    pipe = load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu", torch_dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in pipe.dit.named_parameters()}
    x = torch.randn(16, 8, 8, generator=torch.Generator().manual_seed(0))
    emb = torch.randn(20, 32, generator=torch.Generator().manual_seed(1))
    args = ([x], torch.tensor([500.0]), [emb], [[x]])
    with torch.no_grad():
        before = dit_forward(pipe.dit, *args)[0]
        apply_lora(pipe.dit, state)
        after = dit_forward(pipe.dit, *args)[0]
    assert float((after - before).abs().max()) > 1e-4
    assert any(not torch.equal(base[n], p) for n, p in pipe.dit.named_parameters())

    # resume 'latest' (DeepSpeed load_checkpoint, frozen weights excluded) of the finished run: nothing left to
    # train, so the final LoRA is re-exported from the restored weights and must equal checkpoint-2's. The first run is
    # a fresh `accelerate launch`; this one runs in the already imported python of tests/warm_python.py
    (out / "lora.safetensors").unlink()
    launch(config, [*common, "--max_steps", "2", "--resume", "latest"], python=str(warm_venv / "bin" / "python"))
    from safetensors.torch import load_file

    restored, saved = load_file(str(out / "lora.safetensors")), load_file(str(ckpts[-1] / "lora.safetensors"))
    assert set(restored) == set(saved) and all(torch.equal(restored[k], saved[k]) for k in saved)
    assert [r["step"] for r in read_loss_log(out / "loss.jsonl")] == [1, 2]
