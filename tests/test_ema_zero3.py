"""``--ema_decay`` under DeepSpeed ZeRO-3 on two processes: each process averages only its own partition of
every LoRA tensor, yet the saved ``lora_ema.safetensors`` is the hand-computed EMA of the whole weights; the
checkpoint state round-trips through the partitions; validation's swap puts the average into the module and
restores the trained weights after.

Launches the shipped ``deepspeed_configs/zero3.json`` (persistence threshold lowered so the tiny tensors are
partitioned) on CPU with gloo. torchrun and its two ranks run in the already imported python of
tests/warm_python.py (a fresh torchrun is tests/test_train_ddp.py's).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
from conftest import free_port  # noqa: E402

pytestmark = pytest.mark.slow

DRIVER = r'''
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from diffsynth_qie.training import checkpoint as ck, loop, ema as ema_mod
from diffsynth_qie.training import config as tc

from accelerate import PartialState
dist_state = PartialState(backend="gloo")  # accelerate picks no CPU backend for DeepSpeed under torchrun
cache_dir, out, model_dir = sys.argv[1:4]
seen, weights = {}, []
real_init = ema_mod.LoraEMA.__init__

def init(self, module, decay):
    real_init(self, module, decay)
    seen.update(ema=self, module=module)
    weights.append(ck.gather_trainable(module, dist_state, fp32_master=False))  # collective

def keep(step, record):  # the module's weights after each optimizer step (collective)
    weights.append(ck.gather_trainable(seen["module"], dist_state, fp32_master=False))

original = ck.save_final_lora


def checks(accelerator, module, *args, **kwargs):  # at the final save, while the process group is up
    ema = seen["ema"]
    seen["partition"] = {n: (t.numel(), ema.params[n].ds_numel) for n, t in ema.shadow.items()}
    seen["state"] = ema.state_dict()
    for t in ema.shadow.values():
        t.zero_()
    ema.load_state_dict(seen["state"])
    seen["reloaded"] = ema.full()
    with ema.applied(module):
        seen["inside"] = ck.gather_trainable(module, accelerator, fp32_master=False)
    seen["after"] = ck.gather_trainable(module, accelerator, fp32_master=False)
    return original(accelerator, module, *args, **kwargs)


ema_mod.LoraEMA.__init__ = init
ck.save_final_lora = checks
cfg = tc.RunConfig(
    train=tc.TrainConfig(cache_dir=cache_dir, output_dir=out, model="tiny", model_dir=model_dir, batch_size=1,
                         max_steps=4, save_every=0, gradient_checkpointing=False, seed=0, ema_decay=0.7),
    lora=tc.LoRAConfig(lora_rank=4, lora_alpha=8.0),
    optim=tc.OptimConfig(optimizer="adamw", learning_rate=1e-2))
loop.train(cfg, loop.Hooks(on_step_end=keep))

ema, acc = seen["ema"], dist_state
state, reloaded, inside, after, partition = (seen[k] for k in ("state", "reloaded", "inside", "after", "partition"))
if acc.is_main_process:
    for i, w in enumerate(weights):
        save_file({k: v.contiguous() for k, v in w.items()}, str(Path(out) / f"w{i}.safetensors"))
    for name, d in (("inside", inside), ("after", after), ("reloaded", reloaded), ("state", state["shadow"])):
        save_file({k: v.contiguous().cpu() for k, v in d.items()}, str(Path(out) / f"{name}.safetensors"))
    (Path(out) / "info.json").write_text(json.dumps({"steps": len(weights) - 1, "partitioned": ema.partitioned,
                                                     "world": acc.num_processes, "partition": partition}))
'''


def test_ema_under_zero3_averages_partitions_and_saves_the_whole_average(cache_dir, tiny_model_dir, tmp_path,
                                                                        warm_venv):
    ds = json.loads((ROOT / "deepspeed_configs" / "zero3.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "out"
    out.mkdir()
    # torchrun with accelerate's DeepSpeed variables (accelerate launch needs MPI for multi-process CPU runs)
    env = {**os.environ, "DIFFSYNTH_SKIP_DOWNLOAD": "True", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "ds.json"),
           "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}
    proc = subprocess.run(
        [str(warm_venv / "bin" / "python"), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(tmp_path / "driver.py"), str(cache_dir), str(out), str(tiny_model_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    info = json.loads((out / "info.json").read_text())
    assert info["steps"] == 4 and info["partitioned"] and info["world"] == 2
    # each process holds about half of every tensor's average
    assert all(local == (whole + 1) // 2 for local, whole in info["partition"].values())
    weights = [load_file(str(out / f"w{i}.safetensors")) for i in range(5)]
    expected = {k: v.float() for k, v in weights[0].items()}
    for w in weights[1:]:
        expected = {k: 0.7 * expected[k] + 0.3 * w[k].float() for k in expected}
    state, reloaded = load_file(str(out / "state.safetensors")), load_file(str(out / "reloaded.safetensors"))
    assert all(torch.allclose(state[k], expected[k], rtol=1e-5, atol=1e-7) for k in expected)
    assert all(torch.equal(reloaded[k], state[k]) for k in state)  # whole → partitions → whole
    assert any(not torch.allclose(expected[k], weights[-1][k].float()) for k in expected)

    from diffsynth_qie.lora import load_lora_state, peft_state_dict
    from diffsynth_qie.training.module import canonical_param_name

    saved = peft_state_dict(load_lora_state(out / "lora_ema.safetensors"), peft_scale=2.0)
    assert set(saved) == {canonical_param_name(k) for k in expected}
    for k, v in expected.items():
        assert torch.allclose(saved[canonical_param_name(k)].float(), v, rtol=1e-5, atol=1e-7), k
    inside, after = load_file(str(out / "inside.safetensors")), load_file(str(out / "after.safetensors"))
    # the module holds the average in its own dtype (bf16 here) while validation renders
    assert all(torch.equal(inside[k], state[k].to(inside[k].dtype)) for k in state)
    assert all(torch.equal(after[k], weights[-1][k]) for k in after)  # the trained weights are back
