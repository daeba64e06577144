"""``qie inspect-lora``'s verdicts agree with the runtimes' own loaders, for files every tool writes.

For each file (ours, with and without alpha; diffusers-saved, alpha only in ``lora_adapter_metadata``; musubi's;
a ComfyUI-made 2.1 LoRA on the fused ``img_mlp.gate_up``; each of our exports) and each runtime whose loader is
transcribed in ``runtime_loaders.py`` (ComfyUI on its unfused and fused 2.1 models, SGLang, vLLM-Omni's single
file, musubi-tuner): the verdict is "loads as-is" exactly when that loader applies every module at the delta the
file means, and a file sent through ``qie export-lora --format X`` then loads exactly. diffusers, run for real, is
held to the same rule in ``test_diffusers_roundtrip.py``.
"""
from __future__ import annotations

import json

import pytest
import torch
from runtime_loaders import (Refused, comfyui_load, comfyui_weights, musubi_load, sglang_load, vllm_omni_layers,
                             vllm_omni_load_file)
from test_runtime_exports import (comfyui_expected, full_lora, models, ours, read, vllm_expected,  # noqa: F401
                                  worst)

from diffsynth_qie.lora.export_targets import EDIT, QWEN21, serving_targets
from diffsynth_qie.lora.state import LoraModule, LoraState

RUNTIMES = ("comfyui", "sglang", "vllm-omni", "kohya")


def loads_exactly(fmt: str, tensors: dict, metadata: dict, linears: dict, family: str, want: dict) -> bool:
    """Whether runtime ``fmt``'s transcribed loader applies exactly ``want`` (our reader's deltas of the file)."""
    names = set(linears)
    try:
        if fmt == "comfyui":
            half = next((s[0] for n, s in linears.items() if n.endswith("gate_layer")), 0)
            for fused in ([False, True] if family == QWEN21 else [False]):
                got, not_loaded = comfyui_load(tensors, comfyui_weights(names, fused), half)
                if not_loaded or worst(got, comfyui_expected(want, fused)) > 1e-5:
                    return False
            return True
        if fmt == "sglang":
            return worst(sglang_load(tensors, metadata, names, family == QWEN21), want) < 1e-5
        if fmt == "vllm-omni":
            layers = vllm_omni_layers(names, family == QWEN21)
            return worst(vllm_omni_load_file(tensors, layers), vllm_expected(want, layers)) < 1e-5
        return worst(musubi_load(tensors, names), want) < 1e-5
    except Refused:
        return False


def _write(path, tensors: dict, metadata: dict | None = None):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def made_files(linears: dict, family: str, tmp_path) -> dict:
    """The files of each tool for a LoRA on the family's serving targets (alpha 2.5 where a file has one)."""
    from diffsynth_qie.lora.export import export_lora, save_lora

    targets = serving_targets(family)
    served = {n: s for n, s in linears.items() if any(n.endswith("." + t) for t in targets)}
    state = full_lora(served)
    plain = LoraState(modules={n: LoraModule(A=m.A, B=m.B) for n, m in full_lora(served, seed=1).modules.items()})
    files = {"ours": save_lora(tmp_path / "ours.safetensors", state),
             "ours, alpha = rank": save_lora(tmp_path / "plain.safetensors", plain)}
    for lora_alpha in (2, 4):  # diffusers' save_lora_weights: alpha only in lora_adapter_metadata
        meta = {"transformer.r": 4, "transformer.lora_alpha": lora_alpha, "transformer.target_modules": sorted(served)}
        files[f"diffusers, lora_alpha {lora_alpha}"] = _write(
            tmp_path / f"diffusers{lora_alpha}.safetensors",
            {f"transformer.{n}.lora_{ab}.weight": t for n, m in state.modules.items() for ab, t in (("A", m.A), ("B", m.B))},
            {"lora_adapter_metadata": json.dumps(meta), "format": "pt"})
    files["musubi"] = export_lora(files["ours"], tmp_path / "musubi.safetensors", "kohya")
    if family == QWEN21:
        no_gate = {k: v for k, v in read(files["musubi"])[0].items() if "gate_layer" not in k}
        files["musubi, no gate_layer"] = _write(tmp_path / "musubi2.safetensors", no_gate)
        fused = {}  # ComfyUI trained on its fused 2.1 model: one pair on img_mlp.gate_up
        for n, m in state.modules.items():
            if n.endswith("img_mlp.proj"):
                continue
            b = torch.cat([m.B, state.modules[n.replace("gate_layer", "proj")].B * 0.5]) if "gate_layer" in n else m.B
            key = "diffusion_model." + n.replace("gate_layer", "gate_up")
            # alpha = rank: the fused module is the file's only obstacle
            fused.update({f"{key}.lora_A.weight": m.A, f"{key}.lora_B.weight": b, f"{key}.alpha": torch.tensor(4.0)})
        files["ComfyUI, fused gate_up"] = _write(tmp_path / "comfy_fused.safetensors", fused)
    for fmt in ("comfyui", "diffusers", "sglang", "vllm-omni"):  # (vllm-omni: the single file)
        files[f"--format {fmt}"] = export_lora(files["ours"], tmp_path / f"{fmt}.safetensors", fmt)
    return files


@pytest.mark.parametrize("family", [EDIT, QWEN21])
def test_as_is_exactly_when_the_runtime_loads_the_file_as_meant(models, tmp_path, family):
    from diffsynth_qie.lora.export import export_lora
    from diffsynth_qie.lora.formats import load_lora_state
    from diffsynth_qie.lora.inspect import describe
    from diffsynth_qie.lora.resolve import resolved

    linears = models[family]
    wrong = []
    for label, path in made_files(linears, family, tmp_path).items():
        want = ours(resolved(load_lora_state(path)))
        tensors, metadata = read(path)
        rows = {r["format"]: r for r in describe(path)["runtimes"]}
        for fmt in RUNTIMES:
            loads = loads_exactly(fmt, tensors, metadata, linears, family, want)
            if loads != (rows[fmt]["status"] == "as-is"):
                wrong.append(f"{label} in {fmt}: {rows[fmt]['status']} ({rows[fmt]['why']}), loads exactly: {loads}")
            if rows[fmt]["status"] == "export":
                out = export_lora(path, tmp_path / f"x-{fmt}.safetensors", fmt)
                if not loads_exactly(fmt, *read(out), linears, family, want):
                    wrong.append(f"{label} in {fmt}: the export does not load exactly")
                out.unlink()
            if "does not read" in rows[fmt]["why"] and "metadata" not in rows[fmt]["why"]:  # a reason from keys
                wrong.append(f"{label} in {fmt}: {rows[fmt]['why']}")
    assert not wrong, "\n".join(wrong)


def test_the_verdicts_name_what_each_runtime_does(models, tmp_path):
    """The findings, one verdict each: ComfyUI ignores an alpha kept only in metadata; SGLang drops a fused
    gate_up and vLLM-Omni refuses it; ComfyUI loads our 2.1 ComfyUI export and ComfyUI's own file as-is on the
    model each fits."""
    from diffsynth_qie.lora.inspect import describe

    files = made_files(models[QWEN21], QWEN21, tmp_path)
    rows = {label: {r["format"]: r for r in describe(path)["runtimes"]} for label, path in files.items()}
    meta = rows["diffusers, lora_alpha 2"]["comfyui"]
    assert meta["status"] == "export" and "only in the file's metadata" in meta["why"]
    assert rows["diffusers, lora_alpha 4"]["comfyui"]["status"] == "as-is"  # alpha = r: scale 1 either way
    fused = rows["ComfyUI, fused gate_up"]
    assert fused["sglang"]["status"] == "export" and "not loaded" in fused["sglang"]["why"]
    assert fused["vllm-omni"]["status"] == "export" and "refuses the whole file" in fused["vllm-omni"]["why"]
    assert fused["comfyui"]["status"] == "export" and "unfused 2.1 model" in fused["comfyui"]["why"]
    assert rows["--format comfyui"]["comfyui"]["status"] == "as-is"
