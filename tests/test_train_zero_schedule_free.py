"""ProdigyPlusScheduleFree under DeepSpeed ZeRO-3: validation and saved LoRAs use the average x.

Under ZeRO the optimizer only holds flat fp32 partitions (ZeRO-3 even empties its param
groups between steps), so a bare ``optimizer.eval()`` moves nothing the module uses
(docs/DIFFSYNTH_NOTES.md). ``optim.schedule_free_eval`` moves every partition and copies them into the
module weights, and moves them back after. This launches the shipped
``deepspeed_configs/zero3.json`` (gradient_clipping "auto": the trainer writes 0, required with this optimizer;
persistence threshold lowered so the tiny tensors are partitioned) with a small driver that
gathers the LoRA before, inside and after ``schedule_free_eval`` at the final save. ``accelerate launch`` and its
process run in the already imported python of tests/warm_python.py (a fresh one is tests/test_zero3.py's first run).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
from conftest import free_port  # noqa: E402

pytestmark = pytest.mark.slow

DRIVER = r'''
import json, sys
from pathlib import Path
from safetensors.torch import save_file
from diffsynth_qie.training import checkpoint as ck, loop, optim
from diffsynth_qie.training import config as tc

cache_dir, out, model_dir = sys.argv[1:4]
original = ck.save_final_lora

def spy(accelerator, module, optimizer, engine, output_dir, metadata=None):
    y = ck.gather_trainable(module, accelerator, fp32_master=False)  # the module's copies
    with optim.schedule_free_eval(optimizer, engine) as held:
        x = ck.gather_trainable(module, accelerator, fp32_master=False)
    y_after = ck.gather_trainable(module, accelerator, fp32_master=False)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in x.items()}, str(Path(out) / "x.safetensors"))
        save_file({k: v.contiguous() for k, v in y.items()}, str(Path(out) / "y.safetensors"))
        save_file({k: v.contiguous() for k, v in y_after.items()}, str(Path(out) / "y_after.safetensors"))
        (Path(out) / "held.json").write_text(json.dumps({"held": held, "engine": type(engine).__name__}))
    return original(accelerator, module, optimizer, engine, output_dir, metadata)

ck.save_final_lora = spy
cfg = tc.RunConfig(
    train=tc.TrainConfig(cache_dir=cache_dir, output_dir=out, model="tiny", model_dir=model_dir, batch_size=2,
                         max_steps=3, save_every=0, gradient_checkpointing=False, seed=0),
    lora=tc.LoRAConfig(lora_rank=4, lora_alpha=8.0),
    optim=tc.OptimConfig(optimizer="prodigy_sf", learning_rate=100.0))
loop.train(cfg)
'''


def test_schedule_free_average_reaches_the_module_under_zero3(cache_dir, tiny_model_dir, tmp_path, warm_venv):
    from safetensors.torch import load_file

    from diffsynth_qie.lora import load_lora_state, peft_state_dict
    from diffsynth_qie.training.module import canonical_param_name

    ds = json.loads((ROOT / "deepspeed_configs" / "zero3.json").read_text())
    assert ds["gradient_clipping"] == "auto" and ds["zero_optimization"]["stage"] == 3
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    yaml = (ROOT / "deepspeed_configs" / "zero3.yaml").read_text()
    yaml = (yaml.replace("deepspeed_configs/zero3.json", str(tmp_path / "ds.json"))
            .replace("num_processes: 8", "num_processes: 1").replace("use_cpu: false", "use_cpu: true"))
    (tmp_path / "acc.yaml").write_text(yaml)
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "DIFFSYNTH_SKIP_DOWNLOAD": "True", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [str(warm_venv / "bin" / "python"), "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "acc.yaml"),
         "--num_cpu_threads_per_process", "1", "--main_process_port", str(free_port()), str(tmp_path / "driver.py"),
         str(cache_dir), str(out), str(tiny_model_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    held = json.loads((out / "held.json").read_text())
    assert held == {"held": "schedule-free average x", "engine": "DeepSpeedEngine"}
    x, y, y_after = (load_file(str(out / f"{n}.safetensors")) for n in ("x", "y", "y_after"))
    assert max(float((x[k].float() - y[k].float()).abs().max()) for k in y) > 1e-4  # eval() moved the module
    assert all(torch.equal(y[k], y_after[k]) for k in y)  # and train() moved it back
    # the final LoRA file is x
    saved = peft_state_dict(load_lora_state(out / "lora.safetensors"), peft_scale=2.0)
    assert set(saved) == {canonical_param_name(k) for k in x}
    for k, v in x.items():
        assert torch.equal(saved[canonical_param_name(k)].to(v.dtype), v), k
