"""`qie export-lora --format` and the export targets table agree, and a target's options are its own."""
from __future__ import annotations

import argparse
import inspect

import pytest

from diffsynth_qie.commands import export_lora as command
from diffsynth_qie.lora.export_targets import EXPORT_TARGETS, export_target


def _format_action():
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return next(a for a in parser._actions if a.dest == "fmt")


def test_the_format_choices_and_help_are_the_table():
    action = _format_action()
    assert list(action.choices) == list(EXPORT_TARGETS)
    assert all(f"{name}:" in action.help for name in EXPORT_TARGETS)


@pytest.mark.parametrize("name", sorted(EXPORT_TARGETS))
def test_every_target_writer_resolves_and_takes_its_options(name):
    target = export_target(name)
    params = inspect.signature(target.write_fn()).parameters
    assert list(params)[0] == "state"
    assert set(target.options) <= set(params), f"{name}: {target.writer} lacks {target.options}"


def test_an_unknown_format_or_foreign_option_is_named(tmp_path):
    from diffsynth_qie.lora.export import export_lora

    with pytest.raises(ValueError, match="unknown export format 'onnx'.*comfyui"):
        export_target("onnx")
    with pytest.raises(ValueError, match="--drop_full_weights does not apply to --format comfyui.*diffusers"):
        export_lora(tmp_path / "missing.safetensors", tmp_path / "out.safetensors", "comfyui", drop_full_weights=True)
