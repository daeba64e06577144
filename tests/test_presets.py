"""Model presets: names, aliases, per-model flags and their overrides.

Properties every preset has (checked over the whole registry, so adding a preset is tested, not refused), and
the flags of the published checkpoints that must not change.
"""
from __future__ import annotations

import dataclasses

import pytest

from diffsynth_qie.models.family import EDIT, FAMILIES, get_family
from diffsynth_qie.models.presets import (
    ALIASES,
    COMPONENTS,
    DEFAULT_LORA_TARGETS,
    PRESETS,
    Preset,
    get_preset,
)

REAL = [name for name, p in PRESETS.items() if not p.is_tiny]


def test_every_preset_is_registered_under_its_name_in_a_known_family():
    assert PRESETS and REAL
    for key, p in PRESETS.items():
        assert isinstance(p, Preset) and p.name == key
        assert get_family(p.family).name == p.family
        assert set(p.lora_target_modules) and len(set(p.lora_target_modules)) == len(p.lora_target_modules)


def test_every_family_has_a_tiny_preset_built_locally_for_the_cpu_tests():
    for family in FAMILIES:
        tiny = [p for p in PRESETS.values() if p.family == family and p.is_tiny]
        assert tiny, f"family {family} has no tiny preset"
        assert all(p.provider and ":" in p.provider for p in tiny)
    assert all(not p.provider for p in PRESETS.values() if not p.is_tiny)  # real presets download


def test_every_alias_names_a_preset_and_none_shadows_a_preset_name():
    for alias, name in ALIASES.items():
        assert name in PRESETS and alias == alias.lower() and alias not in PRESETS, alias
        assert get_preset(alias).name == name and get_preset(alias.upper()).name == name


def test_zero_cond_t_presets_are_of_a_family_that_supports_it():
    from diffsynth_qie.models.family_ops import ops_for

    for p in PRESETS.values():
        if p.zero_cond_t:
            assert ops_for(p.family).supports_zero_cond_t, p.name


def test_the_published_checkpoints_zero_cond_t():
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


@pytest.mark.parametrize("name", REAL)
def test_real_presets_name_every_component_on_modelscope(name):
    p = PRESETS[name]
    # The DiT is the preset's own repo; the rest may be shared repos (as in DiffSynth's examples).
    assert p.dit.model_id == p.repo_id
    assert p.repo_id.startswith("Qwen/Qwen-Image")
    for component in COMPONENTS:
        source = p.source(component)
        if source is None:  # a family without a tokenizer folder keeps it in the processor
            assert component == "tokenizer" and not get_family(p.family).has_tokenizer
            continue
        assert source.model_id.startswith("Qwen/"), (component, source)
        if component in ("tokenizer", "processor"):
            assert source.is_folder and source.pattern == f"{component}/"
        else:
            assert source.pattern.endswith(".safetensors") and not source.is_folder
    # The real Qwen-Image-Edit presets differ only in the DiT repo and flags, not in the shared parts.
    if p.family == EDIT.name:
        assert (p.text_encoder, p.vae, p.tokenizer, p.processor) == (
            PRESETS["edit"].text_encoder, PRESETS["edit"].vae, PRESETS["edit"].tokenizer, PRESETS["edit"].processor)


def test_unknown_component():
    with pytest.raises(ValueError, match="controlnet"):
        PRESETS["2511"].source("controlnet")
