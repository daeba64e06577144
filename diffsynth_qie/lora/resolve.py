"""Kohya names back to module paths, without a model: the module names of each family's DiT (DiffSynth's class,
one block on the meta device, as many blocks as the LoRA uses)."""
from __future__ import annotations

import functools
import re

import torch

from .state import LoraState


def _family_modules(state: LoraState, family: str) -> list[tuple[str, bool]]:
    """``(name, is a Linear)`` of a family's DiT's modules, with as many blocks as the LoRA uses."""
    # block indices of kohya (transformer_blocks_3_) and dotted (transformer_blocks.3.) names alike
    blocks = [int(m.group(1)) for k in [*state.modules, *state.full]
              for m in [re.match(r"transformer_blocks[._](\d+)[._]", k)] if m]
    return _modules_of(family, max(blocks, default=-1) + 1)


@functools.lru_cache(maxsize=16)
def _modules_of(family: str, blocks: int) -> list[tuple[str, bool]]:
    """DiffSynth's class of the family, one block built on the meta device, its names repeated for ``blocks``."""
    import inspect

    from ..models.family import get_family

    cls = get_family(family).component_type("dit")
    # every optional module too (Qwen-Image-Edit-2511's additional timestep embedding)
    kwargs = {"use_additional_t_cond": True} if "use_additional_t_cond" in inspect.signature(cls).parameters else {}
    with torch.device("meta"):
        dit = cls(num_layers=1, **kwargs)
    named = [(n, isinstance(m, torch.nn.Linear)) for n, m in dit.named_modules() if n]
    out = [(n, lin) for n, lin in named if not n.startswith("transformer_blocks")]
    for i in range(blocks):
        out += [(n.replace("transformer_blocks.0", f"transformer_blocks.{i}", 1), lin)
                for n, lin in named if n.startswith("transformer_blocks.0")]
    return out


def default_module_names(state: LoraState, family: str = "qwen-image-edit") -> list[str]:
    """Module names of a family's DiT (DiffSynth's class, one block, built on the meta device), for
    resolving kohya names when no model is at hand; as many blocks as the LoRA uses."""
    return [n for n, _ in _family_modules(state, family)]


def linear_names(state: LoraState, family: str) -> set[str]:
    """The names of a family's DiT's linears (the modules a LoRA can sit on), as many blocks as the LoRA uses."""
    return {n for n, lin in _family_modules(state, family) if lin}


def resolved(state: LoraState) -> LoraState:
    """Kohya names resolved against the DiT of the family whose module names they all match."""
    if not state.underscore_names:
        return state
    from ..models.family import FAMILIES

    errors = []
    for family in FAMILIES:
        try:
            return state.resolve(default_module_names(state, family))
        except ValueError as e:
            errors.append(e)
    raise errors[0]
