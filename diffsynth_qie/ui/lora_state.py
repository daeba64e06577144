"""The LoRA side of :class:`~diffsynth_qie.ui.handlers.UIHandlers`: which LoRAs the picker lists and how each is
labelled, the samplers they allow, and what a picked LoRA says about how to run it (its declared schedule, the
frozen LoRA it was trained on top of: ``ui/schedules.py``).

A click asks several of these questions; inside :meth:`LoraChoices.one_look` they share one
:class:`~diffsynth_qie.ui.lora_picker.LoraFolder`, so each LoRA file's header is read once per click. Outside it,
every question looks at the folder afresh (a LoRA copied in is listed at the next click).
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from pathlib import Path
from typing import Iterator

from .lora_picker import NO_LORA, LoraFolder, LoraInfo
from .model_fit import family_supports_lbm
from .schedules import Declared, StackOffer, declared, stack_offer
from .settings import LBM_MAX_STEPS, MODE_FLOW, MODE_LBM, MODE_LIGHTNING
from .uploads import UIError


_LOOK: ContextVar[LoraFolder | None] = ContextVar("qie_lora_look", default=None)  # the click's look at the folder


class LoraChoices:
    """The LoRA methods of the UI's handlers (``self.config``: the :class:`~diffsynth_qie.ui.config.UIConfig`)."""

    @contextlib.contextmanager
    def one_look(self) -> Iterator[LoraFolder]:
        """Inside: every LoRA question looks at one :class:`LoraFolder` (a callback's, a Generate check's)."""
        look = self.folder()  # (inside another look: that one)
        token = _LOOK.set(look)
        try:
            yield look
        finally:
            _LOOK.reset(token)

    def folder(self) -> LoraFolder:
        """The LoRA folder as this click sees it (:meth:`one_look`), else as it is now."""
        look = _LOOK.get()
        return look if look is not None and look.lora_dir == str(self.config.lora_dir) else LoraFolder(
            self.config.lora_dir)

    def loras(self) -> list[LoraInfo]:
        """The LoRA files under the folder with their metadata, without those trained for the other model family."""
        from ..models.presets import family_of

        family, folder = family_of(self.config.model).name, self.folder()
        return [info for info in map(folder.info, folder.names()) if info.family in (None, family)]

    def lora_choices(self) -> list[str]:
        """:data:`NO_LORA` and the names of :meth:`loras`."""
        return [NO_LORA] + [info.name for info in self.loras()]

    def lora_info(self, name: str | None) -> LoraInfo | None:
        if not name or name == NO_LORA:
            return None
        return self.folder().info(name)

    def lora_options(self) -> list[tuple[str, str]]:
        """The picker's (label, name) pairs: each LoRA with its loss, preset, rank and step from its metadata."""
        return [(NO_LORA, NO_LORA)] + [(info.label(self.config.model), info.name) for info in self.loras()]

    def default_lora(self) -> str:
        """The LoRA picked at start: ``--lora`` if given, else the folder's own ``lora.safetensors`` (a run's
        output folder, as the training scripts' ``try it:`` line starts the UI), else none."""
        names = self.lora_choices()
        wanted = self.config.lora or "lora.safetensors"
        return wanted if wanted in names else NO_LORA

    def lora_status(self, name: str | None = None, second: str | None = None) -> str:
        """The LoRA folder, a preset warning, the schedule the picked LoRAs declare and what ``name`` was trained
        on top of (a problem with a LoRA's file is said here too; Generate refuses it with the same words)."""
        root = Path(self.config.lora_dir).expanduser()
        if not root.is_dir():
            return f"LoRA folder `{self.config.lora_dir}` does not exist yet (training writes there)."
        n = len(self.lora_choices()) - 1
        text = f"{n} LoRA file{'s' if n != 1 else ''} under `{self.config.lora_dir}`."
        info = self.lora_info(name)
        warning = info.mismatch(self.config.model) if info is not None else None
        lines = [f"⚠ {warning}. {text}" if warning else text]
        try:
            found, offer = self.declared_schedule(name, second), self.stack_offer(name, second)
        except UIError as exc:
            return "\n\n".join([*lines, f"⚠ {exc}"])
        lines += [found.note()] if found else []
        lines += [offer.note(str(name))] if offer else []
        return "\n\n".join(lines)

    def declared_schedule(self, *names: str | None) -> Declared | None:
        """The schedule the picked LoRAs declare (UIError for one of the other family or two that disagree)."""
        return declared(self.folder(), [n for n in names if n and n != NO_LORA], self.config.model)

    def stack_offer(self, name: str | None, second: str | None = None) -> StackOffer | None:
        """The frozen LoRA ``name`` was trained on top of, when ``second`` is not already it."""
        if not name or name == NO_LORA:
            return None
        return stack_offer(self.folder(), name, [second] if second and second != NO_LORA else [])

    def lightning_lora(self) -> str | None:
        """The Lightning LoRA the Lightning sampler uses: ``--lightning_lora``, else the first in the LoRA folder."""
        if self.config.lightning_lora:
            return self.config.lightning_lora
        name = next((info.name for info in self.loras() if info.lightning), None)
        return str(self.folder().resolve(name)) if name else None

    def lightning_available(self) -> bool:
        """Whether the Lightning sampler can run: ``--lightning_lora`` is set or a listed LoRA is a Lightning one."""
        return self.lightning_lora() is not None

    def mode_choices(self) -> list[tuple[str, str]]:
        """The sampler radio's choices; Lightning only when it can run."""
        modes = [("Flow matching", MODE_FLOW)]
        if family_supports_lbm(self.config.model):
            modes.append((f"LBM (1–{LBM_MAX_STEPS} steps)", MODE_LBM))
        if self.lightning_available():
            modes.append(("Lightning (4 / 8 steps)", MODE_LIGHTNING))
        return modes

    def mode_for_lora(self, name: str | None, mode: str) -> str:
        """The sampler to switch to when ``name`` is picked: LBM for an LBM LoRA, flow matching when leaving one."""
        info = self.lora_info(name)
        if info is not None and info.is_lbm:
            return MODE_LBM
        if info is not None and info.loss and mode == MODE_LBM:
            return MODE_FLOW
        return mode

