"""The steps after the first in the fake-device training step (``train_step.py``), for ``qie train``'s preflight:
growth across steps, and where the frozen LoRA's branches sit.

One step cannot show a leak: an on-the-fly store that keeps every encoded entry on the GPU, or any per-step cache
that never frees, passes it and runs out of memory hundreds of steps into a real run. So the preflight runs more
steps in the same session, each on other samples (``train_batch.step_rows``: other rows, turned 4:3 on odd steps;
with ``--on_the_fly`` each row encoded by the store first, as the encode thread does), with the optimizer's step
and the EMA's update after each. From the second step on the optimizer's state exists, so the step after it must
leave no more device memory behind than it did: more is a :class:`~..fakegpu.device.FakeRunError` naming the lines
that allocated what stayed (``fakegpu/growth.py``). The later steps run in the first step's compute context (its
autocast state, read as it ran), are not counted for the time model, and are not part of the memory verdict.

Before them, every frozen ``--frozen_lora`` branch must sit where its layer's weight is
(``lora_files.check_branches``): the training module attached it from the file read on the host, as a real run does.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..fakegpu.device import backward
from ..fakegpu.growth import check_growth
from .lora_files import check_branches
from .train_batch import step_rows


class LaterSteps:
    """Made before the first step (it reads that step's compute context as it runs); :meth:`run` after it."""

    def __init__(self, fc, module: torch.nn.Module, steps: int):
        self.fc, self.steps = fc, steps
        self.context: Optional[tuple[bool, torch.dtype]] = None
        self._hook = module.register_forward_pre_hook(self._read_context) if steps > 1 else None

    def _read_context(self, module, args) -> None:
        if self.context is None:
            self.context = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))

    def run(self, module, optimizer, ema, encoders, shapes: Sequence, multiple: int,
            make_batch: Callable[[Sequence], dict], generator: torch.Generator) -> int:
        """Check the frozen branches, then run steps 2 .. ``steps`` (raising on growth from the last but one to the
        last); returns the steps run in the session."""
        check_branches(module.dit, "the training module's --frozen_lora")
        if self.steps <= 1:
            return 1
        self._hook.remove()
        enabled, dtype = self.context or (False, torch.bfloat16)
        fc, snapshots = self.fc, []
        with fc.uncounted():
            for k in range(1, self.steps):
                rows = step_rows(shapes, k, multiple)
                if encoders is not None:  # the encode thread's next sample
                    encoders.encode(fc, rows[0])
                batch = make_batch(rows)
                batch["index"] = [k * len(rows) + i for i in range(len(rows))]
                with fc.phase(f"step {k + 1}: forward + backward"):
                    with torch.autocast("cuda", dtype=dtype, enabled=enabled):
                        loss, _ = module(batch, generator)
                    backward(loss)
                del loss, batch
                with fc.phase(f"step {k + 1}: optimizer step"):
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if ema is not None:
                        ema.update()
                snapshots.append(fc.memory.snapshot())
        if len(snapshots) >= 2:
            check_growth(snapshots[-2], snapshots[-1], f"step {self.steps}", f"step {self.steps - 1}")
        return self.steps
