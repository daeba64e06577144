"""The loss registry: ``--loss NAME`` -> :class:`~.spec.LossSpec` (function, config, capabilities).

Its own module so that the losses never import each other: ``sft.py`` and ``lbm.py`` each declare
their ``SPEC`` and build on ``common.py``; only this module knows them all. Adding a loss: a module
with its function, config and ``SPEC``, and one entry in :data:`LOSSES` (``docs/DEVELOPING.md``).
Torch-free at import (the losses import torch when called).
"""
from __future__ import annotations

from . import dmd, dpo, lbm, nft, sft
from .spec import LossSpec

LOSSES: dict[str, LossSpec] = {spec.name: spec for spec in (sft.SPEC, lbm.SPEC, dpo.SPEC, nft.SPEC, dmd.SPEC)}


def register(spec: LossSpec) -> LossSpec:
    """Add ``spec`` to :data:`LOSSES` (a name may be registered once)."""
    if spec.name in LOSSES and LOSSES[spec.name] is not spec:
        raise ValueError(f"a loss named {spec.name!r} is already registered")
    LOSSES[spec.name] = spec
    return spec


def loss_names() -> list[str]:
    """The ``--loss`` choices, in registration order."""
    return list(LOSSES)


def loss_spec(name: str) -> LossSpec:
    """The registered loss ``name``; ``ValueError`` naming the choices otherwise."""
    if name not in LOSSES:
        raise ValueError(f"--loss {name!r} is not available in this build; choose one of: {', '.join(LOSSES)}")
    return LOSSES[name]


def get_loss(name: str):
    """The loss function of ``--loss name``."""
    return loss_spec(name).fn


def loss_help() -> str:
    """``--loss``'s help: each registered loss with its one-line summary."""
    return "; ".join(f"{s.name}: {s.summary}" for s in LOSSES.values())
