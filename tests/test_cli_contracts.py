"""Lists that must agree, checked against each other instead of against today's values.

- every number flag of every ``qie`` command and of ``app_gradio.py`` declares its range at the flag;
- every ``--model`` flag takes every preset's name and aliases the same way, and its help names them;
- ``make-tiny`` builds exactly the presets that have a provider;
- the README's command table is ``cli.COMMANDS``; each command's ``OUTPUTS`` names its own flags;
- ``qie plan --zero_stage`` and the launcher's choice name shipped DeepSpeed configs;
- the launchers' environment variables are documented; the package docstring lists the sub-packages.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

import diffsynth_qie
from diffsynth_qie.cli import COMMANDS, build_parser
from diffsynth_qie.models.presets import ALIASES, PRESETS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(diffsynth_qie.__file__).resolve().parent


def _ui_parser() -> argparse.ArgumentParser:
    sys.path.insert(0, str(ROOT))
    import app_gradio

    return app_gradio.build_parser()


def _commands() -> dict[str, argparse.ArgumentParser]:
    """``qie`` subcommand name -> its parser, and ``app_gradio.py``'s parser as ``"app_gradio.py"``."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {**sub.choices, "app_gradio.py": _ui_parser()}


def _flag(parser: argparse.ArgumentParser, option: str) -> argparse.Action | None:
    return next((a for a in parser._actions if option in a.option_strings), None)


def _is_number(action: argparse.Action) -> bool:
    return action.type in (int, float) or getattr(action.type, "qie_checked", False)


# --- bounds -------------------------------------------------------------------------------------------------
def test_every_number_flag_declares_its_range_at_the_flag():
    numbers = [(name, action) for name, parser in _commands().items() for action in parser._actions
               if _is_number(action)]
    assert len({name for name, _ in numbers}) >= 10  # the walk reached the commands
    undeclared = [f"{name} {action.option_strings[0]}" for name, action in numbers
                  if not getattr(action.type, "qie_declared", False) and not action.choices]
    assert not undeclared, (
        f"{undeclared}: declare each flag's range where it is defined: type=checked(int, lo, hi) (utils/cli_checks.py) "
        "or cli_help(..., min=, max=) on a config field; type=checked(float) / cli_help(..., unbounded=True) when "
        "no bound makes sense")


def test_a_declared_range_is_enforced_with_a_usage_error_naming_the_flag(capsys):
    for name, parser in _commands().items():
        for action in parser._actions:
            lo, hi = getattr(action.type, "qie_bounds", (None, None))
            for bad in ([lo - 1] if lo is not None else []) + ([hi * 2 + 1] if hi is not None else []):
                with pytest.raises(argparse.ArgumentTypeError, match="out of range"):
                    action.type(str(bad))
            if getattr(action.type, "qie_kind", None) is float:
                with pytest.raises(argparse.ArgumentTypeError, match="not a finite number"):
                    action.type("nan")


# --- presets ------------------------------------------------------------------------------------------------
def _model_flags() -> dict[str, argparse.Action]:
    return {name: flag for name, parser in _commands().items() if (flag := _flag(parser, "--model"))}


def _accepted(action: argparse.Action, text: str) -> str | None:
    if action.choices is not None:
        return text if text in action.choices else None
    try:
        return action.type(text) if action.type else text
    except (argparse.ArgumentTypeError, ValueError):
        return None


def test_the_model_flags_were_found():
    assert {"edit", "cache", "train", "plan", "eval-edits", "app_gradio.py"} <= set(_model_flags())


@pytest.mark.parametrize("command", sorted(_model_flags()))
def test_every_model_flag_takes_a_preset_by_name_or_alias(command):
    action = _model_flags()[command]
    taken = [name for name in PRESETS if _accepted(action, name) == name]
    assert taken, f"{command} --model takes no preset"
    for alias, name in ALIASES.items():
        if name in taken:
            assert _accepted(action, alias) == name, f"{command} --model {alias} (an alias of {name})"
            assert _accepted(action, alias.upper()) == name
    assert _accepted(action, "no-such-preset") is None


@pytest.mark.parametrize("command", sorted(_model_flags()))
def test_every_model_flag_help_names_the_presets_it_takes(command):
    action = _model_flags()[command]
    help_text = action.help or ""
    taken = [name for name in PRESETS if _accepted(action, name) == name]
    missing = [name for name in taken if not re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", help_text)]
    assert not missing, f"{command} --model help lacks {missing}: derive it with models/preset_flags.preset_help"


def test_make_tiny_builds_exactly_the_presets_with_a_provider():
    action = _model_flags()["make-tiny"]
    taken = {name for name in PRESETS if _accepted(action, name) == name}
    assert taken == {name for name, preset in PRESETS.items() if preset.provider}
    assert all(PRESETS[name].is_tiny for name in taken)


# --- commands -----------------------------------------------------------------------------------------------
def test_the_readme_command_table_is_the_cli_command_table():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Commands", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `qie ([\w-]+)` \|", section, flags=re.M)
    assert sorted(listed) == sorted(COMMANDS) and len(listed) == len(set(listed))


def test_every_command_outputs_entry_names_one_of_its_flags():
    for name, parser in _commands().items():
        outputs = parser.get_default("_outputs") or {}
        dests = {a.dest for a in parser._actions}
        for dest, kind in outputs.items():
            assert dest in dests, f"qie {name}: OUTPUTS names {dest!r}, which is none of its flags"
            assert kind in ("file", "dir", "tree"), f"qie {name}: OUTPUTS[{dest!r}] = {kind!r}"


# --- launchers ----------------------------------------------------------------------------------------------
def test_every_zero_stage_plan_offers_is_a_shipped_deepspeed_config():
    stages = _flag(_commands()["plan"], "--zero_stage").choices
    assert stages
    for stage in (s for s in stages if s):
        for suffix in (".yaml", ".json"):
            assert (ROOT / "deepspeed_configs" / f"zero{stage}{suffix}").is_file(), (stage, suffix)
    launch_lib = (ROOT / "scripts" / "launch_lib.sh").read_text()
    assert "deepspeed_configs/$(choose_zero" in launch_lib  # the launcher takes plan's zero{stage}.yaml as is
    for name in re.findall(r"deepspeed_configs/([\w.-]+\.(?:yaml|json))", launch_lib):
        assert (ROOT / "deepspeed_configs" / name).is_file(), name


def _launcher_sources() -> str:
    return "\n".join(p.read_text() for p in [ROOT / "scripts" / "launch_lib.sh", *sorted(ROOT.glob("*.sh"))])


def _environment(sources: str) -> set[str]:
    """Variables the launchers read from the environment: read with a default (``${VAR:-...}``) before any line
    sets them from something else (``GPU_COUNT="$gpus"`` is the launcher's own)."""
    found: dict[str, bool] = {}
    for line in sources.splitlines():
        for var in re.findall(r"\$\{([A-Z][A-Z0-9_]*)(?::-|-|\+|:=|:\+)", line):
            found.setdefault(var, True)
        set_here = re.match(r"\s*(?:local\s+)?([A-Z][A-Z0-9_]*)=", line)
        if set_here and f"${{{set_here.group(1)}" not in line:
            found.setdefault(set_here.group(1), False)
    return {var for var, from_environment in found.items() if from_environment}


def test_the_launchers_environment_is_documented():
    read = _environment(_launcher_sources())
    assert {"MODEL", "DS_CONFIG", "NUM_GPUS"} <= read
    launch_lib = (ROOT / "scripts" / "launch_lib.sh").read_text()
    header = launch_lib.split("\nset -euo pipefail", 1)[0]
    readme = (ROOT / "README.md").read_text()
    undocumented = sorted(v for v in read if not re.search(rf"\b{v}\b", header + readme))
    assert not undocumented, f"{undocumented}: document them in scripts/launch_lib.sh's header"
    listed = re.search(r"Launcher environment:(.*?)\n\n", readme, flags=re.S).group(1)
    stale = sorted(set(re.findall(r"`([A-Z][A-Z0-9_]+)`", listed)) - read)
    assert not stale, f"the README's launcher environment names {stale}, which no launcher reads"


def test_the_package_docstring_and_the_developer_guide_list_the_sub_packages():
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert set(re.findall(r"^- ``(\w+)``", diffsynth_qie.__doc__, flags=re.M)) == subpackages
    guide = (ROOT / "docs" / "DEVELOPING.md").read_text()
    table = guide.split("| package | what it owns and what it may import |", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"^\| `(\w+)/` \|", table, flags=re.M)) == subpackages
