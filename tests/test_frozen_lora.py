"""`qie train --frozen_lora`: a task LoRA trained on top of a frozen, unmerged LoRA (a turbo LoRA) on the tiny
2.1. The frozen weights never change and are never saved; they shape the loss; resume is exact (killed and
resumed); the trained LoRA records what it was trained on and declares the frozen LoRA's schedule; a frozen
LoRA of the other family is refused in one line."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import cache_demo21, fresh_accelerate, kill_and_resume  # noqa: E402

SCHEDULE = {"version": 1, "steps": 4, "cfg": 1.0, "sigmas": [1.0, 0.75, 0.5, 0.25]}


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    with fresh_accelerate():
        yield


@pytest.fixture(scope="module")
def cache21(tiny21_dir, tmp_path_factory):
    return cache_demo21(tiny21_dir, tmp_path_factory, seed=2, name="demo21f")


def _frozen_file(path: Path, preset: str = "tiny-2.1") -> Path:
    """A rank-2 LoRA on to_q and img_mlp.proj of both tiny 2.1 blocks, large enough to move the loss."""
    from diffsynth_qie.tiny.qwen21 import tiny_dit
    from safetensors.torch import save_file

    modules = dict(tiny_dit().named_modules())
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for block in (0, 1):
        for name in (f"transformer_blocks.{block}.attn.to_q", f"transformer_blocks.{block}.img_mlp.proj"):
            out_dim, in_dim = modules[name].weight.shape
            tensors[f"{name}.lora_A.weight"] = torch.randn(2, in_dim, generator=g) * 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_dim, 2, generator=g) * 0.5
    save_file(tensors, str(path), metadata={"preset": preset, "qie_schedule": json.dumps(SCHEDULE)})
    return path


def _config(cache, out, model_dir, frozen=None, **train):
    from diffsynth_qie.training import config as tc

    t = dict(model="tiny-2.1", model_dir=str(model_dir), batch_size=2, max_steps=4, mixed_precision="no",
             gradient_checkpointing=False, save_every=0, seed=0, device="cpu")
    t.update(train)
    return tc.RunConfig(train=tc.TrainConfig(cache_dir=str(cache), output_dir=str(out), **t),
                        lora=tc.LoRAConfig(lora_rank=4, frozen_lora=None if frozen is None else str(frozen),
                                           frozen_lora_scale=0.8),
                        optim=tc.OptimConfig(learning_rate=1e-2))


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_the_frozen_lora_shapes_the_loss_never_changes_and_is_recorded(cache21, tiny21_dir, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from diffsynth_qie.lora.frozen import trained_on
    from diffsynth_qie.models.samplers.declared import declared_schedule
    from diffsynth_qie.training.loop import Hooks, train

    frozen = _frozen_file(tmp_path / "turbo.safetensors")
    before = _sha(frozen)
    file_tensors = load_file(str(frozen))
    seen = {}

    def check_branches(step, record):  # the module's branch buffers still equal the file, every step
        from diffsynth_qie.lora.branch import _adapters

        module = seen["module"]
        for name, m in module.dit.named_modules():
            for adapter in _adapters(m):
                key = name.replace(".base_layer", "")
                assert torch.equal(getattr(m, f"{adapter.key}_A"), file_tensors[f"{key}.lora_A.weight"])
                assert torch.equal(getattr(m, f"{adapter.key}_B"), file_tensors[f"{key}.lora_B.weight"])
                assert adapter.scale == pytest.approx(0.8)
                seen["branches"] = seen.get("branches", 0) + 1

    import diffsynth_qie.training.module as module_mod

    original_init = module_mod.QIETrainingModule.__init__

    def spy(self, *a, **k):
        original_init(self, *a, **k)
        seen["module"] = self
        assert not any("qie_lora" in n for n, _ in self.trainable_named_parameters())

    module_mod.QIETrainingModule.__init__ = spy
    try:
        result = train(_config(cache21, tmp_path / "on", tiny21_dir, frozen), Hooks(on_step_end=check_branches))
    finally:
        module_mod.QIETrainingModule.__init__ = original_init
    assert seen["branches"] == 4 * 4  # 4 branched linears, checked after each of 4 steps
    with fresh_accelerate():
        plain = train(_config(cache21, tmp_path / "off", tiny21_dir))
    assert result.losses[0] != pytest.approx(plain.losses[0], rel=1e-3)  # the branches are in the forward
    assert _sha(frozen) == before
    saved = load_file(str(result.lora_path))
    assert saved.keys() == load_file(str(plain.lora_path)).keys()  # the frozen tensors are never saved
    with safe_open(str(result.lora_path), "pt") as f:
        meta = f.metadata()
    on = trained_on(meta)
    assert on["file"] == "turbo.safetensors" and on["scale"] == pytest.approx(0.8) and on["sha256"] == before
    schedule, where = declared_schedule(result.lora_path)
    assert where == "its metadata" and list(schedule.sigmas) == SCHEDULE["sigmas"]


def test_validation_samples_with_the_frozen_loras_schedule(cache21, tiny21_dir, tmp_path):
    from types import SimpleNamespace

    from diffsynth_qie.training.validation import Validator

    frozen = SimpleNamespace(frozen_schedule=None)
    v = Validator.__new__(Validator)
    v.num_steps, v.cfg_scale = 8, 3.0
    v.accelerator = SimpleNamespace(unwrap_model=lambda m: m)
    assert v.schedule(frozen) == (8, 3.0, None)
    from diffsynth_qie.models.samplers.declared import from_metadata

    frozen.frozen_schedule = from_metadata({"qie_schedule": json.dumps(SCHEDULE)})
    assert v.schedule(frozen) == (4, 1.0, (1.0, 0.75, 0.5, 0.25))


def test_a_frozen_lora_of_the_other_family_is_refused_in_one_line(cache21, tiny21_dir, tmp_path):
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.module import QIETrainingModule

    other = _frozen_file(tmp_path / "edit_lora.safetensors", preset="tiny")
    cfg = _config(cache21, tmp_path, tiny21_dir, other).resolved(get_preset("tiny-2.1"))
    dit = load_pipeline("tiny-2.1", model_dir=tiny21_dir, components=("dit",), device="cpu",
                        torch_dtype=torch.float32).dit
    with pytest.raises(ValueError, match=r"--frozen_lora .*edit_lora.safetensors is for qwen-image-edit, but --model "
                                         r"is qwen-image-2.1: pass a qwen-image-2.1 LoRA") as err:
        QIETrainingModule(dit, cfg, "tiny-2.1")
    assert "\n" not in str(err.value)


def test_qie_edit_offers_to_stack_the_two(tmp_path, caplog):
    import logging

    from safetensors.torch import save_file

    from diffsynth_qie.lora.frozen import FrozenLora, stack_hint

    base = _frozen_file(tmp_path / "turbo.safetensors")
    mine = tmp_path / "mine.safetensors"
    save_file({"x": torch.zeros(1)}, str(mine), metadata=FrozenLora(str(base), 0.8, "abc").metadata())
    with caplog.at_level(logging.INFO, logger="diffsynth_qie.lora.frozen"):
        assert stack_hint([mine]) == [(str(base.resolve()), 0.8)]
    assert "add --lora" in caplog.records[0].getMessage()
    assert stack_hint([mine, base]) == []  # already stacked


def test_training_on_a_frozen_lora_resumes_exactly_after_a_kill(cache21, tiny21_dir, tmp_path):
    from safetensors.torch import load_file

    frozen = _frozen_file(tmp_path / "turbo.safetensors")
    base = [sys.executable, "-m", "diffsynth_qie.cli", "train", "--model", "tiny-2.1", "--model_dir", str(tiny21_dir),
            "--cache_dir", str(cache21), "--batch_size", "2", "--max_steps", "6", "--save_every", "2",
            "--mixed_precision", "no", "--device", "cpu", "--lora_rank", "4", "--learning_rate", "1e-2",
            "--frozen_lora", str(frozen), "--frozen_lora_scale", "0.8", "--no_preflight"]
    ref, out = kill_and_resume(base, tmp_path, "checkpoint-2", "lora.safetensors")
    a, b = load_file(str(out / "lora.safetensors")), load_file(str(ref / "lora.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-8) for k in a)
    losses = [[json.loads(line)["loss"] for line in (d / "loss.jsonl").read_text().splitlines() if '"loss"' in line]
              for d in (ref, out)]
    assert losses[1][-2:] == pytest.approx(losses[0][-2:], rel=1e-6)
