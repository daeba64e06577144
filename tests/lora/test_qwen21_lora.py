"""Qwen-Image-2.1 LoRAs in every key layout we read and write, and merging / extracting on the 2.1 DiT's files.

The 2.1 DiT's linear module paths are the same in DiffSynth (``diffsynth/models/qwen_image_21_dit.py``),
diffusers (``src/diffusers/models/transformers/transformer_qwenimage21.py``: ``attn.to_q/to_k/to_v/to_out.0``,
``img_mlp.proj/gate_layer/out``) and ComfyUI (``comfy/ldm/qwen_image21/model.py``), except that ComfyUI may fuse
``gate_layer`` and ``proj`` into ``img_mlp.gate_up`` ([gate; up] by rows). diffusers names a LoRA's keys
``transformer.<path>.lora_A/B.weight`` (``QwenImageLoraLoaderMixin``, which its ``QwenImage21Pipeline`` uses);
ComfyUI's loader (``comfy/lora.py: model_lora_keys_unet``) accepts ``diffusion_model.<path>``, ``<path>``,
``transformer.<path>`` and kohya's ``lora_unet_<path with underscores>``.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffsynth_qie.lora.state import LoraModule, LoraState

RANK = 4


@pytest.fixture(scope="module")
def lora21(tiny21_dir, tmp_path_factory) -> tuple[Path, LoraState]:
    """A rank-4 LoRA on every default 2.1 target of both blocks, in our format."""
    from diffsynth_qie.lora.export import save_lora
    from diffsynth_qie.models.family import QWEN21

    weights = load_file(str(Path(tiny21_dir) / "transformer/diffusion_pytorch_model.safetensors"))
    g = torch.Generator().manual_seed(0)
    modules = {}
    for key, w in sorted(weights.items()):
        name = key[: -len(".weight")]
        if w.ndim == 2 and any(name.endswith("." + t) for t in QWEN21.lora_targets):
            modules[name] = LoraModule(A=torch.randn(RANK, w.shape[1], generator=g) * 0.1,
                                       B=torch.randn(w.shape[0], RANK, generator=g) * 0.1, alpha=2.0)
    assert len(modules) == 2 * len(QWEN21.lora_targets)
    state = LoraState(modules=modules)
    return save_lora(tmp_path_factory.mktemp("lora21") / "lora.safetensors", state, {"preset": "tiny-2.1"}), state


def _deltas_equal(state: LoraState, ref: LoraState) -> bool:
    return state.modules.keys() == ref.modules.keys() and all(
        torch.allclose(state.modules[n].delta(), m.delta(), atol=1e-6) for n, m in ref.modules.items())


@pytest.mark.parametrize("fmt, first_key", [
    ("diffusers", "transformer.transformer_blocks.0.attn.to_k.lora_A.weight"),
    ("comfyui", "diffusion_model.transformer_blocks.0.attn.to_k.lora_A.weight"),
])
def test_exports_use_the_21_module_paths_and_read_back_the_same_deltas(lora21, tmp_path, fmt, first_key):
    from diffsynth_qie.lora.export import export_lora
    from diffsynth_qie.lora.formats import load_lora_state

    path, ref = lora21
    out = export_lora(path, tmp_path / f"{fmt}.safetensors", fmt)
    with safe_open(str(out), "pt") as f:
        keys = sorted(f.keys())
    assert first_key in keys and any(".img_mlp.gate_layer." in k for k in keys)
    assert _deltas_equal(load_lora_state(out), ref)


@pytest.mark.parametrize("prefix", ["lora_unet_", "lycoris_"])
def test_kohya_keys_of_21_modules_resolve_and_export(lora21, tmp_path, prefix):
    from diffsynth_qie.lora.export import export_lora
    from diffsynth_qie.lora.formats import load_lora_state

    _, ref = lora21
    tensors = {}
    for name, m in ref.modules.items():
        key = prefix + name.replace(".", "_")  # transformer_blocks_0_img_mlp_gate_layer, ...
        tensors.update({f"{key}.lora_down.weight": m.A, f"{key}.lora_up.weight": m.B, f"{key}.alpha": torch.tensor(2.0)})
    save_file(tensors, str(tmp_path / "kohya.safetensors"))
    out = export_lora(tmp_path / "kohya.safetensors", tmp_path / "d.safetensors", "diffusers")
    assert _deltas_equal(load_lora_state(out), ref)


def test_a_comfyui_fused_gate_up_lora_splits_into_gate_layer_and_proj(tiny21_dir, tmp_path):
    from diffsynth_qie.lora.apply import match_lora
    from diffsynth_qie.lora.formats import load_lora_state
    from diffsynth_qie.models.load.loading import load_pipeline

    dit = load_pipeline("tiny-2.1", model_dir=tiny21_dir, components=("dit",), device="cpu",
                        torch_dtype=torch.float32).dit
    hidden, width = dit.transformer_blocks[0].img_mlp.proj.weight.shape
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(RANK, width, generator=g), torch.randn(2 * hidden, RANK, generator=g)
    save_file({"diffusion_model.transformer_blocks.0.img_mlp.gate_up.lora_A.weight": a,
               "diffusion_model.transformer_blocks.0.img_mlp.gate_up.lora_B.weight": b}, str(tmp_path / "f.safetensors"))
    state = match_lora(dit, load_lora_state(tmp_path / "f.safetensors"))
    fused = b @ a  # ComfyUI's delta of the fused [gate; up] weight
    assert set(state.modules) == {"transformer_blocks.0.img_mlp.gate_layer", "transformer_blocks.0.img_mlp.proj"}
    assert torch.allclose(state.modules["transformer_blocks.0.img_mlp.gate_layer"].delta(), fused[:hidden], atol=1e-5)
    assert torch.allclose(state.modules["transformer_blocks.0.img_mlp.proj"].delta(), fused[hidden:], atol=1e-5)


def test_merge_then_extract_on_the_21_model_files(lora21, tiny21_dir, tmp_path):
    from diffsynth_qie.cli import main
    from diffsynth_qie.lora.formats import load_lora_state

    path, ref = lora21
    merged = tmp_path / "merged"
    assert main(["merge-lora", str(tiny21_dir), "--lora", str(path), "--dtype", "fp32", "--out", str(merged)]) == 0
    base = load_file(str(Path(tiny21_dir) / "transformer/diffusion_pytorch_model.safetensors"))
    after = load_file(str(merged / "transformer/diffusion_pytorch_model.safetensors"))
    for name, m in ref.modules.items():
        assert torch.allclose(after[name + ".weight"] - base[name + ".weight"], m.delta(), atol=1e-6), name
    assert (merged / "processor").exists() and (merged / "text_encoder").exists()  # linked from the base
    out = tmp_path / "extracted.safetensors"
    assert main(["extract-lora", "--base", str(tiny21_dir), "--tuned", str(merged), "--out", str(out),
                 "--rank", str(RANK)]) == 0
    got = load_lora_state(out)
    assert got.modules.keys() == ref.modules.keys()
    for name, m in ref.modules.items():
        assert (got.modules[name].delta() - m.delta()).norm() <= 1e-4 * m.delta().norm(), name
