"""Number flags checked where the command line meets the code: finite values within the bounds declared at the flag.

Each number flag declares its range where it is defined: ``type=checked(int, 0, 64)`` at a plain argparse
flag, ``cli_help(..., min=0, max=64)`` on a config dataclass field (``utils/config_cli.py``). A flag that is
unbounded by design says so: ``type=checked(float)``, or ``cli_help(..., unbounded=True)``. A bad value is then
argparse's own one-line usage error naming the flag (exit 2), before anything loads.

:func:`check_numbers` is the safety net run over a whole parser (every ``qie`` command and ``app_gradio.py``):
a ``float`` flag that declared nothing is still refused ``nan``/``inf``. ``tests/test_cli_contracts.py`` fails
on any number flag that declared nothing, so a new one cannot skip its bounds silently.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Optional

INT64_MAX = 2 ** 63 - 1  # the highest seed (torch generators take a signed 64-bit seed)


def checked(kind: Callable, lo: Optional[float] = None, hi: Optional[float] = None, *,
            declared: bool = True) -> Callable:
    """An argparse ``type``: ``kind(text)``, finite, and within ``[lo, hi]`` (``None``: unbounded on that side).

    ``declared=False`` marks a wrapper that :func:`check_numbers` added to a flag that declared no range.
    """
    def parse(text: str):
        value = kind(text)
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            span = f"from {lo} to {hi}" if lo is not None and hi is not None else \
                (f"at least {lo}" if lo is not None else f"at most {hi}")
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a value {span}")
        return value

    parse.__name__ = getattr(kind, "__name__", "number")
    parse.qie_checked = True
    parse.qie_kind = kind
    parse.qie_bounds = (lo, hi)
    parse.qie_declared = declared
    return parse


def check_numbers(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Refuse ``nan``/``inf`` at every ``float`` flag of ``parser`` and its subcommands that declared no range."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                check_numbers(sub)
        elif action.type is float:
            action.type = checked(float, declared=False)
    return parser
