"""Turn typed config dataclasses into argparse flags, and back.

Every field becomes ``--<prefix><name>``; the field's type decides parsing:
``bool`` -> ``--flag/--no-flag``, ``list[T]``/``tuple[T,...]`` -> ``nargs='+'``,
``Optional[T]`` -> T with default None, ``Literal[...]``/``Enum`` -> ``choices`` (or
``cli_help(..., choices=fn)``: ``fn()``'s names, read when the parser is built).
Help text comes from ``field(metadata={"help": ...})``; parsers show defaults with
``argparse.ArgumentDefaultsHelpFormatter`` (as ``qie`` and ``app_gradio.py`` do).
A number field declares its range in the same metadata (``cli_help(..., min=0, max=1)``, or
``unbounded=True``; see ``utils/cli_checks.py``); ``type=`` gives a field a parser of its own.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")


def cli_help(text: str, **extra: Any) -> dict:
    """A config field's ``metadata``: ``field(default=..., metadata=cli_help("what it does"))``."""
    return {"help": text, **extra}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _add_field(parser: argparse.ArgumentParser | argparse._ArgumentGroup, f: dataclasses.Field, hints: dict, prefix: str) -> None:
    name = f"--{prefix}{f.name}"
    tp, optional = _unwrap_optional(hints[f.name])
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = f.default_factory()  # type: ignore[misc]
    else:
        default = None
    help_text = f.metadata.get("help", "")
    kwargs: dict[str, Any] = {"dest": f"{prefix}{f.name}", "default": default}
    origin = get_origin(tp)
    if tp is bool:
        parser.add_argument(name, action=argparse.BooleanOptionalAction, help=help_text, **kwargs)
        return
    if origin in (list, tuple):
        inner = get_args(tp)[0] if get_args(tp) else str
        kwargs.update(nargs="+", type=inner)
    elif origin is Literal:
        kwargs.update(choices=list(get_args(tp)), type=type(get_args(tp)[0]))
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        kwargs.update(choices=[e.value for e in tp], type=str)
        if isinstance(default, enum.Enum):
            kwargs["default"] = default.value
    else:
        kwargs["type"] = tp
    if kwargs.get("type") in (int, float):  # a number: its range is declared here (min=/max=, or unbounded=True)
        from .cli_checks import checked

        declared = any(key in f.metadata for key in ("min", "max", "unbounded"))
        kwargs["type"] = checked(kwargs["type"], f.metadata.get("min"), f.metadata.get("max"), declared=declared)
    if f.metadata.get("type"):  # a parser of its own, e.g. --model's preset names and aliases
        kwargs["type"] = f.metadata["type"]
    if "choices" in f.metadata:  # a registry's names (a callable: read when the parser is built)
        choices = f.metadata["choices"]
        kwargs["choices"] = list(choices() if callable(choices) else choices)
    if f.metadata.get("metavar"):
        kwargs["metavar"] = f.metadata["metavar"]
    parser.add_argument(name, help=help_text, **kwargs)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "", title: str | None = None) -> None:
    """Add one flag per field of dataclass ``cls`` (in a group titled ``title``)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title or cls.__name__, (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli", True):
            _add_field(group, f, hints, prefix)


def dataclass_from_args(cls: type[T], args: argparse.Namespace, prefix: str = "") -> T:
    """Build ``cls`` from parsed args (fields without a flag keep their defaults)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if not hasattr(args, key):
            continue
        value = getattr(args, key)
        tp, _ = _unwrap_optional(hints[f.name])
        if isinstance(tp, type) and issubclass(tp, enum.Enum) and value is not None:
            value = tp(value)
        if get_origin(tp) is tuple and value is not None:
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)  # type: ignore[call-arg]
