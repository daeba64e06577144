"""The LoRA picker's callbacks: the list, a picked LoRA's sampler, its declared schedule (Steps and CFG follow it)
and the one-click stack with the frozen LoRA it was trained on top of (``ui/schedules.py`` decides). Each callback
looks at the LoRA folder once (``LoraChoices.one_look``): a click reads each LoRA header once."""
from __future__ import annotations

from typing import Any

import gradio as gr

from .lora_picker import NO_LORA
from .settings import MODE_FLOW
from .uploads import UIError


class LoraEvents:
    """The LoRA methods of :class:`~diffsynth_qie.ui.events.Callbacks` (``self.h``: the UI's handlers)."""

    h: Any

    def refresh_loras(self, current: str | None, second: str | None):
        """The picker's lists again; outputs: both pickers, the LoRA status, the sampler radio, the stack button."""
        with self.h.one_look():
            options = self.h.lora_options()
            names = [name for _, name in options]
            pick = current if current in names and current != NO_LORA else self.h.default_lora()
            second = second if second in names else NO_LORA
            return (gr.update(choices=options, value=pick), gr.update(choices=options, value=second),
                    self.h.lora_status(pick, second), gr.update(choices=self.h.mode_choices()),
                    self.stack_button(pick, second))

    def stack_button(self, name: str | None, second: str | None = None):
        """"Stack with <file>" when ``name`` was trained on top of a LoRA that is in the folder and not picked."""
        try:
            offer = self.h.stack_offer(name, second)
        except UIError:
            offer = None
        shown = offer is not None and offer.name is not None
        return gr.update(visible=shown, value=f"Stack with {offer.file} × {offer.scale:g}" if shown else None)

    def _declared(self, name: str | None, second: str | None, mode: str) -> tuple[int, float] | None:
        """(Steps, CFG) of the schedule the picked LoRAs declare, with flow matching; else None."""
        try:
            found = self.h.declared_schedule(name, second)
        except UIError:  # said in the LoRA status; Generate refuses it with the same words
            found = None
        return (found.steps, found.cfg) if found is not None and mode == MODE_FLOW else None

    def _schedule(self, name: str | None, second: str | None, mode: str) -> tuple:
        """(Steps, CFG) updates: the declared schedule's with flow matching, else unchanged."""
        found = self._declared(name, second, mode)
        return (gr.skip(), gr.skip()) if found is None else (gr.update(value=found[0]), gr.update(value=found[1]))

    def pick_lora(self, name: str, second: str | None, mode: str, prev: str, steps: float, saved: float | None):
        """A picked LoRA sets the sampler it was trained for (LBM or flow matching), its declared schedule's Steps
        and CFG, says if its model differs, and offers the LoRA it was trained on top of."""
        with self.h.one_look():
            new_mode = self.h.mode_for_lora(name, mode)
            shown = list(self.switch_mode(new_mode, prev, steps, saved))
            found = self._declared(name, second, new_mode)
            if found is not None:
                shown[0], shown[1] = gr.update(visible=True, value=found[0]), gr.update(visible=True, value=found[1])
            return (new_mode, self.h.lora_status(name, second), *shown, self.stack_button(name, second))

    def pick_second(self, name: str | None, second: str | None, mode: str):
        """The second LoRA changed: the status, the stack button and a declared schedule's Steps and CFG."""
        with self.h.one_look():
            return (self.h.lora_status(name, second), self.stack_button(name, second),
                    *self._schedule(name, second, mode))

    def stack_frozen(self, name: str | None, second: str | None, mode: str):
        """"Stack with …": the frozen LoRA as the second LoRA at its training scale (the Advanced section opens)."""
        with self.h.one_look():
            offer = self.h.stack_offer(name, second)
            if offer is None or offer.name is None:
                raise gr.Error("nothing to stack: the picked LoRA names no frozen LoRA in the LoRA folder",
                               duration=5, print_exception=False)
            return (offer.name, offer.scale, self.h.lora_status(name, offer.name), gr.update(visible=False),
                    *self._schedule(name, offer.name, mode), gr.update(open=True))
