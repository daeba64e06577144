"""Switching LoRAs on a loaded model without reloading it (the UI and ``Editor``): unmerged or merged."""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import torch

from .apply import LoadReport, match_lora, merge_matched
from .branch import Adapter, attach, branch_tensors, detach_all
from .formats import load_lora_state
from .state import LoraModule, LoraState

log = logging.getLogger(__name__)


def check_merge_precision(state: LoraState, weights) -> None:
    """Refuse to merge a LoRA into 16-bit weights. The merged weight is rounded to its dtype, and a LoRA's delta
    is a small fraction of the weight: on bf16 weights (N(0, 0.02), rank 32) the applied delta was off by 48 %,
    17 % and 3.3 % at |delta|/|W| = 0.3 %, 1 % and 5 % (adding in fp32 first changes nothing: the final rounding
    is the loss), against 0.2 % for the unmerged branch. Keeping the merged weights in fp32 would double the
    DiT's memory."""
    low = sorted({str(w.dtype).replace("torch.", "") for w in weights if w.dtype in (torch.bfloat16, torch.float16)})
    if low:
        raise ValueError(f"merging {state.source or 'the LoRA'} into {'/'.join(low)} weights would round away much of "
                         "its delta (about 48 % of it when the delta is 0.3 % of the weight); drop --lora_merge: the "
                         "default unmerged branch is exact and costs only the LoRA's own size")


class LoraManager:
    """Switch LoRAs on a loaded model without reloading it; the base weights come back bit-exactly.

    Two modes:

    - unmerged (default): each LoRA module becomes an adapter branch on its linear
      (``lora/branch.py``); no weight is written and nothing is backed up, so a
      LoRA costs its own size, a scale change only changes the branch's factor, and
      removing it leaves the very same weight tensors. Full-weight entries of a file
      can only be merged: exactly those parameters are backed up, as below.
    - ``merge=True``: deltas are merged into the weights (no per-step cost). The first
      time a LoRA touches a parameter, its original value is copied to
      ``backup_device``; :meth:`clear` copies the originals back (no subtract-the-delta
      rounding). Memory cost: one copy of every touched weight (on CPU by default),
      close to a second DiT for a LoRA on every linear.

    Loaded files are cached by (path, mtime, size), so re-selecting a LoRA does not
    re-read it. Not thread-safe: call it from the one worker that runs generations.
    """

    def __init__(self, model: torch.nn.Module, backup_device: str | torch.device = "cpu", cache_size: int = 8,
                 merge: bool = False, family: str | None = None):
        self.model = model
        self.merge = bool(merge)
        self.family = family  # the model's family (models/family.py): a LoRA trained for another is refused
        self.backup_device = torch.device(backup_device)
        self.cache_size = cache_size
        self._cache: OrderedDict[Path, tuple[tuple[int, int], LoraState]] = OrderedDict()
        self._backup: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (live tensor, original)
        self._branched: dict[str, torch.nn.Module] = {}  # module name -> module carrying adapter branches
        self._adapters: list[list[tuple[Adapter, LoraModule]]] = []  # per active LoRA
        self._active: list[tuple[Path, float]] = []
        self._reports: list[LoadReport] = []
        self._states: list[LoraState] = []

    @property
    def active(self) -> list[tuple[Path, float]]:
        """The LoRAs currently applied, as (resolved path, scale)."""
        return list(self._active)

    def held_bytes(self) -> dict[str, int]:
        """Bytes this manager holds beside the model: weight ``backup`` and ``adapters``.

        (The file cache, up to ``cache_size`` LoRAs as read, comes on top; unmerged
        adapters share its storage when the model has the file's dtype and device.)
        """
        backup = sum(original.nbytes for _, original in self._backup.values())
        adapters = sum(t.nbytes for m in self._branched.values() for t in branch_tensors(m))
        return {"backup": backup, "adapters": adapters}

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
        for (path, _), state in zip(wanted, states):
            check_family(state, self.family, path)
        same_files = ([p for p, _ in wanted] == [p for p, _ in self._active]
                      and all(a is b for a, b in zip(states, self._states)))
        if same_files and wanted == self._active:
            return list(self._reports)  # same files, unchanged on disk, same scales
        if same_files and not self.merge and not any(st.full for st in states):
            return self._rescale(wanted)
        matched = [(match_lora(self.model, st), s) for st, (_, s) in zip(states, wanted)]
        self.clear()
        try:
            reports = [self._apply(state, scale) for state, scale in matched]
        except BaseException:
            self.clear()
            raise
        self._active, self._reports, self._states = wanted, reports, states
        return list(reports)

    def _apply(self, state: LoraState, scale: float) -> LoadReport:
        """Apply one matched LoRA: merged with backups, or as branches (full weights merged)."""
        modules = dict(self.model.named_modules())
        params = dict(self.model.named_parameters())
        touched = {n: params[n] for n in state.full}
        if self.merge:
            check_merge_precision(state, [modules[m].weight for m in state.modules])
            touched.update({f"{m}.weight": modules[m].weight for m in state.modules})
        for name, tensor in touched.items():
            if name not in self._backup:
                self._backup[name] = (tensor, tensor.detach().to(self.backup_device, copy=True))
        if self.merge:
            merge_matched(self.model, state, scale)
        else:
            merge_matched(self.model, replace(state, modules={}), scale)
            handles = []
            for name, mod in state.modules.items():
                handles.append((attach(modules[name], mod, scale), mod))
                self._branched[name] = modules[name]
            self._adapters.append(handles)
        report = LoadReport(source=state.source, format=state.format, scale=scale,
                            lora_modules=sorted(state.modules), full_weights=sorted(state.full))
        log.info("%s (%s)", report.summary(), "merged" if self.merge else "unmerged")
        return report

    def _rescale(self, wanted: list[tuple[Path, float]]) -> list[LoadReport]:
        """Same unmerged LoRAs, new scales: only the branches' factors change."""
        for handles, (_, scale) in zip(self._adapters, wanted):
            for adapter, mod in handles:
                adapter.scale = scale * mod.scale
        self._reports = [replace(r, scale=s) for r, (_, s) in zip(self._reports, wanted)]
        self._active = wanted
        log.info("LoRA scales now %s (unmerged: no weight written)", ", ".join(f"{s:g}" for _, s in wanted))
        return list(self._reports)

    @torch.no_grad()
    def clear(self) -> None:
        """Remove every branch and restore the original value of every parameter a LoRA touched."""
        for module in self._branched.values():
            detach_all(module)
        for tensor, original in self._backup.values():
            tensor.copy_(original.to(tensor.device))
        self._branched.clear()
        self._adapters.clear()
        self._backup.clear()
        self._active, self._reports, self._states = [], [], []


def lora_family(source: LoraState | Mapping[str, str]) -> str | None:
    """The model family a LoRA was trained for, from its ``preset`` metadata (ours), given a loaded state or a
    file's header metadata; None when unknown."""
    from ..models.presets import PRESETS, family_of

    metadata = source.metadata if isinstance(source, LoraState) else source
    preset = metadata.get("preset")
    return family_of(preset).name if preset in PRESETS else None


def check_family(state: LoraState, family: str | None, path) -> None:
    """Refuse a LoRA trained for another model family, naming both (an unknown origin is left to key matching)."""
    trained = lora_family(state)
    if family is not None and trained is not None and trained != family:
        raise ValueError(f"LoRA {path} was trained for {trained} (preset {state.metadata.get('preset')}), but this model "
                         f"is {family}: a LoRA works only on the family it was trained on; pick a {family} LoRA")
