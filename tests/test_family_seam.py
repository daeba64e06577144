"""The model-family seam as a contract: every family's behaviour is a complete ``FamilyOps``, found through its
``Family`` record; schedules, the training template, the prompt-tensor schema and make-tiny's choices are read
from the family and the presets, not typed elsewhere."""
from __future__ import annotations

import inspect

import pytest

from diffsynth_qie.models.family import FAMILIES
from diffsynth_qie.models.family_ops import FamilyOps, ops_for
from diffsynth_qie.models.presets import PRESETS, family_of
from diffsynth_qie.models.samplers.schedules import ScheduleSpec


def test_family_ops_is_abstract_and_every_family_implements_all_of_it():
    abstract = set(FamilyOps.__abstractmethods__)
    assert {"schedule", "forward", "split_prompt", "join_prompt", "decode"} <= abstract
    for family in FAMILIES.values():
        ops = ops_for(family)
        assert isinstance(ops, FamilyOps) and ops.family is family and ops_for(family.name) is ops
        for name in abstract:  # each method is the family's own, with the base's parameters
            assert getattr(type(ops), name) is not getattr(FamilyOps, name), (family.name, name)
            assert (list(inspect.signature(getattr(type(ops), name)).parameters)
                    == list(inspect.signature(getattr(FamilyOps, name)).parameters)), (family.name, name)

    class Partial(FamilyOps):  # a new family that forgot a method cannot be built
        family = next(iter(FAMILIES.values()))

        def schedule(self, spec):
            return None

    with pytest.raises(TypeError, match="abstract"):
        Partial()
    with pytest.raises(TypeError, match="must set `family`"):
        type("NoFamily", (FamilyOps,), {name: lambda self, *a, **k: None for name in FamilyOps.__abstractmethods__})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_builds_its_schedule_from_one_spec(family):
    ops = ops_for(family)
    spec = ScheduleSpec(4, (8, 8))
    scheduler = ops.schedule(spec)
    assert len(scheduler.timesteps) == 4 and float(scheduler.sigmas[0]) <= 1.0
    assert len(ops.schedule(ScheduleSpec(4, (8, 8), strength=0.5)).timesteps) == 4
    grid = ops.schedule(ScheduleSpec(3, (8, 8), sigmas=(1.0, 0.6, 0.2)))  # a preset's fixed grid is honoured
    assert [round(float(s), 6) for s in grid.sigmas] == [1.0, 0.6, 0.2]
    with pytest.raises(ValueError, match="fixed grid of 3 steps"):
        ops.schedule(ScheduleSpec(5, (8, 8), sigmas=(1.0, 0.6, 0.2)))
    with pytest.raises(ValueError, match="scheduler 'turbo'"):
        ScheduleSpec(4, (8, 8), "turbo")


def test_the_sampler_asks_the_family_for_the_schedule_of_the_latents_it_samples():
    import torch

    from diffsynth_qie.models.samplers.sampling import sample_flow_match

    asked = []
    ops = ops_for(next(iter(FAMILIES)))

    def schedule(spec):
        asked.append(spec)
        return ops.schedule(spec)

    spec = ScheduleSpec(3, (4, 6))
    out = sample_flow_match(lambda x, t: torch.ones_like(x), torch.zeros(1, 16, 4, 6), spec, schedule)
    assert asked == [spec] and torch.allclose(out, torch.full_like(out, -1.0), atol=1e-6)
    with pytest.raises(ValueError, match=r"asked for latents of \(4, 6\)"):
        sample_flow_match(lambda x, t: x, torch.zeros(1, 16, 8, 8), spec, schedule)


def test_the_training_schedule_is_the_familys():
    import torch

    from diffsynth_qie.training.config import TimestepConfig
    from diffsynth_qie.training.timesteps import draw_timesteps, training_schedule

    for family in FAMILIES.values():
        sigmas, _, _ = training_schedule(family.training_template)
        d = draw_timesteps(8, TimestepConfig(), torch.Generator().manual_seed(0), family=family)
        assert torch.equal(d.sigmas, sigmas[d.index])


def test_make_tiny_offers_exactly_the_locally_built_presets():
    import argparse

    from diffsynth_qie.commands import make_tiny

    parser = argparse.ArgumentParser()
    make_tiny.add_arguments(parser)
    choices = next(a.type for a in parser._actions if a.dest == "model").qie_presets  # preset_type's names
    assert set(choices) == {name for name, p in PRESETS.items() if p.provider} and choices
    for name in choices:  # each provider module says how to build its model
        hooks = make_tiny.local_build(name)
        assert set(hooks) == {"replaceable", "complete", "ensure", "what"}
        assert all(callable(hooks[k]) for k in ("replaceable", "complete", "ensure"))
        assert family_of(name).label in hooks["what"]


def test_a_sidecar_from_before_the_prompt_schema_reads_as_the_same_tensors():
    from diffsynth_qie.cache.entry import EntryMeta

    fields = dict(entry_id="e", row_id="e", dataset="d", inverse=False, content_hash="h", prompts=["p"],
                  prompt_lengths=[3], empty_prompt_length=2, prompt_dim=4, target_size=(32, 32),
                  target_shape=(64, 2, 2), edit_shapes=[], has_back_mask=False, ref_gt_shape=None, lbm_source="none",
                  sub_noise_key="k", sub_noise_ref_gt_key=None, dtype="float32", patch=1)
    old = EntryMeta.from_json({**fields, "has_prompt_pads": True})  # its tensors are prompt_pad.<k>, empty_prompt_pad
    assert old.prompt_tensors == ["pad"] and EntryMeta.from_json(old.to_json()) == old
    assert EntryMeta.from_json({**fields, "has_prompt_pads": False}).prompt_tensors == []
