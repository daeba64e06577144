"""Contracts of the UI's settings table (``ui/settings.py``) with everything that must agree with it.

Each setting's widget value must reach its ``EditRequest`` field, its record (PNG text, history), its ``qie edit``
flag and its history restore. The flow tests drive the real event wiring of ``build_ui`` with a distinct,
non-default value per widget (found by its ``elem_id``, as the browser finds it), so two widgets crossed anywhere
between the layout and the sampler make them fail; ``test_crossed_widgets_are_caught`` proves they can.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from diffsynth_qie.commands import edit as edit_command
from diffsynth_qie.inference.editor import EditRequest
from diffsynth_qie.ui import history as hist
from diffsynth_qie.ui import settings as table
from diffsynth_qie.ui.config import UIConfig
from diffsynth_qie.ui.handlers import NO_LORA, GenerateInputs, UIHandlers
from diffsynth_qie.ui.results import PNG_KEY, EditSettings, qie_edit_command

W, H = 64, 48
STATES = ("history", "queued_at", "current")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    edit_command.add_arguments(parser)  # `qie edit`'s own flags
    return parser


def _distinct(mode: str) -> dict:
    """A value per setting, none of them a default, no two numbers alike (a crossed pair shows)."""
    painted = np.zeros((H, W, 4), np.uint8)
    painted[4:20, 4:30] = (255, 0, 255, 255)
    return dict(
        prompt="turn the square teal", negative_prompt="blurry edges", mode=mode, steps=7, lbm_steps=3, cfg=2.5,
        seed=123, cache="balanced", variations=2, live_preview=2, lora="a.safetensors", lora_scale=0.35, lora2="b.safetensors", lora2_scale=-0.45,
        mask_grow=3, width=48, height=32, strength=0.55, mask_blend=0.65, mask_feather=1.5, mask_invert=True,
        editor={"background": Image.new("RGB", (W, H), (30, 60, 90)), "layers": [Image.fromarray(painted, "RGBA")],
                "composite": None},
        references=None, mask_file=None, loaded_image=None)


class FakeEditor:
    """Records every EditRequest; returns a plain image (LBM: a sub-stream too)."""

    def __init__(self):
        self.requests: list[EditRequest] = []

    def set_loras(self, loras):
        self.loras = list(loras)

    def edit(self, request: EditRequest):
        self.requests.append(request)
        image = Image.new("RGB", request.images[0].size, (request.seed % 256, 0, 0))
        return SimpleNamespace(image=image, sub_image=image if request.lbm_steps else None)


@pytest.fixture
def ui(tmp_path):
    pytest.importorskip("gradio")
    loras = tmp_path / "loras"
    loras.mkdir()
    for name in ("a", "b"):
        save_file({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 4),
                   "blocks.0.attn.to_q.lora_B.weight": torch.zeros(4, 2)}, str(loras / f"{name}.safetensors"))
    fake = FakeEditor()
    handlers = UIHandlers(UIConfig(lora_dir=str(loras), examples="", temp_dir=str(tmp_path / "temp"),
                                   outputs_dir=str(tmp_path / "outputs")),
                          editor_factory=lambda: fake)
    return handlers, fake


def _event(demo, name):
    (fn,) = [f for f in demo.fns.values() if f.name == name]
    return fn


def flow_problems(demo, fake: FakeEditor, given: dict) -> list[str]:
    """Run Generate through ``demo``'s real events with ``given`` (by widget elem_id) and list every setting whose
    value did not arrive where the table says: the EditRequest, the record, the PNG, the command, the restore."""
    problems: list[str] = []
    run, precheck, restore = _event(demo, "run"), _event(demo, "precheck"), _event(demo, "restore")
    by_id = {s.elem_id: s.name for s in table.SETTINGS}
    cb = run.fn.__self__
    names = {component: cb._names[component] for component in run.inputs}
    widget_ids = {c.elem_id for c in run.inputs if names[c] not in STATES}
    if widget_ids != set(by_id) or {c.elem_id for c in precheck.inputs} != set(by_id):
        problems.append(f"Generate's inputs are not the table's widgets: {sorted(widget_ids ^ set(by_id))}")
    values = {c: given[by_id[c.elem_id]] if names[c] not in STATES else {"history": [], "queued_at": None, "current": None}[names[c]]
              for c in run.inputs}
    precheck.fn({c: v for c, v in values.items() if c in precheck.inputs}, None)
    fake.requests.clear()
    *_, last = run.fn(values, None, lambda *a, **k: None)  # a generator: live previews, then the result
    out = dict(zip(run.outputs, last))
    history = out[next(c for c in run.inputs if names[c] == "history")]
    lbm = given["mode"] == table.MODE_LBM

    # the EditRequest: every EditRequest field a setting is named after, with that setting's widget value
    request = fake.requests[0]
    for f in dataclasses.fields(EditRequest):
        if f.name in given and f.name != "images":
            want = given[f.name] if (f.name != "lbm_steps" or lbm) else None
            if getattr(request, f.name) != want:
                problems.append(f"EditRequest.{f.name} = {getattr(request, f.name)!r}, its widget gave {want!r}")
    if [r.seed for r in fake.requests] != [given["seed"] + i for i in range(given["variations"])]:
        problems.append(f"variation seeds {[r.seed for r in fake.requests]}")

    # the record, the PNG's text, the command
    entry = history[0]
    for name in table.RECORDED:
        want = given[name] if (name != "lbm_steps" or lbm) else 1
        if getattr(entry.settings, name) != want:
            problems.append(f"record {name} = {getattr(entry.settings, name)!r}, its widget gave {want!r}")
    with Image.open(entry.image) as im:
        text = dict(im.text)
    if EditSettings.from_json(json.loads(text[PNG_KEY])) != entry.settings or text["parameters"] != \
            entry.settings.summary():
        problems.append("the PNG's text is not the record")
    args = _parser().parse_args(shlex.split(entry.command)[2:])
    for f in dataclasses.fields(EditRequest):  # `qie edit` gives EditRequest(<name>=args.<name>)
        if hasattr(args, f.name) and f.name in given and f.name not in ("images", "mask") and \
                getattr(args, f.name) not in (None, getattr(request, f.name)) and \
                not (lbm and f.name in ("steps", "cfg")):
            problems.append(f"qie edit --{f.name} {getattr(args, f.name)!r}, the UI's request had "
                            f"{getattr(request, f.name)!r}")
    if args.lora_scale != [given["lora_scale"], given["lora2_scale"]] or \
            [p.rsplit("/", 1)[-1] for p in args.lora] != [given["lora"], given["lora2"]]:
        problems.append(f"qie edit --lora {args.lora} --lora_scale {args.lora_scale}")

    # the restore: each restored widget (by elem_id) gets its value back
    restored = restore.fn(history, None, None, SimpleNamespace(index=0))
    for component, value in zip(restore.outputs, restored):
        name = by_id.get(getattr(component, "elem_id", None))
        value = value.get("value", value) if isinstance(value, dict) else value
        if name in table.RESTORED and value != getattr(entry.settings, name):
            problems.append(f"restore put {value!r} into {name}, the record has {getattr(entry.settings, name)!r}")
    return problems


@pytest.mark.parametrize("mode", [table.MODE_FLOW, table.MODE_LBM])
def test_every_widget_reaches_its_request_record_command_and_restore(ui, mode):
    from diffsynth_qie.ui.app import build_ui

    handlers, fake = ui
    assert flow_problems(build_ui(handlers), fake, _distinct(mode)) == []


def test_crossed_widgets_are_caught(ui, monkeypatch):
    """Two same-default widgets crossed in the layout (what once passed every test) make the flow check fail."""
    from diffsynth_qie.ui import app

    handlers, fake = ui
    real = app.build_widget
    crossed = {"strength": "mask_blend", "mask_blend": "strength"}  # both sliders 0..1, default 1
    monkeypatch.setattr(app, "build_widget", lambda name, **kw: real(crossed.get(name, name), **kw))
    problems = flow_problems(app.build_ui(handlers), fake, _distinct(table.MODE_FLOW))
    assert any("EditRequest.strength" in p for p in problems) and any("EditRequest.mask_blend" in p for p in problems)


def test_request_fields_exist_and_every_namesake_is_declared():
    fields = {f.name for f in dataclasses.fields(EditRequest)}
    declared = {s.name for s in table.SETTINGS if s.request}
    assert declared <= fields, declared - fields
    # a setting named like an EditRequest field must feed it (else the sampler silently uses its own default)
    assert fields & set(table.SETTING) - {"mask"} == declared


@pytest.mark.parametrize("mode", table.MODES)
def test_cli_flags_exist_in_qie_edit_and_parse_back(mode, tmp_path):
    parser = _parser()
    given = {k: v for k, v in _distinct(mode).items() if k in table.RECORDED}
    settings = EditSettings(model="tiny", **given)
    outs = str(Path("outs").absolute())  # the command names files by absolute paths
    ctx = table.CommandContext(lora_dir=outs, has_mask=True)
    command = qie_edit_command(settings, "in.png", "mask.png", lora_dir=outs, out="o.png")
    args = parser.parse_args(shlex.split(command)[2:])
    options = parser._option_string_actions
    request = table.request_fields(settings)
    emitted = 0
    for s in table.SETTINGS:
        if not s.flag:
            continue
        assert s.flag in options, f"{s.name}: qie edit has no {s.flag}"
        action = options[s.flag]
        if s.request:  # qie edit gives EditRequest(<name>=args.<name>): the flag must be that name's
            assert action.dest == s.name, (s.name, s.flag, action.dest)
        if not s.flag_when(settings, ctx):
            continue
        emitted += 1
        text = s.cli_value(settings, ctx)
        want = action.type(text) if action.type else text
        parsed = getattr(args, action.dest)
        assert want in parsed if isinstance(parsed, list) else parsed == want, (s.name, parsed, want)
        if s.request and request[s.name] is not None:
            assert parsed == request[s.name], (s.name, parsed, request[s.name])
    assert emitted >= 10
    assert (args.scheduler == "lightning") == (mode == table.MODE_LIGHTNING)
    assert (args.lbm_steps == 3) == (mode == table.MODE_LBM)


def test_restore_list_is_the_restorable_settings_and_round_trips():
    assert hist.RESTORED == tuple(s.name for s in table.SETTINGS if s.restore)
    assert set(hist.RESTORED) <= set(table.RECORDED)  # a restore needs the record to hold the value
    assert {f.name for f in dataclasses.fields(EditSettings)} == {"model", *table.RECORDED}
    assert {f.name for f in dataclasses.fields(GenerateInputs)} == set(table.INPUT_NAMES)
    given = {k: v for k, v in _distinct(table.MODE_LBM).items() if k in table.RECORDED}
    entry = hist.HistoryEntry(image="r.png", before="b.png", settings=EditSettings(model="tiny", **given))
    values = dict(zip(hist.RESTORED, hist.restore(entry, [NO_LORA, "a.safetensors", "b.safetensors"])))
    assert values == {name: given[name] for name in hist.RESTORED}


def test_widgets_are_built_from_their_rows():
    gr = pytest.importorskip("gradio")
    for s in table.SETTINGS:
        extra = {"choices": [(NO_LORA, NO_LORA)]} if s.widget in ("Dropdown", "Radio") else {}
        with gr.Blocks():
            widget = table.build_widget(s.name, **extra)
        assert widget.elem_id == s.elem_id and type(widget).__name__ == s.widget
        if s.default not in (table.REQUIRED, None) and "value" not in s.options:
            assert widget.value == s.default, s.name
