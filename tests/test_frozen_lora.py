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

from conftest import fresh_accelerate, kill_and_resume  # noqa: E402

SCHEDULE = {"version": 1, "steps": 4, "cfg": 1.0, "sigmas": [1.0, 0.75, 0.5, 0.25]}

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
CACHE21_SEED = 2  # the conftest fixture cache21 caches the 2.1 demo of this seed


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


def test_resume_on_another_frozen_lora_or_scale_is_refused_by_name(tmp_path):
    from diffsynth_qie.lora.frozen import FrozenLora
    from diffsynth_qie.training.resume import check_resume, frozen_identity

    turbo = frozen_identity(FrozenLora(str(tmp_path / "turbo.safetensors"), 0.8, "a" * 64))
    saved = {"config": {}, "frozen_lora": turbo}
    assert check_resume(saved, {"config": {}, "frozen_lora": dict(turbo)}, "ckpt") == []  # same content and scale
    moved = frozen_identity(FrozenLora(str(tmp_path / "elsewhere" / "turbo.safetensors"), 0.8, "a" * 64))
    assert check_resume(saved, {"config": {}, "frozen_lora": moved}, "ckpt") == []  # a moved file is the same file
    for other in (frozen_identity(FrozenLora("turbo.safetensors", 0.8, "b" * 64)),
                  frozen_identity(FrozenLora("turbo.safetensors", 1.0, "a" * 64)), None):
        with pytest.raises(ValueError, match=r"--frozen_lora: aaaaaaaaaaaa… at scale 0.8 -> "):
            check_resume(saved, {"config": {}, "frozen_lora": other}, "ckpt")
    assert check_resume({"config": {}}, {"config": {}, "frozen_lora": turbo}, "ckpt") == []  # an older checkpoint


def test_the_training_preflight_runs_the_frozen_branches_on_the_fake_device(tmp_path):
    """`qie train --frozen_lora` under the preflight: the frozen branches are on the fake GPU and in the step."""
    import dataclasses

    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.config import RunConfig
    from diffsynth_qie.preflight.train import preflight

    frozen = _frozen_file(tmp_path / "turbo.safetensors")
    preset = get_preset("tiny-2.1")

    def report(frozen_lora):
        cfg = RunConfig()
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, model="tiny-2.1", cache_dir="-",
                                                                 output_dir="-"),
                                  lora=dataclasses.replace(cfg.lora, lora_rank=4, frozen_lora=frozen_lora))
        return preflight(cfg.resolved(preset), preset, gpu_memory_gb=80)

    plain, stacked = report(None), report(str(frozen))
    # 4 frozen layers of rank 2 (A and B), stored in the DiT's dtype on the device
    frozen_bytes = sum(t.numel() for t in __import__("safetensors.torch").torch.load_file(str(frozen)).values())
    assert stacked.weights - plain.weights >= frozen_bytes * 2
    assert stacked.forward_backward_peak > plain.forward_backward_peak


def test_a_frozen_branch_registered_on_the_host_is_caught_by_the_training_preflight(tmp_path, monkeypatch):
    """The training module reads --frozen_lora on the host and attaches it to the DiT on the (fake) GPU, as a real
    run does; a branch left on the host (the branch's forward would copy it at every call) fails the preflight."""
    import dataclasses

    from diffsynth_qie.lora import branch
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.config import RunConfig
    from diffsynth_qie.preflight.train import preflight

    sys.path.insert(0, str(Path(__file__).parent / "memory"))
    from edit_planting import plant

    preset = get_preset("tiny-2.1")
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, model="tiny-2.1", cache_dir="-", output_dir="-"),
                              lora=dataclasses.replace(cfg.lora, lora_rank=4,
                                                       frozen_lora=str(_frozen_file(tmp_path / "turbo.safetensors"))))
    plant(monkeypatch, branch, "attach", "lora.A.to(device=weight.device, dtype=dtype)", "lora.A.to(dtype=dtype)")
    with pytest.raises(ValueError, match=r"preflight .*LoRA branch off its layer's device: the training module's "
                                         r"--frozen_lora left the branch of transformer_blocks\.0\.\S+ .* on cpu while "
                                         r"the layer's weight is on cuda:0"):
        preflight(cfg.resolved(preset), preset, gpu_memory_gb=80)


def test_first_blocks_file_keeps_what_a_shallower_dit_has_in_every_key_format(tmp_path):
    from safetensors.torch import load_file, save_file

    from diffsynth_qie.preflight.lora_files import first_blocks_file

    keys = ["transformer_blocks.0.attn.to_q.lora_A.weight", "transformer_blocks.1.attn.to_q.lora_A.weight",
            "transformer_blocks.12.attn.to_q.lora_A.weight", "diffusion_model.transformer_blocks.2.img_mlp.lora_B.weight",
            "lora_unet_transformer_blocks_1_attn_to_q.lora_down.weight",
            "lora_unet_transformer_blocks_10_attn_to_q.lora_down.weight", "img_in.lora_A.weight"]
    save_file({k: torch.full((2, 2), float(i)) for i, k in enumerate(keys)}, str(tmp_path / "l.safetensors"),
              metadata={"qie_schedule": "{}"})
    (tmp_path / "out").mkdir()
    out = first_blocks_file(tmp_path / "l.safetensors", 2, tmp_path / "out")
    kept = load_file(str(out))
    assert sorted(kept) == sorted([keys[0], keys[1], keys[4], keys[6]])
    assert float(kept[keys[4]][0, 0]) == 4.0
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"qie_schedule": "{}"}
    # a LoRA of later blocks only: its first two blocks become the two built, in order; a torch state dict too
    late = {"transformer_blocks.31.attn.to_q.lora_A.weight": torch.ones(2, 2),
            "lora_unet_transformer_blocks_30_attn_to_q.lora_down.weight": torch.zeros(2, 2),
            "transformer_blocks.45.attn.to_q.lora_A.weight": torch.ones(2, 2)}
    torch.save(late, tmp_path / "late.pt")
    kept = load_file(str(first_blocks_file(tmp_path / "late.pt", 2, tmp_path / "out")))
    assert sorted(kept) == ["lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight",
                            "transformer_blocks.1.attn.to_q.lora_A.weight"]
