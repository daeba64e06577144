"""Unmerged LoRAs (lora/branch.py, LoraManager's default mode) on the tiny DiT.

Parity: the unmerged DiT output equals the merged one within 1e-5 relative error in fp32
(the two differ only by where the rounding happens: ``(W + sBA) x`` vs ``Wx + sB(Ax)``).
Memory: switching a LoRA or its scale unmerged holds no weight backup, only the LoRA's
own tensors; the base weight tensors are never written (same storage, equal values).
"""
from __future__ import annotations

import copy

import pytest
import torch

from diffsynth_qie.models.qwen_image_edit.forward import dit_forward
from diffsynth_qie.lora.branch import lora_host_bytes, matches_target
from diffsynth_qie.lora import LoraManager, save_lora
from diffsynth_qie.models.presets import LORA_TARGETS_2511

RANK = 4
PARITY_RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def dit(tiny_pipe):
    """A fresh copy of the tiny DiT per test (the session pipe stays untouched)."""
    return copy.deepcopy(tiny_pipe.dit)


def targeted(model, targets=LORA_TARGETS_2511):
    return {n: m for n, m in model.named_modules()
            if matches_target(n, targets) and getattr(m, "weight", None) is not None and m.weight.ndim == 2}


def write_lora(path, model, seed, targets=LORA_TARGETS_2511, rank=RANK, alpha=None, full=None):
    """A random LoRA on every targeted linear (+ optional full weights); returns (path, tensors)."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, module in targeted(model, targets).items():
        out_dim, in_dim = module.weight.shape
        sd[f"{name}.lora_A.weight"] = torch.randn(rank, in_dim, generator=gen) * 0.1
        sd[f"{name}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * 0.1
        if alpha is not None:
            sd[f"{name}.alpha"] = torch.tensor(float(alpha))
    sd.update(full or {})
    return save_lora(path, sd), sd


def lora_nbytes(sd) -> int:
    return sum(v.nbytes for k, v in sd.items() if ".lora_" in k)


def forward(model):
    """DiT velocity for a batch of two samples with their own timesteps."""
    gen = torch.Generator().manual_seed(3)
    latents = [torch.randn(16, 8, 8, generator=gen) for _ in range(2)]
    edits = [[torch.randn(16, 8, 8, generator=gen)] for _ in range(2)]
    prompts = [torch.randn(n, 32, generator=gen) for n in (7, 9)]
    with torch.no_grad():
        return torch.stack(dit_forward(model, latents, torch.tensor([900.0, 250.0]), prompts, edits))


def weights(model):
    return {n: (p, p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}


def assert_untouched(model, before):
    for name, p in model.named_parameters():
        tensor, ptr, value = before[name]
        assert p is tensor and p.data_ptr() == ptr and torch.equal(p, value), name


def test_unmerged_matches_merged_and_never_writes_the_base(tmp_path, dit):
    merged_dit = copy.deepcopy(dit)
    path_a, sd_a = write_lora(tmp_path / "a.safetensors", dit, seed=1, alpha=8.0)
    path_b, sd_b = write_lora(tmp_path / "b.safetensors", dit, seed=2, targets=("to_q", "img_mod.1", "proj_out"))
    base_out, before = forward(dit), weights(dit)
    unmerged, merged = LoraManager(dit), LoraManager(merged_dit, merge=True)
    assert unmerged.merge is False

    for loras in ([(path_a, 1.0)], [(path_a, 0.5)], [(path_a, 0.5), (path_b, -1.5)], [(path_b, 2.0)]):
        unmerged.set_loras(loras)
        merged.set_loras(loras)
        out_u, out_m = forward(dit), forward(merged_dit)
        assert rel_err(out_u, base_out) > 1e-3  # the LoRA acts
        assert rel_err(out_u, out_m) < PARITY_RTOL, loras
        assert_untouched(dit, before)  # the base weights are never written
        assert unmerged.held_bytes()["backup"] == 0
        assert [(p.name, s) for p, s in unmerged.active] == [(p.name, s) for p, s in loras]

    # merged holds a backup of every touched weight; unmerged only the LoRA's tensors
    assert unmerged.held_bytes() == {"backup": 0, "adapters": lora_nbytes(sd_b)}
    for manager in (unmerged, merged):
        manager.set_loras([(path_a, 1.0), (path_b, 1.0)])
    assert rel_err(forward(dit), forward(merged_dit)) < PARITY_RTOL
    touched = targeted(dit)
    assert merged.held_bytes() == {"backup": sum(m.weight.nbytes for m in touched.values()), "adapters": 0}
    assert unmerged.held_bytes() == {"backup": 0, "adapters": lora_nbytes(sd_a) + lora_nbytes(sd_b)}

    unmerged.set_loras([])
    assert_untouched(dit, before)
    assert torch.equal(forward(dit), base_out)  # bit-exact base output
    assert unmerged.held_bytes() == {"backup": 0, "adapters": 0}
    assert not any(n.startswith("qie_lora") or ".qie_lora" in n for n, _ in dit.named_buffers())
    assert set(dit.state_dict()) == set(merged_dit.state_dict())


def test_scale_change_only_changes_the_factor(tmp_path, dit):
    path, sd = write_lora(tmp_path / "a.safetensors", dit, seed=4, alpha=2.0)
    ref = copy.deepcopy(dit)
    LoraManager(ref, merge=True).set_loras([(path, 0.25)])
    manager = LoraManager(dit)
    manager.set_loras([(path, 1.0)])
    buffers = {n: b.data_ptr() for n, b in dit.named_buffers() if "qie_lora" in n}
    assert len(buffers) == 2 * len(targeted(dit))
    out_1 = forward(dit)
    manager.set_loras([(path, 0.25)])
    assert {n: b.data_ptr() for n, b in dit.named_buffers() if "qie_lora" in n} == buffers  # nothing re-copied
    assert manager.held_bytes() == {"backup": 0, "adapters": lora_nbytes(sd)}
    assert manager.active[0][1] == 0.25
    out_q = forward(dit)
    assert rel_err(out_q, out_1) > 1e-4
    assert rel_err(out_q, forward(ref)) < PARITY_RTOL


def test_full_weight_entries_are_merged_with_a_backup_of_only_themselves(tmp_path, dit):
    full = {"proj_out.bias": torch.randn(dit.proj_out.bias.shape[0]), "img_in.weight": torch.randn_like(dit.img_in.weight)}
    path, sd = write_lora(tmp_path / "f.safetensors", dit, seed=5, targets=("to_q",), full=full)
    before = weights(dit)
    manager = LoraManager(dit)
    (report,) = manager.set_loras([(path, 1.0)])
    assert report.full_weights == ["img_in.weight", "proj_out.bias"]
    assert torch.equal(dit.proj_out.bias, full["proj_out.bias"]) and torch.equal(dit.img_in.weight, full["img_in.weight"])
    assert manager.held_bytes() == {"backup": sum(v.nbytes for v in full.values()), "adapters": lora_nbytes(sd)}
    manager.set_loras([(path, 0.5)])  # full weights interpolate: restored, then merged again
    torch.testing.assert_close(dit.proj_out.bias, (before["proj_out.bias"][2] + full["proj_out.bias"]) / 2)
    manager.set_loras([])
    assert_untouched(dit, before)


def test_failed_switch_leaves_the_active_loras(tmp_path, dit):
    path, _ = write_lora(tmp_path / "a.safetensors", dit, seed=6)
    bad = save_lora(tmp_path / "bad.safetensors", {"transformer_blocks.9.attn.to_q.lora_A.weight": torch.zeros(2, 64),
                                                   "transformer_blocks.9.attn.to_q.lora_B.weight": torch.zeros(64, 2)})
    manager = LoraManager(dit)
    manager.set_loras([(path, 1.0)])
    out = forward(dit)
    with pytest.raises(ValueError, match="transformer_blocks.9.attn.to_q"):
        manager.set_loras([(path, 1.0), (bad, 1.0)])
    assert torch.equal(forward(dit), out) and [p.name for p, _ in manager.active] == ["a.safetensors"]


def test_lora_host_bytes_matches_what_the_manager_holds(tmp_path, dit):
    path, sd = write_lora(tmp_path / "a.safetensors", dit, seed=7)
    for merge in (False, True):
        model = copy.deepcopy(dit)
        manager = LoraManager(model, merge=merge)
        manager.set_loras([(path, 1.0)])
        held = manager.held_bytes()
        cached = lora_nbytes(sd)  # the file as read, kept by the manager's cache in both modes
        mode = "merged" if merge else "unmerged"
        predicted = lora_host_bytes(model, RANK, LORA_TARGETS_2511, mode)
        if merge:
            assert predicted == held["backup"] + cached
        else:
            assert predicted == held["adapters"] == cached
    with pytest.raises(ValueError, match="mode 'fused'"):
        lora_host_bytes(dit, RANK, LORA_TARGETS_2511, "fused")


def test_lora_host_bytes_on_the_real_dit_meta():
    """The 20 B DiT on the meta device: a rank-32 LoRA on the 2511 targets, bf16."""
    from diffsynth.models.qwen_image_dit import QwenImageDiT

    with torch.device("meta"):
        real = QwenImageDiT()
    real.to(torch.bfloat16)
    unmerged = lora_host_bytes(real, 32, LORA_TARGETS_2511, "unmerged")
    merged = lora_host_bytes(real, 32, LORA_TARGETS_2511, "merged")
    linears = targeted(real)
    assert len(linears) == 60 * 12 + 3
    backup = sum(m.weight.numel() * 2 for m in linears.values())
    assert merged - unmerged == backup
    assert unmerged == sum(32 * sum(m.weight.shape) * 2 for m in linears.values())
    assert backup > 50 * unmerged  # the merged mode's backup dwarfs the LoRA itself
    assert backup > 0.6 * sum(p.numel() * 2 for p in real.parameters())  # most of a second DiT


# --- the UI and qie edit ------------------------------------------------------------------
@pytest.mark.parametrize("lora_merge", [False, True])
def test_ui_applies_loras_unmerged_by_default(tiny_model_dir, tiny_pipe, tmp_path, lora_merge):
    import numpy as np
    from PIL import Image

    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.handlers import NO_LORA, GenerateInputs, UIHandlers

    path, sd = write_lora(tmp_path / "loras" / "a.safetensors", tiny_pipe.dit, seed=8)
    kwargs = {} if not lora_merge else {"lora_merge": True}
    ui = UIHandlers(UIConfig(model="tiny", model_dir=str(tiny_model_dir), lora_dir=str(path.parent), device="cpu",
                             outputs_dir=str(tmp_path / "ui-edits"), **kwargs))
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8))

    def run(lora, scale=1.0):
        inputs = GenerateInputs(editor={"background": photo, "layers": []}, prompt="make it blue", steps=2,
                                cfg=1.0, seed=3, lora=lora, lora_scale=scale)
        return ui.generate(inputs).result.latents

    base = run(NO_LORA)
    before = weights(ui.editor().pipe.dit)
    with_lora, half = run("a.safetensors"), run("a.safetensors", 0.5)
    assert rel_err(with_lora, base) > 1e-3 and rel_err(half, with_lora) > 1e-4
    held = ui.editor()._loras.held_bytes()
    if lora_merge:
        touched = targeted(tiny_pipe.dit)
        assert held == {"backup": sum(m.weight.nbytes for m in touched.values()), "adapters": 0}
    else:
        assert held == {"backup": 0, "adapters": lora_nbytes(sd)}
        assert_untouched(ui.editor().pipe.dit, before)  # switching and rescaling wrote no weight
    assert torch.equal(run(NO_LORA), base)
    assert_untouched(ui.editor().pipe.dit, before)


def test_qie_edit_lora_merge_flag(tiny_model_dir, tiny_pipe, tmp_path, monkeypatch):
    import argparse

    import numpy as np
    from PIL import Image

    from diffsynth_qie.commands import edit as cmd
    from diffsynth_qie.inference.editor import Editor

    path, _ = write_lora(tmp_path / "a.safetensors", tiny_pipe.dit, seed=9)
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "in.png")
    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    common = ["--model", "tiny", "--model_dir", str(tiny_model_dir), "--image", str(tmp_path / "in.png"),
              "--prompt", "blue", "--steps", "2", "--cfg", "1", "--lora", str(path), "--device", "cpu"]
    seen, real_set_loras = [], Editor.set_loras

    def spy(self, loras):
        out = real_set_loras(self, loras)
        seen.append((self._loras.merge, self._loras.held_bytes()))
        return out

    monkeypatch.setattr(Editor, "set_loras", spy)
    assert parser.parse_args(common + ["--out", "x.png"]).lora_merge is False
    for extra, name in (([], "u.png"), (["--lora_merge"], "m.png")):
        assert cmd.run(parser.parse_args(common + extra + ["--out", str(tmp_path / name)])) == 0
    (merge_u, held_u), (merge_m, held_m) = seen
    assert (merge_u, merge_m) == (False, True)
    assert held_u["backup"] == 0 < held_u["adapters"] and held_m["adapters"] == 0 < held_m["backup"]
    diff = np.abs(np.asarray(Image.open(tmp_path / "u.png"), int) - np.asarray(Image.open(tmp_path / "m.png"), int))
    assert diff.max() <= 1  # same edit either way (8-bit rounding at most)


def test_merging_into_bf16_weights_is_refused_with_the_reason(tmp_path, dit):
    """A merge into bf16 weights rounds away most of a small delta; measure it, refuse it."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3072, 3072, generator=g) * 0.02).bfloat16()
    delta = torch.randn(3072, 32, generator=g) @ torch.randn(32, 3072, generator=g)
    delta *= 0.003 * w.float().norm() / delta.norm()
    merged = (w.float() + delta).bfloat16()  # even added in fp32, the merged weight is rounded to bf16
    assert float(((merged.float() - w.float()) - delta).norm() / delta.norm()) > 0.3

    import copy

    path, _ = write_lora(tmp_path / "l.safetensors", dit, seed=1)
    model = copy.deepcopy(dit).to(torch.bfloat16)  # the shared tiny DiT stays as it is
    with pytest.raises(ValueError, match="bfloat16 weights would round away.*drop --lora_merge"):
        LoraManager(model, merge=True).set_loras([(path, 1.0)])
    LoraManager(model, merge=False).set_loras([(path, 1.0)])  # the branch is fine
    model.float()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    manager = LoraManager(model, merge=True)
    manager.set_loras([(path, 1.0)])  # fp32 weights merge as before
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
