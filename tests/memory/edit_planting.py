"""Helpers of the edit-side planting tests: plant a bug in a copy of one of our functions, at its real
file:line, and run Qwen-Image-2.1 under the fake device whatever ``models/family.py`` says today."""
from __future__ import annotations

import contextlib
import inspect
import os
import textwrap

import diffsynth_qie

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(diffsynth_qie.__file__)))


def plant(monkeypatch, owner, name: str, old: str, new: str, also=()) -> str:
    """Replace ``owner.name`` (a module's function or a class's method) by a copy whose source has ``old``
    replaced by ``new`` (on one line), compiled under the original file name and line numbers, so the fake
    device names the planted line as it would name the bug in our code. ``also``: modules that imported the
    function by name. Returns ``"diffsynth_qie/...py:LINE"`` of the planted line."""
    fn = inspect.unwrap(getattr(owner, name))
    lines, start = inspect.getsourcelines(fn)
    source = textwrap.dedent("".join(lines))
    assert source.count(old) == 1, f"{old!r} must occur once in {name}"
    line = start + source[:source.index(old)].count("\n")
    path = inspect.getsourcefile(fn)
    namespace = dict(fn.__globals__)
    exec(compile("\n" * (start - 1) + source.replace(old, new), path, "exec"), namespace)
    for target in (owner, *also):
        monkeypatch.setattr(target, name, namespace[name])
    return f"{os.path.relpath(path, PACKAGE_ROOT)}:{line}"


@contextlib.contextmanager
def qwen21_verified():
    """Qwen-Image-2.1 with its fake-device stand-in and full-size checks on (``Family.fake_standin``,
    ``fullsize_verify``), as ``models/family.py`` sets them once both are wired in; a no-op then."""
    from diffsynth_qie.models.family import QWEN21

    saved = {k: QWEN21.__dict__[k] for k in ("fake_standin", "fullsize_verify") if k in QWEN21.__dict__}
    if not getattr(QWEN21, "fake_standin", ""):
        object.__setattr__(QWEN21, "fake_standin", "diffsynth_qie.fakegpu.standin21.host_bookkeeping21")
    object.__setattr__(QWEN21, "fullsize_verify", True)
    try:
        yield QWEN21
    finally:
        for key in ("fake_standin", "fullsize_verify"):
            if key in saved:
                object.__setattr__(QWEN21, key, saved[key])
            else:
                object.__delattr__(QWEN21, key)


def line_of(fn, text: str) -> str:
    """``"diffsynth_qie/...py:LINE"`` of the one line of ``fn``'s source that contains ``text``."""
    fn = inspect.unwrap(fn)
    lines, start = inspect.getsourcelines(fn)
    found = [start + i for i, line in enumerate(lines) if text in line]
    assert len(found) == 1, f"{text!r} must occur on one line of {fn.__name__}: {found}"
    return f"{os.path.relpath(inspect.getsourcefile(fn), PACKAGE_ROOT)}:{found[0]}"
