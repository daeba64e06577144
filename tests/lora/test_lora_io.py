"""LoRA I/O (lora/__init__.py) on the real tiny DiT: every format in, two formats out.

Deltas are compared with an independent ``alpha / rank * B @ A`` and, for our canonical
format, with DiffSynth's own ``pipe.load_lora``. The ComfyUI export is checked with a
small re-implementation of ComfyUI's key map / loader rules (comfy/lora.py
``model_lora_keys_unet`` + ``load_lora``, comfy/weight_adapter/lora.py), the diffusers
export with the rules of ``_convert_non_diffusers_qwen_lora_to_diffusers``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diffsynth_qie.lora import (
    LoraManager,
    apply_lora,
    export_lora,
    load_lora_state,
    parse_lora_state_dict,
    peft_state_dict,
    save_lora,
)

TARGETS = [
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.0.attn.add_q_proj",
    "transformer_blocks.0.attn.to_add_out",
    "transformer_blocks.0.img_mlp.net.0.proj",
    "transformer_blocks.1.img_mlp.net.2",
    "transformer_blocks.1.txt_mlp.net.0.proj",
    "transformer_blocks.1.img_mod.1",
    "transformer_blocks.1.txt_mod.1",
    "img_in",
    "txt_in",
    "proj_out",
]
RANK = 4
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def pipe(tiny_model_dir):
    from diffsynth_qie.models.load.loading import load_pipeline

    return load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu",
                         torch_dtype=torch.float32)


@pytest.fixture
def dit(pipe):
    """A fresh copy of the tiny DiT for each test (the fixture pipe stays untouched)."""
    return copy.deepcopy(pipe.dit)


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changes(model, base):
    """Parameter name -> (new - base) for every parameter that changed."""
    now = model.state_dict()
    return {k: now[k] - base[k] for k in base if not torch.equal(now[k], base[k])}


def random_pairs(model, targets=TARGETS, rank=RANK, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    out = {}
    for name in targets:
        out_dim, in_dim = mods[name].weight.shape
        out[name] = (torch.randn(rank, in_dim, generator=gen) * 0.1, torch.randn(out_dim, rank, generator=gen) * 0.1)
    return out


def canonical(pairs, alpha=None):
    sd = {}
    for name, (a, b) in pairs.items():
        sd[f"{name}.lora_A.weight"] = a
        sd[f"{name}.lora_B.weight"] = b
        if alpha is not None:
            sd[f"{name}.alpha"] = torch.tensor(float(alpha))
    return sd


def expected_deltas(pairs, alpha=None, scale=1.0):
    return {f"{n}.weight": scale * (1.0 if alpha is None else alpha / a.shape[0]) * (b.double() @ a.double()).float()
            for n, (a, b) in pairs.items()}


def assert_deltas(actual, expected):
    assert set(actual) == set(expected)
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], **TOL, msg=k)


# --- canonical format, and DiffSynth's own loader ----------------------------------
@pytest.mark.filterwarnings("ignore:Alpha detected in the LoRA file")
@pytest.mark.parametrize("alpha", [None, 8.0])
def test_canonical_save_load_matches_diffsynth_load_lora(tmp_path, pipe, dit, alpha):
    base = snapshot(dit)
    pairs = random_pairs(dit)
    path = save_lora(tmp_path / "lora.safetensors", canonical(pairs),
                     metadata={"rank": RANK, "alpha": alpha if alpha is not None else RANK,
                               "target_modules": ["to_q"], "preset": "tiny"})
    with safe_open(str(path), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    want = {f"{n}.lora_{x}.weight" for n in TARGETS for x in "AB"}
    if alpha is not None:  # alpha == rank needs no alpha key (DiffSynth's default)
        want |= {f"{n}.alpha" for n in TARGETS}
    assert keys == want
    assert meta["format"] == "diffsynth_qie.lora" and meta["preset"] == "tiny" and meta["rank"] == str(RANK)

    state = load_lora_state(path)
    assert state.format == "diffsynth_qie"
    report = apply_lora(dit, state, scale=0.5)
    assert report.lora_modules == sorted(TARGETS) and report.full_weights == []
    ours = changes(dit, base)
    assert_deltas(ours, expected_deltas(pairs, alpha, scale=0.5))

    theirs_model = copy.deepcopy(pipe.dit)
    pipe.load_lora(theirs_model, str(path), alpha=0.5)  # DiffSynth's GeneralLoRALoader fuse
    theirs = changes(theirs_model, base)
    assert set(theirs) == set(ours)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=1e-7, msg=k)


def test_peft_default_keys_from_diffsynth_training(tmp_path, dit):
    """What DiffSynth's add_lora_to_model + ModelLogger produce: `.lora_A.default.weight` keys."""
    from diffsynth.diffusion.training_module import DiffusionTrainingModule

    base = snapshot(dit)
    peft_model = DiffusionTrainingModule().add_lora_to_model(copy.deepcopy(dit), TARGETS, lora_rank=RANK, lora_alpha=8)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    mods = dict(peft_model.named_modules())
    peft_delta = {f"{n}.weight": mods[n].get_delta_weight("default").detach() for n in TARGETS}
    trained = {k: v.detach() for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert all(".default." in k for k in trained)

    # our save_lora with the run's alpha -> same delta as PEFT computes (scale alpha / r = 2)
    path = save_lora(tmp_path / "ours.safetensors", trained, metadata={"rank": RANK, "alpha": 8})
    apply_lora(dit, load_lora_state(path))
    assert_deltas(changes(dit, base), peft_delta)

    # the raw DiffSynth file (no alpha: DiffSynth trains with alpha = rank), PEFT's wrapper prefix
    raw = {f"base_model.model.{k}": v for k, v in trained.items()}
    save_file(raw, str(tmp_path / "raw.safetensors"))
    state = load_lora_state(tmp_path / "raw.safetensors")
    assert state.format == "peft" and set(state.modules) == set(TARGETS)
    fresh = copy.deepcopy(dit)
    fresh.load_state_dict(base)
    apply_lora(fresh, state)
    assert_deltas(changes(fresh, base), {k: v / 2 for k, v in peft_delta.items()})

    # starting a run (lora_alpha 8, r 4 -> PEFT scale 2) from our file reproduces its delta
    resumed = DiffusionTrainingModule().add_lora_to_model(copy.deepcopy(dit), TARGETS, lora_rank=RANK, lora_alpha=8)
    result = resumed.load_state_dict(peft_state_dict(load_lora_state(path), peft_scale=8 / RANK), strict=False)
    assert result.unexpected_keys == []
    mods = dict(resumed.named_modules())
    assert_deltas({f"{n}.weight": mods[n].get_delta_weight("default").detach() for n in TARGETS}, peft_delta)


def restyle(pairs, style):
    """The same LoRA under other tools' key names (alpha 8 = scale 2 where a style carries alpha)."""
    out = {}
    for name, (a, b) in pairs.items():
        if style == "diffsynth_default":
            out |= {f"{name}.lora_A.default.weight": a * 2, f"{name}.lora_B.default.weight": b}
        elif style == "pipe_prefix":
            out |= {f"pipe.dit.{name}.lora_A.default.weight": a * 2, f"pipe.dit.{name}.lora_B.default.weight": b}
        elif style == "diffusers":
            out |= {f"transformer.{name}.lora_A.weight": a * 2, f"transformer.{name}.lora_B.weight": b}
        elif style == "comfyui_up_down":
            out |= {f"diffusion_model.{name}.lora_down.weight": a, f"diffusion_model.{name}.lora_up.weight": b,
                    f"diffusion_model.{name}.alpha": torch.tensor(8.0)}
        elif style == "lycoris":
            key = "lycoris_" + name.replace(".", "_")
            out |= {f"{key}.lora_down.weight": a, f"{key}.lora_up.weight": b, f"{key}.alpha": torch.tensor(8.0)}
    return out


@pytest.mark.parametrize("style,fmt", [("diffsynth_default", "peft"), ("pipe_prefix", "peft"),
                                       ("diffusers", "diffusers"), ("comfyui_up_down", "comfyui"),
                                       ("lycoris", "kohya")])
def test_input_key_styles_give_the_same_delta(tmp_path, dit, style, fmt):
    base = snapshot(dit)
    pairs = random_pairs(dit, seed=8)
    save_file(restyle(pairs, style), str(tmp_path / "in.safetensors"))
    state = load_lora_state(tmp_path / "in.safetensors")
    assert state.format == fmt
    apply_lora(dit, state)
    assert_deltas(changes(dit, base), expected_deltas(pairs, alpha=8.0))


# --- export round trips -------------------------------------------------------------
def comfyui_patch(model, lora):
    """ComfyUI's rules (comfy/lora.py, model_base.QwenImage): key map, then load_lora's lookups.

    Returns (patched state dict, keys ComfyUI would log as 'lora key not loaded')."""
    sd = {f"diffusion_model.{k}": v for k, v in model.state_dict().items()}
    key_map = {}
    for k in sd:
        if k.endswith(".weight"):
            bare = k[len("diffusion_model."):-len(".weight")]
            key_map[k[:-len(".weight")]] = k
            key_map["lora_unet_" + bare.replace(".", "_")] = k
            key_map[bare] = k
            key_map["transformer." + bare] = k
            key_map["lycoris_" + bare.replace(".", "_")] = k
        else:
            key_map[k] = k
    out = {k: v.clone() for k, v in sd.items()}
    loaded = set()
    for x, target in key_map.items():
        alpha = lora[f"{x}.alpha"].item() if f"{x}.alpha" in lora else None
        if alpha is not None:
            loaded.add(f"{x}.alpha")
        for up, down in ((f"{x}.lora_up.weight", f"{x}.lora_down.weight"), (f"{x}.lora_B.weight", f"{x}.lora_A.weight")):
            if up in lora:
                s = 1.0 if alpha is None else alpha / lora[down].shape[0]
                out[target] += s * (lora[up] @ lora[down])
                loaded |= {up, down}
                break
        if f"{x}.set_weight" in lora:
            out[target].copy_(lora[f"{x}.set_weight"])
            loaded.add(f"{x}.set_weight")
    return {k[len("diffusion_model."):]: v for k, v in out.items()}, set(lora) - loaded


def read(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("fmt", ["comfyui", "diffusers"])
def test_export_round_trip(tmp_path, dit, fmt):
    base = snapshot(dit)
    pairs = random_pairs(dit, seed=2)
    full = {"norm_out.linear.weight": torch.randn_like(base["norm_out.linear.weight"]),
            "norm_out.linear.bias": torch.randn_like(base["norm_out.linear.bias"])}
    src = save_lora(tmp_path / "src.safetensors", {**canonical(pairs, alpha=8.0), **full})
    out = export_lora(src, tmp_path / f"{fmt}.safetensors", fmt, drop_full_weights=(fmt == "diffusers"))
    lora = read(out)

    reference = copy.deepcopy(dit)
    apply_lora(reference, load_lora_state(src))
    want = changes(reference, base)
    if fmt == "diffusers":  # full weights dropped; alpha folded into lora_A
        want = {k: v for k, v in want.items() if not k.startswith("norm_out.")}

    state = load_lora_state(out)
    assert state.format == fmt
    report = apply_lora(dit, state)
    got = changes(dit, base)
    if fmt == "comfyui":
        assert report.full_weights == ["norm_out.linear.bias", "norm_out.linear.weight"]
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        dit.load_state_dict(base)
        patched, not_loaded = comfyui_patch(dit, lora)
        assert not_loaded == set()
        assert_deltas({k: patched[k] - base[k] for k in want}, want)
    else:
        assert report.full_weights == []
        assert_deltas(got, want)
        # diffusers: every key carries "lora", no alpha / diffusion_model. / default. keys (which
        # would route it through the non-diffusers converter), and scale 1 reproduces the delta.
        assert all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in lora)
        module_names = dict(dit.named_modules())
        for name in TARGETS:
            a, b = lora[f"transformer.{name}.lora_A.weight"], lora[f"transformer.{name}.lora_B.weight"]
            assert name in module_names
            torch.testing.assert_close(b @ a, want[f"{name}.weight"], **TOL)


def test_export_refuses_full_weights_for_diffusers(tmp_path, dit):
    pairs = random_pairs(dit, targets=TARGETS[:1])
    src = save_lora(tmp_path / "src.safetensors", {**canonical(pairs), "img_in.weight": dit.img_in.weight.detach()})
    with pytest.raises(ValueError, match=r"1 fully trained module\(s\).*: img_in;.*drop_full_weights"):
        export_lora(src, tmp_path / "out.safetensors", "diffusers")
    assert not (tmp_path / "out.safetensors").exists()


# --- kohya / musubi -----------------------------------------------------------------
def kohya(pairs, alphas):
    sd = {}
    for name, (a, b) in pairs.items():
        key = "lora_unet_" + name.replace(".", "_")
        sd[f"{key}.lora_down.weight"] = a
        sd[f"{key}.lora_up.weight"] = b
        sd[f"{key}.alpha"] = torch.tensor(alphas[name])
    return sd


def test_kohya_alpha_scaling_and_name_mapping(tmp_path, dit):
    base = snapshot(dit)
    pairs = random_pairs(dit, seed=3)
    alphas = {n: (8.0 if i % 2 else 2.0) for i, n in enumerate(TARGETS)}  # scales 2 and 0.5
    save_file(kohya(pairs, alphas), str(tmp_path / "kohya.safetensors"))
    state = load_lora_state(tmp_path / "kohya.safetensors")
    assert state.format == "kohya"
    report = apply_lora(dit, state)
    assert report.lora_modules == sorted(TARGETS)  # to_out_0, img_mlp_net_0_proj, img_mod_1 mapped back
    want = {f"{n}.weight": alphas[n] / RANK * (b.double() @ a.double()).float() for n, (a, b) in pairs.items()}
    assert_deltas(changes(dit, base), want)

    # without a model (export), names are mapped with DiffSynth's QwenImageDiT module names
    out = export_lora(tmp_path / "kohya.safetensors", tmp_path / "comfy.safetensors", "comfyui")
    assert {k for k in read(out) if k.endswith(".lora_A.weight")} == {f"diffusion_model.{n}.lora_A.weight" for n in TARGETS}


def test_kohya_unknown_module_is_named(tmp_path, dit):
    pairs = random_pairs(dit, targets=TARGETS[:2])
    sd = kohya(pairs, {n: 4.0 for n in pairs})
    sd["lora_unet_transformer_blocks_5_attn_to_q.lora_down.weight"] = torch.zeros(RANK, 64)
    sd["lora_unet_transformer_blocks_5_attn_to_q.lora_up.weight"] = torch.zeros(64, RANK)
    with pytest.raises(ValueError, match="lora_unet_transformer_blocks_5_attn_to_q"):
        apply_lora(dit, parse_lora_state_dict(sd))


# --- mismatches are errors, never ignored -------------------------------------------
def test_mismatching_lora_raises_naming_keys_and_changes_nothing(dit):
    base = snapshot(dit)
    pairs = random_pairs(dit, targets=TARGETS[:2])
    sd = canonical(pairs)
    sd["transformer_blocks.7.attn.to_q.lora_A.weight"] = torch.zeros(RANK, 64)
    sd["transformer_blocks.7.attn.to_q.lora_B.weight"] = torch.zeros(64, RANK)
    sd["transformer_blocks.0.attn.to_k.lora_A.weight"] = torch.zeros(RANK, 32)  # in-dim 32 != 64
    sd["transformer_blocks.0.attn.to_k.lora_B.weight"] = torch.zeros(64, RANK)
    sd["img_in.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as info:
        apply_lora(dit, parse_lora_state_dict(sd, source="bad.safetensors"))
    msg = str(info.value)
    for name in ("bad.safetensors", "transformer_blocks.7.attn.to_q", "transformer_blocks.0.attn.to_k", "img_in.weight"):
        assert name in msg
    assert changes(dit, base) == {}


@pytest.mark.parametrize("bad_key", [
    "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",  # text-encoder LoRA
    "transformer_blocks.0.attn.to_q.lora_magnitude_vector",          # DoRA
    "transformer_blocks.0.attn.to_q.diff",                           # ComfyUI full diff patch
])
def test_unsupported_keys_are_named(dit, bad_key):
    sd = {**canonical(random_pairs(dit, targets=TARGETS[:1])), bad_key: torch.zeros(2)}
    with pytest.raises(ValueError, match=bad_key.replace(".", r"\.")):
        parse_lora_state_dict(sd)


def test_incomplete_pair_raises(dit):
    sd = canonical(random_pairs(dit, targets=TARGETS[:2]))
    del sd[f"{TARGETS[1]}.lora_B.weight"]
    with pytest.raises(ValueError, match=rf"{TARGETS[1]}.*missing lora_B"):
        parse_lora_state_dict(sd)


def test_lora_plus_full_weights_loads_both(tmp_path, dit):
    base = snapshot(dit)
    pairs = random_pairs(dit, targets=["transformer_blocks.0.attn.to_q"], seed=4)
    full = {"img_in.weight": torch.randn(64, 64), "img_in.bias": torch.randn(64)}
    path = save_lora(tmp_path / "mixed.safetensors", {**canonical(pairs), **full})
    report = apply_lora(dit, load_lora_state(path))
    assert report.lora_modules == ["transformer_blocks.0.attn.to_q"]
    assert report.full_weights == ["img_in.bias", "img_in.weight"]
    assert "img_in.weight" in report.summary()
    assert torch.equal(dit.img_in.weight, full["img_in.weight"]) and torch.equal(dit.img_in.bias, full["img_in.bias"])
    got = changes(dit, base)
    assert set(got) == {"transformer_blocks.0.attn.to_q.weight", "img_in.weight", "img_in.bias"}
    assert_deltas({k: got[k] for k in expected_deltas(pairs)}, expected_deltas(pairs))


def test_missing_path_is_named(tmp_path, dit):
    missing = tmp_path / "nope" / "lora.safetensors"
    with pytest.raises(ValueError, match=str(missing)):
        load_lora_state(missing)
    with pytest.raises(ValueError, match=str(missing)):
        LoraManager(dit).set_loras([(missing, 1.0)])


# --- alpha from diffusers' lora_adapter_metadata ----------------------------------------
def diffusers_file(path, pairs, config, prefix="transformer."):
    """A LoRA as diffusers' ``save_lora_weights`` writes it: ``transformer.`` keys, no
    ``.alpha`` tensors, the PEFT ``LoraConfig`` as JSON under ``lora_adapter_metadata``
    (keys prefixed by the component for a pipeline, bare for a model's ``save_lora_adapter``)."""
    sd = {}
    for name, (a, b) in pairs.items():
        sd[f"transformer.{name}.lora_A.weight"] = a
        sd[f"transformer.{name}.lora_B.weight"] = b
    packed = {f"{prefix}{k}": v for k, v in config.items()}
    save_file(sd, str(path), metadata={"format": "pt",
                                        "lora_adapter_metadata": json.dumps(packed, indent=2, sort_keys=True)})
    return path


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_diffusers_metadata_alpha_and_patterns_are_applied(tmp_path, dit, prefix):
    base = snapshot(dit)
    pairs = random_pairs(dit, seed=11)
    pairs["img_in"] = (pairs["img_in"][0][:2].clone(), pairs["img_in"][1][:, :2].clone())  # rank 2
    config = {"r": RANK, "lora_alpha": 16, "alpha_pattern": {"to_q": 2, "proj_out": 12},
              "rank_pattern": {"img_in": 2}, "target_modules": sorted({n.split(".")[-1] for n in TARGETS}),
              "use_dora": False, "use_rslora": False, "lora_dropout": 0.0}
    path = diffusers_file(tmp_path / "pytorch_lora_weights.safetensors", pairs, config, prefix)
    apply_lora(dit, load_lora_state(path))
    alpha = {n: 2 if n.endswith("to_q") else 12 if n == "proj_out" else 16 for n in pairs}
    want = {f"{n}.weight": alpha[n] / a.shape[0] * (b.double() @ a.double()).float() for n, (a, b) in pairs.items()}
    assert_deltas(changes(dit, base), want)


def test_diffusers_metadata_rank_mismatch_is_named(tmp_path, dit):
    pairs = random_pairs(dit, targets=TARGETS[:1])
    path = diffusers_file(tmp_path / "l.safetensors", pairs, {"r": 8, "lora_alpha": 8})
    with pytest.raises(ValueError, match=r"rank 8 .*to_q.*rank 4"):
        load_lora_state(path)


def test_export_does_not_copy_adapter_metadata(tmp_path, dit):
    """The diffusers export folds alpha into lora_A: a copied lora_adapter_metadata would
    make diffusers apply alpha a second time."""
    pairs = random_pairs(dit, targets=TARGETS[:2])
    src = diffusers_file(tmp_path / "src.safetensors", pairs, {"r": RANK, "lora_alpha": 8})
    out = export_lora(src, tmp_path / "out.safetensors", "diffusers")
    with safe_open(str(out), "pt") as f:
        assert "lora_adapter_metadata" not in (f.metadata() or {})
    for name, (a, b) in pairs.items():
        got = read(out)
        torch.testing.assert_close(got[f"transformer.{name}.lora_B.weight"] @ got[f"transformer.{name}.lora_A.weight"],
                                   8 / RANK * b @ a, **TOL)


# --- poisoned files are refused --------------------------------------------------------
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf"), 1e6])
def test_poisoned_lora_is_refused_naming_file_and_key(tmp_path, dit, poison):
    base = snapshot(dit)
    sd = canonical(random_pairs(dit, targets=TARGETS[:2]))
    key = f"{TARGETS[1]}.lora_B.weight"
    sd[key][3, 1] = poison
    path = tmp_path / "poisoned.safetensors"
    save_file(sd, str(path))
    with pytest.raises(ValueError) as info:
        load_lora_state(path)
    assert str(path) in str(info.value) and key in str(info.value)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        LoraManager(dit).set_loras([(path, 1.0)])
    assert changes(dit, base) == {}


def test_absurd_delta_is_refused(tmp_path, dit):
    """Values each below the per-value limit whose product dwarfs the weight."""
    base = snapshot(dit)
    pairs = {n: (a.sign() * 1e3, b.sign() * 1e3) for n, (a, b) in random_pairs(dit, targets=TARGETS[:1]).items()}
    path = save_lora(tmp_path / "huge.safetensors", canonical(pairs))
    with pytest.raises(ValueError, match=rf"huge\.safetensors.*{TARGETS[0]}.*norm"):
        apply_lora(dit, load_lora_state(path))
    assert changes(dit, base) == {}
    # a huge alpha: the same check
    path = tmp_path / "alpha.safetensors"
    save_file(canonical(random_pairs(dit, targets=TARGETS[:1]), alpha=1e9), str(path))
    with pytest.raises(ValueError, match=rf"{TARGETS[0]}.*alpha"):
        apply_lora(dit, load_lora_state(path))
    assert changes(dit, base) == {}


def test_empty_alpha_and_rank_zero_are_clear_errors(tmp_path, dit):
    sd = canonical(random_pairs(dit, targets=TARGETS[:1]))
    sd[f"{TARGETS[0]}.alpha"] = torch.zeros(0)
    save_file(sd, str(tmp_path / "empty_alpha.safetensors"))
    with pytest.raises(ValueError, match=rf"empty_alpha.*{TARGETS[0]}\.alpha.*one number"):
        load_lora_state(tmp_path / "empty_alpha.safetensors")

    name = TARGETS[0]
    sd = {f"{name}.lora_A.weight": torch.zeros(0, 64), f"{name}.lora_B.weight": torch.zeros(64, 0),
          f"{name}.alpha": torch.tensor(4.0)}
    save_file(sd, str(tmp_path / "rank0.safetensors"))
    with pytest.raises(ValueError, match=rf"rank0.*rank-0.*{name}"):
        load_lora_state(tmp_path / "rank0.safetensors")


# --- switching without reloading the base model --------------------------------------
def test_lora_manager_switch_and_clear_restore_bit_identical(tmp_path, dit):
    base = snapshot(dit)
    pairs_a = random_pairs(dit, seed=5)
    pairs_b = random_pairs(dit, targets=TARGETS[:3], seed=6)
    path_a = save_lora(tmp_path / "a.safetensors", canonical(pairs_a, alpha=8.0))
    full_b = {"proj_out.bias": torch.randn(64)}
    path_b = save_lora(tmp_path / "b.safetensors", {**canonical(pairs_b), **full_b})
    bad = save_lora(tmp_path / "bad.safetensors", canonical({"transformer_blocks.9.attn.to_q": pairs_a[TARGETS[0]]}))
    manager = LoraManager(dit, merge=True)

    manager.set_loras([(path_a, 1.0)])
    assert_deltas(changes(dit, base), expected_deltas(pairs_a, alpha=8.0))
    state_a = manager.load(path_a)
    assert manager.load(path_a) is state_a  # cached while unchanged
    manager.set_loras([(path_a, 1.0)])  # no-op: not merged twice
    assert_deltas(changes(dit, base), expected_deltas(pairs_a, alpha=8.0))

    reports = manager.set_loras([(path_a, 0.5), (path_b, 1.0)])
    assert [r.full_weights for r in reports] == [[], ["proj_out.bias"]]
    want = expected_deltas(pairs_a, alpha=8.0, scale=0.5)
    for k, v in expected_deltas(pairs_b).items():
        want[k] = want[k] + v
    want["proj_out.bias"] = full_b["proj_out.bias"] - base["proj_out.bias"]
    assert_deltas(changes(dit, base), want)

    # a LoRA that does not fit: error, and the active LoRAs stay exactly as they were
    before = snapshot(dit)
    with pytest.raises(ValueError, match="transformer_blocks.9.attn.to_q"):
        manager.set_loras([(path_a, 1.0), (bad, 1.0)])
    assert changes(dit, before) == {}
    assert [p.name for p, _ in manager.active] == ["a.safetensors", "b.safetensors"]

    manager.clear()
    assert changes(dit, base) == {}  # bit-identical base weights
    assert manager.active == []

    # the file changes on disk -> reloaded (cache keyed by path + mtime)
    pairs_a2 = random_pairs(dit, seed=7)
    save_lora(path_a, canonical(pairs_a2))
    st = os.stat(path_a)
    os.utime(path_a, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert manager.load(path_a) is not state_a
    manager.set_loras([(path_a, 1.0)])
    assert_deltas(changes(dit, base), expected_deltas(pairs_a2))
    manager.set_loras([])
    assert changes(dit, base) == {}


# --- CLI ------------------------------------------------------------------------------
def test_export_lora_command(tmp_path, dit):
    from diffsynth_qie.commands import export_lora as cmd

    src = save_lora(tmp_path / "src.safetensors", canonical(random_pairs(dit, targets=TARGETS[:2]), alpha=2.0))
    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    args = parser.parse_args(["--format", "comfyui", str(src), str(tmp_path / "out.safetensors")])
    assert cmd.run(args) == 0
    keys = set(read(tmp_path / "out.safetensors"))
    assert keys == {f"diffusion_model.{n}.{s}" for n in TARGETS[:2] for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    with pytest.raises(SystemExit):
        parser.parse_args(["--format", "onnx", str(src), "x"])  # not a target
