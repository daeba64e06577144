"""The in-memory form of a LoRA: per-module low-rank pairs, full weights, metadata.

Every file format (``formats``) is read into a :class:`LoraState` with canonical
module names; applying (``apply``), switching (``manager``) and writing
(``export``) work on it. The format overview is in ``lora/__init__.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

import torch

FORMAT_NAME = "diffsynth_qie.lora"
FORMAT_VERSION = 1
_MAX_LISTED = 12


def listing(names: Sequence[str]) -> str:
    """Sorted names for an error message, at most ``_MAX_LISTED`` of them."""
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def problems(*groups: tuple[str, Sequence[str]], counted: bool = True) -> str:
    """One error-message clause per non-empty group, "; "-joined: ``"3 key(s) not found: a, b, c"``
    (``counted=False``: ``"key(s) not found: a, b, c"``)."""
    return "; ".join(f"{len(names)} {label}: {listing(names)}" if counted else f"{label}: {listing(names)}"
                     for label, names in groups if names)


# --- data ------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraModule:
    """One module's low-rank pair; the weight delta is ``scale * B @ A``."""

    A: torch.Tensor  # [rank, in]
    B: torch.Tensor  # [out, rank]
    alpha: float | None = None

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def scale(self) -> float:
        """``alpha / rank`` (kohya / PEFT convention), 1.0 without alpha."""
        return 1.0 if self.alpha is None else self.alpha / self.rank

    def delta(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The fp32 weight delta, computed in DiffSynth's order (``B @ (A * scale)``)."""
        a = self.A.to(device=device, dtype=torch.float32)
        if self.alpha is not None:
            a = a * self.scale
        return torch.mm(self.B.to(device=device, dtype=torch.float32), a)


@dataclass(frozen=True)
class LoraState:
    """A LoRA file normalised to canonical module names.

    ``modules`` maps module path -> :class:`LoraModule`; ``full`` maps parameter name
    -> tensor for fully trained modules. When ``underscore_names`` is true (kohya
    files) the keys of ``modules`` are still ``transformer_blocks_0_attn_to_q`` style
    and :meth:`resolve` must map them to module paths.
    """

    modules: dict[str, LoraModule]
    full: dict[str, torch.Tensor] = field(default_factory=dict)
    format: str = "diffsynth_qie"
    metadata: dict[str, str] = field(default_factory=dict)
    source: str = "<memory>"
    underscore_names: bool = False

    @property
    def ranks(self) -> set[int]:
        return {m.rank for m in self.modules.values()}

    def resolve(self, module_names: Iterable[str]) -> "LoraState":
        """Map kohya underscore names back to module paths using ``module_names``."""
        if not self.underscore_names:
            return self
        lookup: dict[str, str | None] = {}
        for name in module_names:
            key = name.replace(".", "_")
            lookup[key] = None if (key in lookup and lookup[key] != name) else name  # None: ambiguous
        modules, unknown, ambiguous = {}, [], []
        for key, mod in self.modules.items():
            if key not in lookup:
                unknown.append(f"lora_unet_{key}")
            elif lookup[key] is None:
                ambiguous.append(f"lora_unet_{key}")
            else:
                modules[lookup[key]] = mod
        if unknown or ambiguous:
            raise ValueError(f"LoRA {self.source} does not match the model: "
                             + problems(("kohya module(s) not found in the model", unknown),
                                        ("kohya module name(s) match several modules", ambiguous))
                             + ". Check that the LoRA was trained for this model.")
        return replace(self, modules=modules, underscore_names=False)

