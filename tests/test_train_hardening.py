"""`qie train` refusals and resumes: every device flag checked before anything loads, on-the-fly-only flags
warned about, `--validate_with ema` without an EMA refused, a refused run leaves nothing behind, and `--resume`
adds, drops or re-decays the EMA with a log line instead of accelerate's "Number of custom checkpoints"."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import fresh_accelerate  # noqa: E402


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def ema_log():
    """The training's log lines, INFO included (whatever an earlier test left the level at)."""
    handler = _Lines()
    logger = logging.getLogger("diffsynth_qie.training")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize("device", ["tpu:7", "cpu:abc", "meta", "gpu", "cuda:0"])
def test_every_device_flag_names_itself_and_the_devices(device, monkeypatch):
    import torch

    from diffsynth_qie.models.load.devices import check_device_flags

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for flag in ("--text_encoder_device", "--vae_device", "--dit_device", "--device"):
        with pytest.raises(ValueError, match=f"^{flag} {device} is not a device of this machine; choose one of cpu"):
            check_device_flags({flag: device})
    check_device_flags({"--vae_device": "cpu", "--device": None})


def test_a_bad_encoder_device_is_refused_before_anything_is_created_or_loaded(tmp_path, demo_data_dir, capfd):
    from diffsynth_qie.cli import main

    out = tmp_path / "run"
    with fresh_accelerate():
        code = main(["train", "--on_the_fly", "--dataset_metadata", str(demo_data_dir / "metadata.json"),
                     "--model", "tiny", "--model_dir", str(tmp_path / "no-model"), "--device", "cpu",
                     "--max_steps", "1", "--output_dir", str(out), "--vae_device", "tpu:7"])
    assert code == 2 and "--vae_device tpu:7 is not a device of this machine" in capfd.readouterr().err
    assert not out.exists()


def test_a_run_refused_during_set_up_leaves_no_folder_and_no_lock(tmp_path, demo_data_dir):
    """Missing weights with --on_the_fly: the refusal comes from the loader, after the lock was taken."""
    from diffsynth_qie.cli import main

    out = tmp_path / "run"
    with fresh_accelerate():
        code = main(["train", "--on_the_fly", "--dataset_metadata", str(demo_data_dir / "metadata.json"),
                     "--model", "tiny", "--model_dir", str(tmp_path / "no-model"), "--device", "cpu",
                     "--max_steps", "1", "--output_dir", str(out)])
    assert code != 0 and not out.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    with fresh_accelerate():
        code = main(["train", "--on_the_fly", "--dataset_metadata", str(demo_data_dir / "metadata.json"),
                     "--model", "tiny", "--model_dir", str(tmp_path / "no-model"), "--device", "cpu",
                     "--max_steps", "1", "--output_dir", str(existing)])
    assert code != 0 and sorted(p.name for p in existing.iterdir()) == ["notes.txt"]


def test_on_the_fly_flags_without_it_are_warned_and_validate_with_ema_needs_an_ema(caplog, ema_log):
    from diffsynth_qie.training import config as tc
    from diffsynth_qie.training.run_setup import check_flags

    cfg = tc.RunConfig(train=tc.TrainConfig(cache_dir=["c"], output_dir="o"),
                       onthefly=tc.OnTheFlyConfig(augment=True, vae_device="cpu", prefetch=4))
    check_flags(cfg)
    assert any("--augment, --vae_device, --prefetch only mean something with --on_the_fly" in x for x in ema_log)
    for which in ("ema", "both"):
        bad = tc.RunConfig(train=tc.TrainConfig(cache_dir=["c"], output_dir="o", validate_with=which))
        with pytest.raises(ValueError, match=f"--validate_with {which} .* pass --ema_decay"):
            bad.resolved()


def _config(cache_dir, tiny_model_dir, out, **train):
    from diffsynth_qie.training import config as tc

    t = dict(model="tiny", model_dir=str(tiny_model_dir), device="cpu", batch_size=2, seed=1,
             mixed_precision="no", gradient_checkpointing=False, save_every=1)
    t.update(train)
    return tc.RunConfig(train=tc.TrainConfig(cache_dir=str(cache_dir), output_dir=str(out), **t),
                        lora=tc.LoRAConfig(lora_rank=4), optim=tc.OptimConfig(learning_rate=1e-2))


def test_resume_drops_adds_and_re_decays_the_ema(cache_dir, tiny_model_dir, tmp_path, ema_log):
    from safetensors import safe_open

    from diffsynth_qie.training.loop import train

    out = tmp_path / "run"

    def run(steps, decay, resume=True):
        with fresh_accelerate():
            train(_config(cache_dir, tiny_model_dir, out, max_steps=steps, ema_decay=decay,
                          resume="latest" if resume else None))

    run(1, 0.9, resume=False)
    assert (out / "lora_ema.safetensors").is_file()
    run(2, 0.0)  # dropped: the step-1 average is not left beside the step-2 LoRA
    assert any("the checkpoint's EMA (decay 0.9) is dropped" in x for x in ema_log)
    assert not list((out / "checkpoint-2").rglob("custom_checkpoint_*"))
    assert (out / "lora.safetensors").is_file() and not (out / "lora_ema.safetensors").exists()
    assert any(x.startswith("removed ") and "lora_ema.safetensors: it was an earlier run's average" in x for x in ema_log)
    run(3, 0.5)  # added, from the resumed weights
    assert any("the checkpoint has no EMA, so it starts from the resumed weights" in x for x in ema_log)
    run(4, 0.8)  # re-decayed
    assert any("resuming with --ema_decay 0.8 (the checkpoint had 0.5)" in x for x in ema_log)
    with safe_open(str(Path(out) / "lora_ema.safetensors"), "pt") as f:
        assert "0.8" in f.metadata()["weights"]


def test_an_export_the_trained_modules_cannot_make_is_refused_before_anything_loads(cache_dir, tmp_path, capfd):
    """vLLM-Omni puts no LoRA on img_mod.1 / txt_mod.1, which the tiny preset trains by default: the run stops
    before the model loads (its --model_dir does not even exist), naming the modules and the three ways out."""
    from diffsynth_qie.cli import main

    out = tmp_path / "run"
    with fresh_accelerate():
        code = main(["train", "--model", "tiny", "--model_dir", str(tmp_path / "no-model"), "--cache_dir",
                     str(cache_dir), "--export", "comfyui,vllm-omni", "--max_steps", "1", "--device", "cpu",
                     "--output_dir", str(out)])
    err = capfd.readouterr().err
    line = next((x for x in err.splitlines() if "--export vllm-omni" in x), "")
    assert code == 2 and not out.exists(), err
    assert "img_mod.1" in line and "txt_mod.1" in line and "to_q" not in line
    assert "--lora_targets serving" in line and "--drop_unsupported" in line


def test_drop_unsupported_writes_every_export_with_what_its_runtime_loads(cache_dir, tiny_model_dir, tmp_path):
    """``qie train --export vllm-omni,diffusers --drop_unsupported``: the flag parses, training runs, and both
    exports are written, vLLM-Omni's without the modules it cannot load."""
    import json

    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.commands import train as train_cmd
    from diffsynth_qie.training.loop import train

    args = build_parser().parse_args(["train", "--cache_dir", "c", "--output_dir", "o", "--export", "vllm-omni",
                                      "--drop_unsupported"])
    assert train_cmd.config_from_args(args).lora.drop_unsupported is True
    cfg = _config(cache_dir, tiny_model_dir, tmp_path / "run", max_steps=1, save_every=0)
    cfg.lora.export, cfg.lora.drop_unsupported = "vllm-omni,diffusers", True
    with fresh_accelerate():
        result = train(cfg)
    folder = Path(result.lora_path).parent
    targets = json.loads((folder / "lora_vllm-omni" / "adapter_config.json").read_text())["target_modules"]
    assert targets and not [t for t in targets if t.endswith(("img_mod.1", "txt_mod.1"))]
    assert (folder / "lora_diffusers.safetensors").is_file()
