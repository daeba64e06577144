"""Switching LoRAs on a loaded model without reloading it (the UI and ``Editor``)."""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import torch

from .lora_apply import LoadReport, match_lora, merge_matched
from .lora_format import load_lora_state
from .lora_state import LoraState

log = logging.getLogger(__name__)


class LoraManager:
    """Merge LoRAs into a model for fast inference and switch them without reloading.

    The first time a LoRA touches a parameter, its original value is copied to
    ``backup_device``; :meth:`clear` copies the originals back, so the base weights
    are bit-identical afterwards (no subtract-the-delta rounding). Memory cost: one
    copy of every touched weight (on CPU by default). Loaded files are cached by
    (path, mtime, size), so re-selecting a LoRA does not re-read it. Not thread-safe:
    call it from the one worker that runs generations.
    """

    def __init__(self, model: torch.nn.Module, backup_device: str | torch.device = "cpu", cache_size: int = 8):
        self.model = model
        self.backup_device = torch.device(backup_device)
        self.cache_size = cache_size
        self._cache: OrderedDict[Path, tuple[tuple[int, int], LoraState]] = OrderedDict()
        self._backup: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (live tensor, original)
        self._active: list[tuple[Path, float]] = []
        self._reports: list[LoadReport] = []
        self._states: list[LoraState] = []

    @property
    def active(self) -> list[tuple[Path, float]]:
        """The LoRAs currently merged, as (resolved path, scale)."""
        return list(self._active)

    def load(self, path: str | os.PathLike) -> LoraState:
        """The :class:`LoraState` of ``path``, from the cache while the file is unchanged."""
        path = Path(path).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"LoRA file not found: {path} (give the path of a .safetensors LoRA file)")
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
        hit = self._cache.get(path)
        if hit is not None and hit[0] == stamp:
            self._cache.move_to_end(path)
            return hit[1]
        state = load_lora_state(path)
        self._cache[path] = (stamp, state)
        self._cache.move_to_end(path)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return state

    def set_loras(self, loras: Sequence[tuple[str | os.PathLike, float]]) -> list[LoadReport]:
        """Make exactly ``loras`` (path, scale) active, in order, on top of the base weights.

        Every file is read and checked against the model first; if any fails, the
        model is left as it was and ``ValueError`` is raised.
        """
        wanted = [(Path(p).expanduser().resolve(), float(s)) for p, s in loras]
        states = [self.load(p) for p, _ in wanted]
        if wanted == self._active and all(a is b for a, b in zip(states, self._states)):
            return list(self._reports)  # same files, unchanged on disk, same scales
        matched = [(match_lora(self.model, st), s) for st, (_, s) in zip(states, wanted)]
        self.clear()
        modules = dict(self.model.named_modules())
        params = dict(self.model.named_parameters())
        try:
            reports = []
            for state, scale in matched:
                touched = {f"{m}.weight": modules[m].weight for m in state.modules}
                touched.update({n: params[n] for n in state.full})
                for name, tensor in touched.items():
                    if name not in self._backup:
                        self._backup[name] = (tensor, tensor.detach().to(self.backup_device, copy=True))
                merge_matched(self.model, state, scale)
                reports.append(LoadReport(source=state.source, format=state.format, scale=scale,
                                          lora_modules=sorted(state.modules), full_weights=sorted(state.full)))
                log.info("%s", reports[-1].summary())
        except BaseException:
            self.clear()
            raise
        self._active, self._reports, self._states = wanted, reports, states
        return list(reports)

    @torch.no_grad()
    def clear(self) -> None:
        """Restore the original value of every parameter a LoRA touched."""
        for tensor, original in self._backup.values():
            tensor.copy_(original.to(tensor.device))
        self._backup.clear()
        self._active, self._reports, self._states = [], [], []
