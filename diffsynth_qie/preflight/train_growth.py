"""The steps after the first in the fake-device training step (``train_step.py``), for ``qie train``'s preflight:
growth across steps, and where the frozen LoRA's branches sit.

One step cannot show a leak: an on-the-fly store that keeps every encoded entry on the GPU, or any per-step cache
that never frees, passes it and runs out of memory hundreds of steps into a real run. So the preflight runs more
steps in the same session, each on other samples (``train_batch.step_rows``: other rows, turned 4:3 on odd steps;
with ``--on_the_fly`` each row encoded by the store first, as the encode thread does), with the optimizer's step
and the EMA's update after each. From the second step on the optimizer's state exists, so the step after it must
leave no more device memory behind than it did: more is a :class:`~..fakegpu.device.FakeRunError` naming the lines
that allocated what stayed (``fakegpu/growth.py``). The later steps are not counted for the time model, and are not
part of the memory verdict.

Before them, every frozen ``--frozen_lora`` branch must sit where its layer's weight is
(``lora_files.check_branches``): the training module attached it from the file read on the host, as a real run does.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..fakegpu.device import backward
from ..fakegpu.growth import check_growth, settled
from .lora_files import check_branches
from .train_batch import step_rows


def later_steps(fc, steps: int, module, optimizer, ema, encoders, shapes: Sequence, multiple: int,
                make_batch: Callable[[Sequence], dict], generator: torch.Generator) -> int:
    """After the first step of ``fc``'s session: check the frozen branches, then run steps 2 .. ``steps`` (raising
    on growth from the last but one to the last); returns the steps run in the session."""
    check_branches(module.dit, "the training module's --frozen_lora")
    if steps <= 1:
        return 1
    snapshots = []
    with fc.uncounted():
        for k in range(1, steps):
            rows = step_rows(shapes, k, multiple)
            if encoders is not None:  # the encode thread's next sample
                encoders.encode(fc, rows[0])
            batch = make_batch(rows)
            batch["index"] = [k * len(rows) + i for i in range(len(rows))]
            with fc.phase(f"step {k + 1}: forward + backward"):
                loss, _ = module(batch, generator)  # (the module enters its own autocast, if any)
                backward(loss)
            del loss, batch
            with fc.phase(f"step {k + 1}: optimizer step"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if ema is not None:
                    ema.update()
            snapshots.append(settled(fc.memory))
    if len(snapshots) >= 2:
        check_growth(snapshots[-2], snapshots[-1], f"step {steps}", f"step {steps - 1}")
    return steps
