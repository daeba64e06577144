"""The ``--model`` flag of every command, derived from :data:`~.presets.PRESETS`.

:func:`preset_type` is the flag's argparse ``type``: a preset's name or any of its aliases becomes the
preset's name, anything else a one-line usage error listing the valid names. :func:`preset_help` and
:func:`preset_list` write the presets into help texts. A preset added to ``presets.py`` therefore shows up
in every command's ``--model`` and ``--help`` with no other edit. Pure data, like ``presets.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, Optional

from .family import get_family
from .presets import ALIASES, PRESETS, Preset, get_preset

Accepts = Optional[Callable[[Preset], object]]
_DEFAULT_LICENCE = next(f.default for f in dataclasses.fields(Preset) if f.name == "licence")


def preset_names_where(accepts: Accepts = None) -> list[str]:
    """Preset names (registry order), those for which ``accepts(preset)`` is true when given."""
    return [name for name, preset in PRESETS.items() if accepts is None or accepts(preset)]


def preset_list(accepts: Accepts = None, conjunction: str = "and") -> str:
    """``"a, b and c"``: the presets ``accepts`` keeps, for a sentence of help text."""
    names = preset_names_where(accepts)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


def _an_alias(names: list[str]) -> str:
    return next((alias for alias, name in ALIASES.items() if name in names and name != alias), names[0])


def preset_type(accepts: Accepts = None, what: str = "model preset") -> Callable[[str], str]:
    """An argparse ``type`` for ``--model``: a preset's name or alias -> the preset's name.

    ``accepts`` narrows the presets a command takes (e.g. ``lambda p: p.provider``: those built locally).
    """
    names = preset_names_where(accepts)

    def preset(text: str) -> str:
        try:
            name = get_preset(text).name
        except ValueError:
            name = None
        if name not in names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r}; choose one of {', '.join(names)} (or an alias, e.g. {_an_alias(names)})")
        return name

    preset.qie_presets = tuple(names)
    return preset


def preset_help(accepts: Accepts = None, what: str = "model preset") -> str:
    """``--model``'s help: the presets by family, aliases, and any licence other than the default."""
    names = preset_names_where(accepts)
    by_family: dict[str, list[str]] = {}
    by_licence: dict[str, list[str]] = {}
    for name in names:
        preset = PRESETS[name]
        by_family.setdefault(get_family(preset.family).label, []).append(name)
        if preset.licence != _DEFAULT_LICENCE:
            by_licence.setdefault(preset.licence, []).append(name)
    families = "; ".join(f"{', '.join(group)} ({label})" for label, group in by_family.items())
    licences = "".join(f"; {', '.join(group)}: {licence}" for licence, group in by_licence.items())
    return f"{what}: {families}, or an alias such as {_an_alias(names)}{licences}"
