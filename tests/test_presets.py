"""Model presets: names, aliases, per-model flags and their overrides (pure data, no torch)."""
from __future__ import annotations

import dataclasses

import pytest

from diffsynth_qie.models.presets import (
    COMPONENTS,
    DEFAULT_LORA_TARGETS,
    PRESETS,
    Preset,
    get_preset,
)


def test_registry_holds_exactly_the_supported_models():
    assert set(PRESETS) == {"edit", "2509", "2511", "tiny", "2.1", "2.1-turbo", "tiny-2.1"}
    assert all(isinstance(p, Preset) and p.name == key for key, p in PRESETS.items())


def test_zero_cond_t_is_on_for_2511_only():
    assert {name for name, p in PRESETS.items() if p.zero_cond_t} == {"2511"}
    assert get_preset("2511").zero_cond_t is True
    assert get_preset("2509").zero_cond_t is False
    assert get_preset("edit").zero_cond_t is False


def test_zero_cond_t_override_both_ways_without_mutating_registry():
    off = get_preset("2511", zero_cond_t=False)
    on = get_preset("edit", zero_cond_t=True)
    assert off.zero_cond_t is False and off.name == "2511"
    assert on.zero_cond_t is True and on.name == "edit"
    # None keeps the preset's value; the registry entries are unchanged.
    assert get_preset("2511", zero_cond_t=None).zero_cond_t is True
    assert PRESETS["2511"].zero_cond_t is True and PRESETS["edit"].zero_cond_t is False
    # Everything but the flag is the same preset.
    assert dataclasses.replace(off, zero_cond_t=True) == PRESETS["2511"]


def test_presets_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["2511"].zero_cond_t = False  # type: ignore[misc]


@pytest.mark.parametrize("alias, name", [
    ("Qwen-Image-Edit-2511", "2511"), ("Qwen/Qwen-Image-Edit-2511", "2511"),
    ("qwen-image-edit-2509", "2509"), ("Qwen-Image-Edit", "edit"), ("Qwen/Qwen-Image-Edit", "edit"),
    (" 2511 ", "2511"), ("TINY", "tiny"),
])
def test_aliases(alias, name):
    assert get_preset(alias) == PRESETS[name]


def test_preset_instance_passes_through_with_override():
    p = get_preset(PRESETS["2509"], zero_cond_t=True)
    assert p.name == "2509" and p.zero_cond_t is True


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_preset("Qwen-Image-Edit-2600")
    msg = str(err.value)
    assert "Qwen-Image-Edit-2600" in msg
    for name in PRESETS:
        assert name in msg


def test_multi_image_prompt_flag():
    assert PRESETS["edit"].multi_image_prompt is False
    assert PRESETS["2509"].multi_image_prompt is True
    assert PRESETS["2511"].multi_image_prompt is True


def test_lora_targets_2511_adds_projections():
    assert PRESETS["edit"].lora_target_modules == DEFAULT_LORA_TARGETS
    assert PRESETS["2509"].lora_target_modules == DEFAULT_LORA_TARGETS
    extra = set(PRESETS["2511"].lora_target_modules) - set(DEFAULT_LORA_TARGETS)
    assert extra == {"img_in", "txt_in", "proj_out"}
    assert set(DEFAULT_LORA_TARGETS) <= set(PRESETS["2511"].lora_target_modules)
    assert len(set(PRESETS["2511"].lora_target_modules)) == len(PRESETS["2511"].lora_target_modules)


@pytest.mark.parametrize("name", ["edit", "2509", "2511"])
def test_real_presets_name_every_component_on_modelscope(name):
    p = PRESETS[name]
    assert not p.is_tiny
    # The DiT is the preset's own repo; the rest may be shared repos (as in DiffSynth's examples).
    assert p.dit.model_id == p.repo_id
    assert p.repo_id.startswith("Qwen/Qwen-Image-Edit")
    for component in COMPONENTS:
        source = p.source(component)
        assert source.model_id.startswith("Qwen/"), (component, source)
        if component in ("tokenizer", "processor"):
            assert source.is_folder and source.pattern == f"{component}/"
        else:
            assert source.pattern.endswith(".safetensors") and not source.is_folder
    # The three real presets differ only in the DiT repo and flags, not in the shared parts.
    assert (p.text_encoder, p.vae, p.tokenizer, p.processor) == (
        PRESETS["edit"].text_encoder, PRESETS["edit"].vae, PRESETS["edit"].tokenizer, PRESETS["edit"].processor)


def test_unknown_component():
    with pytest.raises(ValueError, match="controlnet"):
        PRESETS["2511"].source("controlnet")
