"""Growth across repeated work: device memory still held after a unit of work that repeats (a training step,
an edit in the UI's loop) beyond what the same unit left before it.

On a GPU such growth is a slow leak: a cache, list or dict that keeps each step's tensors on the device runs out
of memory hundreds of steps into a run, long after any one-step check passed. The preflights run the unit a few
times on other samples and compare what is live after the last two (:func:`settled`). What
grew is named twice: by the lines of our code that allocated it (``accounting.allocating_frame``), and, searched
only when something grew, by the object of our code that still holds it (``Class.attribute`` and the class's
file:line: the first instance of one of our classes found whose attributes reach the new tensors, through dicts,
lists, tuples and our own objects, a few levels deep).
"""
from __future__ import annotations

import gc
import inspect
import os
import warnings
from collections import Counter

import torch

from .accounting import PROJECT_DIR, Held, grown, is_device
from .ops import FakeRunError

MiB = 1024 ** 2
_OWN = ("diffsynth_qie.",)
_RUNNERS = ("diffsynth_qie.fakegpu.", "diffsynth_qie.preflight.")  # their subclasses are named by the class they extend
_DEPTH, _ITEMS = 4, 4096


def settled(memory) -> Held:
    """``memory.snapshot()`` once the garbage collector has run: tensors that only a reference cycle keeps (an
    exception's frames, a closure) are freed at a moment Python chooses, so without it two snapshots differ by
    chance."""
    gc.collect()
    return memory.snapshot()


def check_growth(before: Held, after: Held, unit: str, previous: str, shown: int = 3) -> None:
    """Raise :class:`FakeRunError` when the snapshot ``after`` (taken after ``unit``, e.g. "step 3") holds more
    device bytes than ``before`` (after ``previous``), naming the frames that grew, largest first, and what holds
    the new storages."""
    total = after.total - before.total
    more = grown(before, after)
    if total <= 0 or not more:
        return
    kind = unit.split()[0]
    named = ", ".join(f"{where} (+{b / MiB:.1f} MiB)" for where, b in more[:shown])
    rest = f" and {len(more) - shown} more" if len(more) > shown else ""
    held = holders(after.storages - before.storages)
    by = f"; held by {', '.join(held[:shown])}" if held else ""
    raise FakeRunError(
        f"device memory grows from one {kind} to the next: after {unit} {total / MiB:.1f} MiB more is held than "
        f"after {previous}, allocated at {named}{rest}{by}; something keeps each {kind}'s tensors on the GPU (a "
        "cache, list or dict that is never emptied), so a long run runs out of memory; drop them after use, bound "
        "the cache, or keep them on the host")


def holders(storages: frozenset) -> list[str]:
    """``Class.attribute (file:line)`` of the outermost objects of our code whose attributes hold tensors of
    ``storages``, most bytes first (one pass over the garbage collector's objects: a failure path only). The
    fake runs' own objects (``fakegpu``, ``preflight``) are not holders, unless they extend one of our classes."""
    if not storages:
        return []
    found: Counter = Counter()
    inner: set[int] = set()
    owners: dict[tuple, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            cls = type(obj)
            if issubclass(cls, type) or _holder_class(cls) is None:
                continue
            attributes = getattr(obj, "__dict__", None)
            if not isinstance(attributes, dict):
                continue
            for name, value in list(attributes.items()):
                seen: set[int] = set()
                held = _held(value, storages, _DEPTH, seen)
                if held:
                    found[(id(obj), name)] += held
                    owners[(id(obj), name)] = obj
                    inner |= seen
    return [_name(owners[key], key[1]) for key, _ in found.most_common() if key[0] not in inner]


def _holder_class(cls):
    """The first class of ``cls``'s MRO in our code outside the fake runs, or None."""
    return next((c for c in cls.__mro__ if c.__module__.startswith(_OWN) and not c.__module__.startswith(_RUNNERS)),
                None)


def _held(value, storages: frozenset, depth: int, seen: set) -> int:
    """Bytes of ``storages`` reachable from ``value``; ``seen`` gets the ids of our objects passed through."""
    if isinstance(value, torch.Tensor):
        if not is_device(value):
            return 0
        storage = value.untyped_storage()
        return storage.nbytes() if id(storage) in storages else 0
    if depth <= 0:
        return 0
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif type(value).__module__.startswith(_OWN) and isinstance(getattr(value, "__dict__", None), dict) \
            and not isinstance(value, torch.nn.Module):
        seen.add(id(value))
        items = value.__dict__.values()
    else:
        return 0
    return sum(_held(v, storages, depth - 1, seen) for i, v in enumerate(items) if i < _ITEMS)


def _name(obj, attribute: str) -> str:
    """``Class.attribute (file:line)``: the class that holds it (a run's subclass named by the class it extends)."""
    cls = _holder_class(type(obj))
    try:
        where = f" ({os.path.relpath(inspect.getsourcefile(cls), PROJECT_DIR)}:{inspect.getsourcelines(cls)[1]})"
    except (OSError, TypeError):
        where = ""
    return f"{cls.__name__}.{attribute}{where}"
