"""`qie train --ema_decay D`: the average equals a hand-computed EMA, resumes exactly after kill -9, is saved as
lora_ema.safetensors, and validation can render with it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import kill_and_resume  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _config(cache_dir, tiny_model_dir, out, **train):
    from diffsynth_qie.training import config as tc

    t = dict(model="tiny", model_dir=str(tiny_model_dir), device="cpu", batch_size=2, max_steps=5, seed=1,
             mixed_precision="no", gradient_checkpointing=False, save_every=0, ema_decay=0.9)
    t.update(train)
    return tc.RunConfig(train=tc.TrainConfig(cache_dir=str(cache_dir), output_dir=str(out), **t),
                        lora=tc.LoRAConfig(lora_rank=4), optim=tc.OptimConfig(learning_rate=1e-2))


def test_the_ema_is_the_hand_computed_average_of_five_steps(cache_dir, tiny_model_dir, tmp_path):
    from diffsynth_qie.training.loop import Hooks, train

    weights = []

    def keep(step, record):  # the weights after each optimizer step, as the EMA sees them
        weights.append({n: p.detach().float().clone() for n, p in module_ref[0].trainable_named_parameters()})

    module_ref = []
    import diffsynth_qie.training.ema as ema_mod

    real_init = ema_mod.LoraEMA.__init__

    def init(self, module, decay):
        module_ref.append(module)
        real_init(self, module, decay)
        weights.append({n: p.detach().float().clone() for n, p in module.trainable_named_parameters()})

    ema_mod.LoraEMA.__init__ = init
    try:
        result = train(_config(cache_dir, tiny_model_dir, tmp_path / "run"), Hooks(on_step_end=keep))
    finally:
        ema_mod.LoraEMA.__init__ = real_init
    assert len(weights) == 6  # the initial weights, then 5 steps
    expected = dict(weights[0])
    for w in weights[1:]:
        expected = {n: 0.9 * expected[n] + 0.1 * w[n] for n in expected}
    from diffsynth_qie.training.checkpoint import save_lora_file

    saved = load_file(str(Path(result.lora_path).parent / "lora_ema.safetensors"))
    final = load_file(str(result.lora_path))
    got = load_file(str(save_lora_file(tmp_path / "expected.safetensors", module_ref[0], expected)))
    assert saved.keys() == final.keys() == got.keys()
    assert all(torch.allclose(saved[k], got[k], rtol=1e-5, atol=1e-7) for k in got)
    assert any(not torch.allclose(saved[k], final[k]) for k in saved)  # the average is not the last weights


def test_a_killed_run_resumes_the_same_ema(cache_dir, tiny_model_dir, tmp_path):
    base = [sys.executable, "-m", "diffsynth_qie.cli", "train", "--cache_dir", str(cache_dir), "--model", "tiny",
            "--model_dir", str(tiny_model_dir), "--device", "cpu", "--batch_size", "2", "--max_steps", "12",
            "--save_every", "4", "--lora_rank", "4", "--learning_rate", "1e-2", "--no-gradient_checkpointing",
            "--mixed_precision", "no", "--ema_decay", "0.8", "--seed", "2"]
    ref, out = kill_and_resume(base, tmp_path, "checkpoint-8", "lora_ema.safetensors")
    a, b = load_file(str(out / "lora_ema.safetensors")), load_file(str(ref / "lora_ema.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-8) for k in b)


def test_validation_renders_with_both_and_the_flags_are_checked(cache_dir, tiny_model_dir, tmp_path, capsys):
    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.training.loop import train

    out = tmp_path / "run"
    train(_config(cache_dir, tiny_model_dir, out, max_steps=2, validate_every=2, num_validation=1,
                  validation_steps=1, validate_with="both"))
    assert sorted(p.name for p in (out / "validation").iterdir()) == ["step-2", "step-2-ema"]
    log = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    assert any("val_psnr_ema" in r for r in log) and any("val_psnr" in r for r in log)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--ema_decay", "1.5"])
    assert "--ema_decay: 1.5 is out of range" in capsys.readouterr().err
