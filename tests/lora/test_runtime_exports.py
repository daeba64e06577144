"""Every export target x family: what the runtime loads of the file we write, refusals, bad input.

The serving runtimes (ComfyUI, SGLang, vLLM-Omni, musubi-tuner, Nunchaku) are not installable here without their
GPU kernels, so their loaders' key handling is transcribed in ``runtime_loaders.py`` (their own module names and
key rules, sources cited there and in docs/LORA_RUNTIMES.md), independently of the package's table; our files
are loaded through them against the tiny models' weights and the deltas compared with ours.
"""
from __future__ import annotations

import glob
import json
import math
import re
from pathlib import Path

import pytest
import torch
from runtime_loaders import (Refused, comfyui_load, comfyui_weights, musubi_load, rel_error, sglang_load, stacked,
                             vllm_omni_layers, vllm_omni_load_file, vllm_omni_load_folder)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

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


def full_lora(linears, seed=0, ranks=(RANK,)) -> LoraState:
    """A LoRA with alpha 2.5 on every linear of a tiny DiT, ranks cycling through ``ranks``."""
    g = torch.Generator().manual_seed(seed)
    return LoraState(modules={n: LoraModule(A=torch.randn(r, i, generator=g) * 0.1,
                                            B=torch.randn(o, r, generator=g) * 0.1, alpha=ALPHA)
                              for k, (n, (o, i)) in enumerate(sorted(linears.items())) for r in [ranks[k % len(ranks)]]})


def read(path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def ours(state: LoraState) -> dict[str, torch.Tensor]:
    return {n: m.delta().double() for n, m in state.modules.items()}


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Max relative error over ``want``'s weights; a weight the runtime does not touch counts as inf."""
    assert want
    return max(rel_error(got[k], w) if k in got else math.inf for k, w in want.items())


def comfyui_expected(deltas: dict[str, torch.Tensor], fused: bool) -> dict[str, torch.Tensor]:
    """Our deltas in ComfyUI's weights (a fused 2.1 model: gate_up = [gate_layer; proj])."""
    out = {k: v for k, v in deltas.items() if not (fused and re.search(r"img_mlp\.(gate_layer|proj)$", k))}
    for k in [k for k in deltas if fused and k.endswith("img_mlp.gate_layer")]:
        out[k.replace("gate_layer", "gate_up")] = torch.cat([deltas[k], deltas[k.replace("gate_layer", "proj")]])
    return out


def comfyui_worst(tensors, linears, deltas, family) -> float:
    """ComfyUI on the unfused model, and on the fused one for 2.1: the worst error, inf where a key is not loaded."""
    errors = []
    for fused in ([False, True] if family == QWEN21 else [False]):
        half = next((s[0] for n, s in linears.items() if n.endswith("gate_layer")), 0)
        got, not_loaded = comfyui_load(tensors, comfyui_weights(set(linears), fused), half)
        errors.append(math.inf if not_loaded else worst(got, comfyui_expected(deltas, fused)))
    return max(errors)


def vllm_expected(deltas: dict[str, torch.Tensor], layers: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    return {layer: d for layer, subs in layers.items() for d in [stacked(deltas, subs)] if d is not None}


def _nunchaku_loads(keys) -> set[str]:
    """nunchaku lora/qwenimage: looks up transformer.blocks.<n>.<module>.lora_A/B.weight for its 10 modules."""
    return {m.group(1) for k in keys for m in [re.match(r"transformer\.blocks\.\d+\.(.+)\.lora_[AB]\.weight$", k)]
            if m and m.group(1) in _NUNCHAKU}


_NUNCHAKU = ("attn.to_qkv", "attn.to_out.0", "attn.add_qkv_proj", "attn.to_add_out", "img_mod.1", "img_mlp.net.0.proj",
             "img_mlp.net.2", "txt_mod.1", "txt_mlp.net.0.proj", "txt_mlp.net.2")

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
    """A LoRA on every linear: what the runtime cannot load is refused (and dropped on request); the rest loads
    in the runtime's own module names with exactly our delta. vLLM-Omni: the PEFT folder and the single file, on
    its released and newest models."""
    from diffsynth_qie.lora.export_check import export_checked

    linears = models[family]
    state = full_lora(linears)
    refused = REFUSED[(fmt, family)] & _kinds(linears)
    out = tmp_path / ("out" if fmt == "vllm-omni" else "out.safetensors")
    if refused:
        with pytest.raises(ValueError, match=rf"--format {fmt}: .* would not load \d+ .*% of its delta.*drop_unsupported"):
            export_checked(state, out, fmt)
        assert not out.exists()
    report = export_checked(state, out, fmt, drop_unsupported=True)
    assert _kinds(report.dropped) == refused and report.max_rel_error < 1e-6
    assert (report.dropped_share > 0) == bool(refused)
    written = set(linears) - set(report.dropped)
    deltas = {n: d for n, d in ours(state).items() if n in written}
    if fmt == "vllm-omni":
        single = export_checked(state, tmp_path / "one.safetensors", fmt, drop_unsupported=True).path
        for newest in (False, True):
            layers = vllm_omni_layers(set(linears), family == QWEN21, newest)
            want = vllm_expected(deltas, layers)
            assert worst(vllm_omni_load_folder(out, layers), want) < 1e-6
            assert worst(vllm_omni_load_file(read(single)[0], layers), want) < 1e-6
        return
    tensors, metadata = read(out)
    if fmt == "comfyui":
        assert comfyui_worst(tensors, linears, deltas, family) < 1e-6
    elif fmt == "sglang":
        assert worst(sglang_load(tensors, metadata, set(linears), family == QWEN21), deltas) < 1e-6
        assert metadata["alpha"] == str(RANK)
    elif fmt == "kohya":
        assert worst(musubi_load(tensors, set(linears)), deltas) < 1e-6
    elif fmt == "nunchaku":
        assert _nunchaku_loads(tensors) == {k for k in _NUNCHAKU if k in _kinds(linears) or k.endswith("qkv") or
                                            k == "attn.add_qkv_proj"}


@pytest.mark.parametrize("family", [EDIT, QWEN21])
def test_the_vllm_omni_folder_is_in_vllm_omni_s_module_names(models, tmp_path, family):
    """vLLM-Omni refuses a PEFT folder whose module names do not end in one of its layers: the folder names
    ``attn.to_out`` (its layer), never ``attn.to_out.0``, and ``qie train --export vllm-omni`` writes the same."""
    from diffsynth_qie.lora.export import export_beside, save_lora
    from diffsynth_qie.lora.export_targets import serving_targets

    targets = serving_targets(family)
    state = full_lora({n: s for n, s in models[family].items() if any(n.endswith("." + t) for t in targets)})
    folder = export_beside(save_lora(tmp_path / "lora.safetensors", state), "vllm-omni")[0]
    keys = list(load_file(str(folder / "adapter_model.safetensors")))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert not [k for k in keys + config["target_modules"] if ".to_out.0" in k]
    layers = vllm_omni_layers(set(models[family]), family == QWEN21)
    assert worst(vllm_omni_load_folder(folder, layers), vllm_expected(ours(state), layers)) < 1e-6
    old = tmp_path / "old"  # the layout written before: DiffSynth's attn.to_out.0
    old.mkdir()
    (old / "adapter_config.json").write_text(json.dumps(
        {**config, "target_modules": [t.replace(".attn.to_out", ".attn.to_out.0") for t in config["target_modules"]]}))
    save_file({k.replace(".attn.to_out.", ".attn.to_out.0."): v
               for k, v in load_file(str(folder / "adapter_model.safetensors")).items()},
              str(old / "adapter_model.safetensors"))
    with pytest.raises(Refused, match="expected target modules"):
        vllm_omni_load_folder(old, layers)


@pytest.mark.parametrize("family", [EDIT, QWEN21])
def test_a_mixed_rank_lora_loads_in_vllm_omni_s_newest_loader(models, tmp_path, family):
    """vLLM-Omni takes one rank (its newest loader refuses others): the export pads every module to the largest
    rank with zeros, in the folder and the single file, and the deltas stay exact."""
    from diffsynth_qie.lora.export_check import export_checked

    linears = {n: s for n, s in models[family].items() if EXPORT_TARGETS["vllm-omni"].rule(family).accepts(n)}
    state = full_lora(linears, ranks=(4, 2, 3))
    export_checked(state, tmp_path / "folder", "vllm-omni")
    export_checked(state, tmp_path / "one.safetensors", "vllm-omni")
    config = json.loads((tmp_path / "folder" / "adapter_config.json").read_text())
    assert config["r"] == 4 and not config["rank_pattern"] and not config["alpha_pattern"]
    layers = vllm_omni_layers(set(models[family]), family == QWEN21, newest=True)
    want = vllm_expected(ours(state), layers)
    assert worst(vllm_omni_load_folder(tmp_path / "folder", layers), want) < 1e-6
    assert worst(vllm_omni_load_file(read(tmp_path / "one.safetensors")[0], layers), want) < 1e-6


def test_sglang_would_truncate_the_alpha_of_a_comfyui_file(models, tmp_path):
    from diffsynth_qie.lora.export_check import export_checked

    linears = models[QWEN21]
    state = full_lora(linears)
    export_checked(state, tmp_path / "c.safetensors", "comfyui")
    got = sglang_load(*read(tmp_path / "c.safetensors"), set(linears), qwen21=True)
    assert worst(got, ours(state)) == pytest.approx(0.2)  # 2.5 -> 2: why the sglang target folds alpha


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
    assert rows["comfyui"]["status"] == "as-is" and rows["diffusers"]["status"] == "as-is"  # .alpha: converted
    assert rows["sglang"]["status"] == "export" and "0.5 × B·A instead of 0.625" in rows["sglang"]["why"]  # int(2.5)
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
