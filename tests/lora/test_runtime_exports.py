"""Every export target x family: what the runtime loads of the file we write, refusals, bad input.

The serving runtimes (ComfyUI, SGLang, vLLM-Omni, musubi-tuner, Nunchaku) are not installable here without their
GPU kernels, so their key handling is EMULATED below from their documented rules (the functions ``*_loads``;
sources cited in docs/LORA_RUNTIMES.md), independently of the package's table, and our files are run through
them against the tiny models' real weight names. PEFT is installed: its adapter folder is loaded for real.
"""
from __future__ import annotations

import glob
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffsynth_qie.lora.export_targets import EDIT, EXPORT_TARGETS, QWEN21
from diffsynth_qie.lora.state import LoraModule, LoraState

RANK = 4
ALPHA = 2.5  # not an integer: SGLang would truncate it


def _weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(glob.glob(str(Path(model_dir) / "transformer" / "*.safetensors"))[0])


def _linears(model_dir) -> dict[str, tuple[int, int]]:
    return {k[: -len(".weight")]: tuple(v.shape) for k, v in _weights(model_dir).items() if v.ndim == 2}


@pytest.fixture(scope="module")
def models(tiny_model_dir, tiny21_dir):
    return {EDIT: _linears(tiny_model_dir), QWEN21: _linears(tiny21_dir)}


def full_lora(linears, seed=0) -> LoraState:
    """A rank-4 LoRA with alpha 2.5 on every linear of a tiny DiT."""
    g = torch.Generator().manual_seed(seed)
    return LoraState(modules={n: LoraModule(A=torch.randn(RANK, i, generator=g) * 0.1,
                                            B=torch.randn(o, RANK, generator=g) * 0.1, alpha=ALPHA)
                              for n, (o, i) in sorted(linears.items())})


def read(path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


# --- emulated loaders (each runtime's rule, as documented; not their code) -------------------------------
def _pairs(keys, prefixes, names=(("lora_A", "lora_B"), ("lora_down", "lora_up"))):
    """module -> set of its key suffixes, for keys under one of ``prefixes``; unmatched keys listed apart."""
    found, other = {}, []
    for k in keys:
        p = next((p for p in prefixes if k.startswith(p)), None)
        m = re.match(r"(.+)\.(" + "|".join(a for pair in names for a in pair) + r")\.weight$|(.+)\.alpha$",
                     k[len(p):] if p is not None else "")
        if p is None or not m:
            other.append(k)
        else:
            found.setdefault(m.group(1) or m.group(3), set()).add(k)
    return found, other


def comfyui_loads(keys, model: set[str], fused_gate_up: bool) -> set[str]:
    """comfy/lora.py model_lora_keys_unet (QwenImage branch): keys NOT loaded. Real weight keys map as
    diffusion_model.<k>, lora_unet_<k_>, <k>, transformer.<k>, lycoris_<k_>; on a fused 2.1 checkpoint the
    gate_layer/proj halves exist only as <k>, transformer.<k>, lycoris_<k_>."""
    mapped = set()
    for k in model:
        halves = fused_gate_up and re.search(r"img_mlp\.(gate_layer|proj)$", k)
        forms = [k, "transformer." + k, "lycoris_" + k.replace(".", "_")]
        mapped |= set(forms if halves else forms + ["diffusion_model." + k, "lora_unet_" + k.replace(".", "_")])
    return {k for k in keys if re.sub(r"\.(lora_[AB]|lora_down|lora_up)\.weight$|\.alpha$|\.set_weight$", "", k)
            not in mapped}


def sglang_loads(tensors, metadata, model: set[str], family: str) -> tuple[set[str], float]:
    """SGLang diffusion LoRA: strips diffusion_model. / base_model.model. (transformer. only where the model
    config maps it: Qwen-Image-2.1); per-module .alpha read as int(); metadata alpha must be an integer.
    Returns the modules taken and the worst relative scale error of the int() truncation."""
    prefixes = ("diffusion_model.", "base_model.model.", "") + (("transformer.",) if family == QWEN21 else ())
    found, _ = _pairs(tensors, sorted(prefixes, key=len, reverse=True))
    if "alpha" in metadata:
        assert float(metadata["alpha"]).is_integer(), "SGLang refuses a non-integer metadata alpha"
    err = 0.0
    for module, ks in found.items():
        alpha = next((tensors[k] for k in ks if k.endswith(".alpha")), None)
        if alpha is not None:
            err = max(err, abs(int(float(alpha)) - float(alpha)) / float(alpha))
    return {m for m in found if m in model}, err


_VLLM_EDIT = re.compile(r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|"
                        r"to_add_out)|(img|txt)_mlp\.net\.(0\.proj|2))")


def vllm_single_file_loads(keys, model: set[str], family: str) -> set[str]:
    """vLLM-Omni convert_single_file_lora: one of base_model.model. / diffusion_model. / transformer., lora_A/B or
    lora_down/up; any key else, or a module that is not a vLLM parallel linear, refuses the whole file."""
    found, other = _pairs(keys, ("base_model.model.", "diffusion_model.", "transformer."))
    assert not other, f"vLLM-Omni refuses the file: {other[:3]}"
    for m in found:
        assert m in model and (family == QWEN21 or _VLLM_EDIT.fullmatch(m)), f"vLLM-Omni refuses the file: {m}"
    return set(found)


def musubi_loads(keys, model: set[str]) -> set[str]:
    """musubi-tuner lora_qwen_image: a LoRA module per Linear inside QwenImageTransformerBlock, named
    lora_unet_<path with _>; other keys are not loaded."""
    names = {"lora_unet_" + m.replace(".", "_"): m for m in model if m.startswith("transformer_blocks.")}
    found, other = _pairs(keys, ("",))
    assert not other
    return {names[m] for m in found if m in names}


_NUNCHAKU = ("attn.to_qkv", "attn.to_out.0", "attn.add_qkv_proj", "attn.to_add_out", "img_mod.1", "img_mlp.net.0.proj",
             "img_mlp.net.2", "txt_mod.1", "txt_mlp.net.0.proj", "txt_mlp.net.2")


def nunchaku_loads(keys) -> set[str]:
    """nunchaku lora/qwenimage: looks up transformer.blocks.<n>.<module>.lora_A/B.weight for its 10 modules."""
    taken = {m.group(1) for k in keys for m in [re.match(r"transformer\.blocks\.\d+\.(.+)\.lora_[AB]\.weight$", k)]
             if m and m.group(1) in _NUNCHAKU}
    return taken


# what each runtime cannot load of a LoRA on every linear (module kinds); refused by the export
REFUSED = {
    ("comfyui", EDIT): set(), ("comfyui", QWEN21): set(), ("diffusers", EDIT): set(), ("diffusers", QWEN21): set(),
    ("sglang", EDIT): set(), ("sglang", QWEN21): set(), ("vllm-omni", QWEN21): set(),
    ("kohya", EDIT): {"img_in", "txt_in", "proj_out", "norm_out.linear", "time_text_embed.timestep_embedder.linear_1",
                      "time_text_embed.timestep_embedder.linear_2"},
    ("vllm-omni", EDIT): {"img_in", "txt_in", "proj_out", "norm_out.linear", "img_mod.1", "txt_mod.1",
                          "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2"},
    ("nunchaku", EDIT): {"img_in", "txt_in", "proj_out", "norm_out.linear", "time_text_embed.timestep_embedder.linear_1",
                         "time_text_embed.timestep_embedder.linear_2"},
}


def _kinds(names) -> set[str]:
    return {re.sub(r"^transformer_blocks\.\d+\.", "", n) for n in names}


@pytest.mark.parametrize("fmt, family", sorted(REFUSED))
def test_each_runtime_loads_every_module_written(models, tmp_path, fmt, family):
    from diffsynth_qie.lora.export_check import export_checked

    linears = models[family]
    kinds_2d = _kinds(linears)
    state = full_lora(linears)
    refused = REFUSED[(fmt, family)] & kinds_2d
    out = tmp_path / ("out" if fmt == "vllm-omni" and family == EDIT else "out.safetensors")
    if refused:
        with pytest.raises(ValueError, match=rf"--format {fmt}: .* would not load \d+ .*% of its delta.*drop_unsupported"):
            export_checked(state, out, fmt)
        assert not out.exists()
    report = export_checked(state, out, fmt, drop_unsupported=True)
    assert _kinds(report.dropped) == refused and report.max_rel_error < 1e-6
    assert (report.dropped_share > 0) == bool(refused)
    model = set(linears)
    if fmt == "vllm-omni" and family == EDIT:
        out = out / "adapter_model.safetensors"
    tensors, metadata = read(out)
    written = set(linears) - set(report.dropped)
    if fmt == "comfyui":
        assert comfyui_loads(tensors, model, fused_gate_up=False) == set()
        if family == QWEN21:  # ComfyUI's own 2.1 checkpoints fuse gate_layer and proj into gate_up
            fused = {re.sub(r"img_mlp\.gate_layer$", "img_mlp.gate_up", m) for m in model if not m.endswith("img_mlp.proj")}
            assert comfyui_loads(tensors, fused | {m for m in model if "img_mlp." in m}, fused_gate_up=True) == set()
    elif fmt == "sglang":
        taken, err = sglang_loads(tensors, metadata, model, family)
        assert taken == written and err == 0.0 and metadata["alpha"] == str(RANK)
    elif fmt == "vllm-omni":
        assert vllm_single_file_loads(tensors, model, family) == written
    elif fmt == "kohya":
        assert musubi_loads(tensors, model) == written
    elif fmt == "nunchaku":
        assert nunchaku_loads(tensors) == {k for k in _NUNCHAKU if k in _kinds(linears) or k.endswith("qkv") or
                                           k == "attn.add_qkv_proj"}


def test_comfyui_21_export_failed_before_on_fused_gate_up(models):
    """The layout of the old export (diffusion_model.<gate_layer/proj>) is what ComfyUI's fused model drops."""
    model = {re.sub(r"img_mlp\.gate_layer$", "img_mlp.gate_up", m) for m in models[QWEN21]}
    old = {f"diffusion_model.transformer_blocks.0.img_mlp.{h}.lora_A.weight" for h in ("gate_layer", "proj")}
    assert comfyui_loads(old, model | set(models[QWEN21]), fused_gate_up=True) == old


def test_sglang_would_truncate_the_alpha_of_a_comfyui_file(models, tmp_path):
    from diffsynth_qie.lora.export_check import export_checked

    state = full_lora(models[QWEN21])
    export_checked(state, tmp_path / "c.safetensors", "comfyui")
    tensors, metadata = read(tmp_path / "c.safetensors")
    _, err = sglang_loads(tensors, metadata, set(models[QWEN21]), QWEN21)
    assert err == pytest.approx(0.2)  # 2.5 -> 2: why the sglang target folds alpha


def test_the_vllm_peft_folder_loads_in_peft(tiny21_dir, models, tmp_path):
    """Real PEFT: LoraConfig.from_pretrained + inject_adapter_in_model + set_peft_model_state_dict on the 2.1 DiT."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    from diffsynth_qie.lora.export_check import export_checked
    from diffsynth_qie.models.load.loading import load_pipeline

    state = full_lora({n: s for n, s in models[QWEN21].items() if n.startswith("transformer_blocks.")})
    export_checked(state, tmp_path / "peft", "vllm-omni")
    dit = load_pipeline("tiny-2.1", model_dir=tiny21_dir, components=("dit",), device="cpu",
                        torch_dtype=torch.float32).dit
    config = LoraConfig.from_pretrained(str(tmp_path / "peft"))
    inject_adapter_in_model(config, dit)
    result = set_peft_model_state_dict(dit, load_file(str(tmp_path / "peft" / "adapter_model.safetensors")))
    assert not result.unexpected_keys
    modules = dict(dit.named_modules())
    for name, mod in state.modules.items():
        layer = modules[name]
        got = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
        torch.testing.assert_close(got, mod.delta(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["other_model", "no_such_family", "nonfinite_alpha", "unfusable"])
def test_bad_input_is_one_line_and_writes_nothing(models, tmp_path, case):
    from diffsynth_qie.lora.export_check import export_checked

    state, fmt, match = full_lora(models[EDIT]), "comfyui", ""
    if case == "other_model":
        state = LoraState(modules={"down_blocks.0.conv": state.modules["img_in"]})
        match = "no Qwen-Image DiT has.*down_blocks.0.conv"
    elif case == "no_such_family":
        state, fmt, match = full_lora(models[QWEN21]), "nunchaku", "Nunchaku has no qwen-image-2.1 model"
    elif case == "nonfinite_alpha":
        m = state.modules["img_in"]
        state.modules["img_in"] = LoraModule(A=m.A, B=m.B, alpha=math.inf)
        match = "alpha of img_in is inf"
    else:  # a q/k/v LoRA whose parts have different heights cannot be fused into Nunchaku's to_qkv
        m = state.modules["transformer_blocks.0.attn.to_k"]
        state.modules["transformer_blocks.0.attn.to_k"] = LoraModule(A=m.A, B=m.B[:-1], alpha=m.alpha)
        fmt, match = "nunchaku", "different output sizes.*to_qkv"
    with pytest.raises(ValueError, match=match) as e:
        export_checked(state, tmp_path / "x.safetensors", fmt, drop_unsupported=True)
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


def test_serving_targets_load_everywhere_and_are_the_readme_table(models):
    from diffsynth_qie.lora.export_targets import load_table_markdown, serving_targets
    from diffsynth_qie.models.family import FAMILIES

    assert {EDIT, QWEN21} <= set(FAMILIES)
    for family in (EDIT, QWEN21):
        targets = serving_targets(family)
        for t in EXPORT_TARGETS.values():
            rule = t.rule(family)
            if rule is not None:
                assert all(rule.accepts(m) for m in models[family] if any(m.endswith("." + s) or m == s for s in targets))
    assert "img_mod.1" not in serving_targets(EDIT) and "to_q" in serving_targets(EDIT)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert load_table_markdown() in readme, "README's 'where will my LoRA load' table: paste load_table_markdown()"


def test_train_config_serving_targets_and_export_names():
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.config import LoRAConfig, RunConfig, TrainConfig

    preset = get_preset("tiny")
    cfg = RunConfig(train=TrainConfig(cache_dir="c", output_dir="o"), lora=LoRAConfig(lora_targets="serving", export="comfyui,vllm-omni")).resolved(preset)
    from diffsynth_qie.lora.export_targets import serving_targets

    assert cfg.lora.lora_target_modules == serving_targets(preset.family)
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        RunConfig(train=TrainConfig(cache_dir="c", output_dir="o"), lora=LoRAConfig(export="comfyui,onnx")).resolved(preset)
    with pytest.raises(ValueError, match="--lora_targets serving and --lora_target_modules"):
        RunConfig(train=TrainConfig(cache_dir="c", output_dir="o"), lora=LoRAConfig(lora_targets="serving", lora_target_modules=["to_q"])).resolved(preset)


def test_inspect_lora_rows(models, tmp_path, capsys):
    from diffsynth_qie.cli import main
    from diffsynth_qie.lora.export import save_lora

    path = save_lora(tmp_path / "lora.safetensors", full_lora(models[EDIT]), {"preset": "tiny"})
    assert main(["inspect-lora", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    rows = {r["format"]: r for r in info["runtimes"]}
    assert info["families"] == [EDIT] and info["ranks"] == [RANK] and info["alphas"] == [ALPHA]
    assert rows["comfyui"]["status"] == "as-is"
    assert rows["diffusers"]["status"] == "export" and rows["sglang"]["status"] == "export"
    assert rows["vllm-omni"]["status"] == "cannot" and "img_mod.1" in rows["vllm-omni"]["why"]
    assert main(["inspect-lora", str(path)]) == 0
    assert "vLLM-Omni" in capsys.readouterr().out


def test_train_export_writes_checked_exports_beside_the_lora(models, tmp_path):
    """qie train --export: the same checked path, lora_<format> beside lora.safetensors, replaced on a rerun."""
    from diffsynth_qie.commands import train as train_cmd
    from diffsynth_qie.lora.export import export_beside, save_lora
    from diffsynth_qie.lora.export_targets import serving_targets

    import argparse

    parser = argparse.ArgumentParser()
    train_cmd.add_arguments(parser)
    args = parser.parse_args(["--cache_dir", "c", "--output_dir", "o", "--lora_targets", "serving",
                              "--export", "comfyui,vllm-omni"])
    lora = train_cmd.config_from_args(args).lora
    assert (lora.lora_targets, lora.export) == ("serving", "comfyui,vllm-omni")
    serving = {n: s for n, s in models[EDIT].items() if any(n.endswith("." + t) for t in serving_targets(EDIT))}
    path = save_lora(tmp_path / "lora.safetensors", full_lora(serving))
    for _ in range(2):
        written = export_beside(path, "comfyui,vllm-omni,nunchaku")
    assert [p.name for p in written] == ["lora_comfyui.safetensors", "lora_vllm-omni", "lora_nunchaku.safetensors"]
    assert (tmp_path / "lora_vllm-omni" / "adapter_config.json").is_file()


@pytest.mark.parametrize("family", [EDIT, QWEN21])
def test_no_another_model_warning_on_dotted_names(models, tmp_path, family, caplog):
    """A LoRA in dotted names (ours, diffusers, ComfyUI) is no 'other model's LoRA': its block modules are known."""
    from diffsynth_qie.lora.export import export_lora, save_lora

    src = save_lora(tmp_path / "src.safetensors", full_lora(models[family]))
    with caplog.at_level("WARNING"):
        export_lora(src, tmp_path / "c.safetensors", "comfyui")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
