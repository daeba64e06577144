"""Loss normalisation over one optimizer step: every sample counts once.

An optimizer step is ``G`` micro-batches (``--gradient_accumulation_steps``) on each
of ``W`` processes. With ``--max_tokens_per_batch`` the micro-batches differ in size.
A loss function returns the *mean* over its micro-batch; accelerate's ``backward``
divides it by ``G`` (DeepSpeed's engine does the same), and DDP / DeepSpeed average
the gradients over the ``W`` ranks. Left as is, a sample in a micro-batch of ``n``
would weigh ``1/(n·G·W)``: samples of small micro-batches would count more.

The loop therefore fetches the whole step's micro-batches first, sums their sizes
over the ranks (``N``, :func:`step_sample_count`) and multiplies micro-batch ``m``'s
mean loss by :func:`micro_loss_scale` ``= n_m·G·W / N`` before ``backward``. After
the division by ``G`` and the rank average, each sample weighs ``1/N``: the gradient
of the per-sample mean over the whole step (as torchtitan normalises by the global
token count of a step). With equal micro-batches ``n_m·G·W = N`` exactly, the scale is
1.0 and the numbers are those of a plain per-micro-batch mean.
"""
from __future__ import annotations

from typing import Sequence

import torch


def micro_loss_scale(micro_samples: int, step_samples: int, accumulation_steps: int, world_size: int) -> float:
    """Factor for a micro-batch's mean loss so that, after the ``1/G`` of accumulation and the
    ``1/W`` of the rank average, each of the step's ``step_samples`` samples weighs ``1/step_samples``."""
    if step_samples <= 0:
        raise ValueError("an optimizer step got no sample on any rank: the cache holds fewer rows than the run's "
                         "processes x --batch_size x --gradient_accumulation_steps needs; cache more rows or "
                         "lower them")
    if not 0 <= micro_samples <= step_samples:
        raise ValueError(f"a micro-batch of {micro_samples} samples in a step of {step_samples}")
    return micro_samples * accumulation_steps * world_size / step_samples  # 0 for an empty micro-batch


def step_sample_count(local_sizes: Sequence[int], accelerator=None) -> int:
    """Samples in the whole optimizer step: this rank's micro-batch sizes, summed over all ranks."""
    local = int(sum(local_sizes))
    if accelerator is None or accelerator.num_processes == 1:
        return local
    total = accelerator.reduce(torch.tensor([local], dtype=torch.int64, device=accelerator.device), reduction="sum")
    return int(total.item())


def step_mean(values: Sequence[torch.Tensor], scales: Sequence[float]) -> torch.Tensor:
    """This rank's share of the step's per-sample mean: ``mean_m(value_m · scale_m)``.

    Averaged over the ranks (``accelerator.reduce(..., "mean")``) it is
    ``Σ_m n_m·value_m / N`` over all micro-batches of all ranks. With scales of 1.0 it is the
    plain mean of the micro-batch values.
    """
    return torch.stack([v.detach().float() * s if s != 1.0 else v.detach().float()
                        for v, s in zip(values, scales)]).mean()


def step_sample_starts(local_sizes: Sequence[int], accelerator=None) -> tuple[list[int], int]:
    """Global index of the first sample of each of this rank's micro-batches, and the step's sample count.

    Samples are numbered rank-major (all of rank 0's micro-batches, then rank 1's, ...), then by
    micro-batch, then by position: every sample of the step has one index in ``range(total)``.
    """
    local = [int(n) for n in local_sizes]
    offset, total = 0, sum(local)
    if accelerator is not None and accelerator.num_processes > 1:
        per_rank = accelerator.gather(torch.tensor([total], dtype=torch.int64, device=accelerator.device))
        per_rank = [int(v) for v in per_rank.cpu().tolist()]
        offset, total = sum(per_rank[:accelerator.process_index]), sum(per_rank)
    starts = []
    for n in local:
        starts.append(offset)
        offset += n
    return starts, total
