"""No command writes over what it reads: an output path that is one of its inputs is refused before anything
is read or written.

Each command module names its input flags in ``INPUTS`` (argparse destinations: a path, or a list of paths
for a repeatable flag; ``FILE:SCALE`` values are read up to the last colon when the whole is no file) and its
outputs in ``OUTPUTS`` (``file``: the path itself is written; ``dir`` / ``tree``: a directory written into)
and, for a directory, optionally in ``WRITES`` (the names of the files it writes there). ``cli.main`` calls
:func:`refuse_inputs_as_outputs` for every command; ``tests/test_output_guard.py`` checks every command that
writes declares its inputs and is refused.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence


def _existing(value) -> Optional[Path]:
    """The existing path a flag's value names (``FILE:SCALE``: the file), or None."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        return None
    p = Path(value).expanduser()
    if p.exists():
        return p
    head, sep, _ = str(value).rpartition(":")
    return Path(head).expanduser() if sep and head and Path(head).expanduser().exists() else None


def _values(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def same_path(a: Path, b: Path) -> bool:
    """Whether two paths name one file or directory (links and relative spellings included)."""
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def input_paths(args, inputs: Iterable[str]) -> list[tuple[str, Path]]:
    """``(flag, path)`` for every existing path the ``inputs`` flags of ``args`` name."""
    out = []
    for dest in inputs:
        for v in _values(getattr(args, dest, None)):
            p = _existing(v)
            if p is not None:
                out.append((dest, p))
    return out


def output_paths(args, outputs: Mapping[str, str], writes: Mapping[str, Sequence[str]] = {}
                 ) -> list[tuple[str, Path]]:
    """``(flag, path)`` for every path a command writes that an input may be: each ``file`` output, each
    ``dir``/``tree`` output itself, and the named files it writes into a directory."""
    out = []
    for dest in {**outputs, **{d: "dir" for d in writes}}:
        for v in _values(getattr(args, dest, None)):
            if not v or not isinstance(v, (str, os.PathLike)):
                continue
            out.append((dest, Path(v).expanduser()))
            out += [(dest, Path(v).expanduser() / name) for name in writes.get(dest, ())]
    return out


def refuse_inputs_as_outputs(args, inputs: Iterable[str], outputs: Mapping[str, str],
                             writes: Mapping[str, Sequence[str]] = {}, names: Mapping[str, str] = {}) -> None:
    """ValueError naming both flags (``names``: destination -> how the user spells it) when an output path is
    one of the inputs: a file written over a file it reads, e.g. ``--write_clean`` on its own metadata, would
    lose what it was read from. (A flag that is both read and written by design, as ``qie report``'s run
    directory, is not compared with itself.)"""
    ins = input_paths(args, inputs)
    for out_dest, out in output_paths(args, outputs, writes):
        for in_dest, src in ins:
            if in_dest != out_dest and same_path(out, src):
                raise ValueError(f"{names.get(out_dest, '--' + out_dest)} {out} is the input "
                                 f"{names.get(in_dest, '--' + in_dest)} {src}: it would be written over while it "
                                 "is read; write to another path")
