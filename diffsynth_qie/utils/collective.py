"""Errors of one rank told to every rank, so a failure on one node ends the run everywhere with its message."""
from __future__ import annotations

from typing import Optional


def raise_on_every_rank(accelerator, failure: Optional[BaseException]) -> None:
    """A barrier that also carries each rank's write error: if any rank failed (a full disk on one node),
    every rank raises it, instead of the others waiting at the next barrier for a rank that is gone.

    The other ranks raise an ``OSError`` with the failed rank's ``errno`` (so a full disk elsewhere is still a
    full disk to :func:`~.atomic.is_disk_full`), or a ``RuntimeError`` when the failure was no OS error.
    """
    if accelerator.num_processes == 1:
        if failure is not None:
            raise failure
        return
    from accelerate.utils import gather_object

    mine = None if failure is None else (f"rank {accelerator.process_index}: {failure}",
                                         getattr(failure, "errno", None))
    told = [t for t in gather_object([mine]) if t]
    if failure is not None:
        raise failure
    if told:
        message, code = told[0]
        if code:
            raise OSError(code, f"another rank failed ({message})")
        raise RuntimeError(f"another rank failed ({message})")
