"""Schedules as data: the metadata schema, the public-line table, a declared schedule used once (never shifted
twice) by either family, and the one-line refusals."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from diffsynth_qie.models.samplers.declared import (PUBLIC_LINES, SCHEDULE_KEY, DeclaredSchedule, declared_schedule,
                                                    from_metadata, plan_schedule, public_line, table_markdown)

Q21, EDIT = "qwen-image-2.1", "qwen-image-edit"
VIGGLE6 = "Qwen-Image-2.1-viggle-turbo-v0.2.1-6step-lora-r128.safetensors"


def _lora(path: Path, metadata: dict | None = None) -> str:
    from safetensors.torch import save_file

    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 8),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 2)}, str(path), metadata=metadata)
    return str(path)


def test_the_schema_round_trips_and_a_bad_entry_names_the_file():
    s = DeclaredSchedule(6, 1.0, (1.0, 0.9375, 0.875, 0.75, 0.5, 0.25), family=Q21, line="x", unmerged=True)
    assert from_metadata(s.to_metadata()) == s
    shift = DeclaredSchedule(5, 2.0, shift=2.5)
    assert from_metadata(shift.to_metadata()) == shift and json.loads(shift.to_metadata()[SCHEDULE_KEY])["version"] == 1
    for bad in ('{"version": 2, "steps": 4, "shift": 3}', '{"version": 1, "steps": 3, "sigmas": [1.0, 0.5]}',
                '{"version": 1, "steps": 2, "sigmas": [0.5, 1.0]}', '{"version": 1, "steps": 4}',
                '{"version": 1, "steps": 4, "shift": 3, "colour": 1}', "[1, 2]", "{nope"):
        with pytest.raises(ValueError, match=f"my.safetensors: metadata '{SCHEDULE_KEY}' is not a valid schedule"):
            from_metadata({SCHEDULE_KEY: bad}, "my.safetensors")


@pytest.mark.parametrize("family", ["tiny", "tiny-2.1"])
@pytest.mark.parametrize("latent_hw", [(4, 4), (64, 96)])
def test_a_declared_grid_reaches_the_scheduler_as_given(family, latent_hw):
    """The family's scheduler samples on exactly the declared sigmas at any resolution: no shift on top."""
    from diffsynth_qie.models.family_ops import ops_for
    from diffsynth_qie.models.presets import family_of
    from diffsynth_qie.models.samplers.schedules import ScheduleSpec

    ops = ops_for(family_of(family))
    for declared in (PUBLIC_LINES[0].schedule, DeclaredSchedule(8, 1.0, shift=3.0), DeclaredSchedule(5, 1.0, shift=2.0)):
        grid = declared.grid()
        sched = ops.schedule(ScheduleSpec.for_preset(None, len(grid), latent_hw, sigmas=grid))
        assert torch.allclose(sched.sigmas.double(), torch.tensor(grid, dtype=torch.float64), atol=1e-7)


@pytest.mark.parametrize("steps", [4, 8])
def test_a_declared_shift_is_applied_once(steps):
    """Shift 3 declared = DiffSynth's Lightning schedule (shift 3 applied once); shifting the declared grid again,
    as a second shift would, gives another schedule."""
    from diffsynth.diffusion import FlowMatchScheduler

    grid = torch.tensor(DeclaredSchedule(steps, 1.0, shift=3.0).grid(), dtype=torch.float64)
    lightning = FlowMatchScheduler("Qwen-Image-Lightning")
    lightning.set_timesteps(steps, dynamic_shift_len=4096)
    assert torch.allclose(grid, lightning.sigmas.double(), atol=1e-6)
    assert not torch.allclose(3 * grid / (1 + 2 * grid), grid, atol=1e-3)


def test_public_lines_by_file_name_and_the_docs_table():
    assert public_line(f"/models/{VIGGLE6}").schedule.sigmas == (1.0, 0.9375, 0.875, 0.75, 0.5, 0.25)
    assert public_line("Qwen-Image-2.1-viggle-turbo-4step-lora-r64.safetensors").schedule.steps == 4
    assert public_line("Qwen-Image-Edit-2511-Lightning-4steps-V1.0-bf16.safetensors").schedule.family == EDIT
    assert public_line("my_style.safetensors") is None
    for line in PUBLIC_LINES:  # every row's example is found by its own pattern, and by no earlier row
        assert public_line(line.example) is line, line.example
    doc = (Path(__file__).resolve().parents[1] / "docs" / "SCHEDULES.md").read_text()
    assert table_markdown() in doc, "paste models.samplers.declared.table_markdown() into docs/SCHEDULES.md"


def test_metadata_wins_over_the_file_name(tmp_path):
    mine = DeclaredSchedule(3, 1.5, shift=2.0, family=Q21)
    path = _lora(tmp_path / VIGGLE6, mine.to_metadata())
    assert declared_schedule(path) == (mine, "its metadata")
    assert declared_schedule(_lora(tmp_path / "plain.safetensors"))[0] is None


def test_plan_uses_a_declared_schedule_and_says_so_once(tmp_path, caplog):
    path = _lora(tmp_path / VIGGLE6)
    with caplog.at_level(logging.INFO, logger="diffsynth_qie.models.samplers.declared"):
        plan = plan_schedule("auto", None, None, [path], Q21, 40, 1.0)
    assert plan.sigmas == (1.0, 0.9375, 0.875, 0.75, 0.5, 0.25) and plan.steps == 6 and plan.cfg == 1.0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "declares its schedule" in lines[0] and "public-line table" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="diffsynth_qie.models.samplers.declared"):
        assert plan_schedule("auto", None, 2.0, [path], Q21, 40, 1.0).cfg == 2.0  # the user's override
    assert "--cfg 2 as given" in caplog.records[0].getMessage()
    assert plan_schedule("default", None, None, [path], Q21, 40, 1.0).sigmas is None  # explicit scheduler: ignored
    shifted = _lora(tmp_path / "s.safetensors", DeclaredSchedule(4, 1.0, shift=3.0).to_metadata())
    assert len(plan_schedule("auto", 6, None, [shifted], Q21, 40, 1.0).sigmas) == 6  # a shift takes --steps


@pytest.mark.parametrize("case, message", [
    ("steps", r"explicit grid of 6 sigmas; --steps 4 belongs to another schedule: drop --steps"),
    ("family", r"is Qwen-Image-2.1 viggle-turbo .* for qwen-image-2.1, but this model is qwen-image-edit"),
    ("two lines", r"declares .* but LoRA .* declares .*: they belong to different few-step lines; use one of them"),
])
def test_bad_schedules_are_refused_in_one_line(tmp_path, case, message):
    six = _lora(tmp_path / VIGGLE6)
    four = _lora(tmp_path / "Qwen-Image-2.1-viggle-turbo-4step-lora-r64.safetensors")
    args = {"steps": ("auto", 4, None, [six], Q21), "family": ("auto", None, None, [six], EDIT),
            "two lines": ("auto", None, None, [six, four], Q21)}[case]
    with pytest.raises(ValueError, match=message) as err:
        plan_schedule(*args, 40, 4.0)
    assert "\n" not in str(err.value)


def test_the_editor_samples_on_a_requested_grid(tiny_pipe):
    from PIL import Image

    from diffsynth_qie.inference import EditRequest, Editor

    seen = []
    request = EditRequest(images=[Image.new("RGB", (64, 64), (200, 30, 30))], prompt="make it blue", width=64,
                          height=64, sigmas=(1.0, 0.5, 0.25), cfg=1.0, progress=lambda i, n: seen.append(n))
    Editor(tiny_pipe).edit(request)
    assert seen and set(seen) == {3}
