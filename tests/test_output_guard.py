"""No command writes over what it reads: every command that writes (``OUTPUTS`` / ``WRITES``) names its inputs
(``INPUTS``, real flags of its parser), and pointing any of its file outputs at any of its inputs is refused
with exit 2, naming both flags, before anything is written."""
from __future__ import annotations

import argparse
import importlib

import pytest

from diffsynth_qie.cli import COMMANDS, build_parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _writers() -> list[tuple[str, object]]:
    out = []
    for name, (module, _) in COMMANDS.items():
        mod = importlib.import_module(f"diffsynth_qie.commands.{module}")
        if getattr(mod, "OUTPUTS", None) or getattr(mod, "WRITES", None):
            out.append((name, mod))
    return out


def test_every_writing_command_declares_its_inputs_as_real_flags():
    subs = _subparsers()
    writers = _writers()
    assert {n for n, _ in writers} >= {"check-dataset", "make-dataset", "export-lora", "merge-lora", "extract-lora",
                                       "train", "cache", "edit", "eval-edits", "report"}
    for name, mod in writers:
        assert hasattr(mod, "INPUTS"), f"qie {name} writes files but declares no INPUTS"
        dests = {a.dest for a in subs[name]._actions}
        for dest in [*mod.INPUTS, *getattr(mod, "OUTPUTS", {}), *getattr(mod, "WRITES", {})]:
            assert dest in dests, f"qie {name}: {dest!r} is no flag of the command"


def _argv(name: str, parser: argparse.ArgumentParser, values: dict[str, str]) -> list[str]:
    """Every required argument filled (a choice's first, else a placeholder), ``values`` at their flags."""
    positionals, options = [], []
    for a in parser._actions:
        if a.dest in ("help", "verbose"):
            continue
        value = values.get(a.dest)
        if value is None and not (a.required or not a.option_strings):
            continue
        if value is None:
            value = str(list(a.choices)[0]) if a.choices else "placeholder"
        if a.option_strings:
            options += [a.option_strings[-1], value]
        else:
            positionals.append(value)
    return [name, *options, *positionals]


def _cases():
    subs = _subparsers()
    for name, mod in _writers():
        files = [d for d, kind in getattr(mod, "OUTPUTS", {}).items() if kind == "file"]
        files += [(d, f) for d, names in getattr(mod, "WRITES", {}).items() for f in names]
        for out in files:
            for src in mod.INPUTS:
                if (out[0] if isinstance(out, tuple) else out) != src:
                    yield pytest.param(name, subs[name], out, src, id=f"{name}:{out}={src}")


@pytest.mark.parametrize("name,parser,out,src", list(_cases()))
def test_an_output_that_is_an_input_is_refused(name, parser, out, src, tmp_path, capfd):
    from diffsynth_qie.cli import main

    victim = tmp_path / "input.file"
    if isinstance(out, tuple):  # a file the command writes into a directory flag
        out_dest, victim = out[0], tmp_path / out[1]
        values = {out_dest: str(tmp_path), src: str(victim)}
    else:
        out_dest = out
        values = {out_dest: str(victim), src: str(victim)}
    victim.write_bytes(b"the input's bytes")
    assert main(_argv(name, parser, values)) == 2
    assert victim.read_bytes() == b"the input's bytes"
    assert "it would be written over while it is read" in capfd.readouterr().err


@pytest.mark.parametrize("argv", [
    ["merge-lora", "{d}", "--lora", "x.safetensors", "--out", "{d}"],
    ["train", "--cache_dir", "{d}", "--output_dir", "{d}"],
])
def test_an_output_directory_that_is_an_input_is_refused(argv, tmp_path, capfd):
    from diffsynth_qie.cli import main

    (tmp_path / "keep.txt").write_text("x")
    assert main([a.format(d=tmp_path) for a in argv]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert "it would be written over while it is read" in capfd.readouterr().err
