"""The reward of the CPU reward-tuning demo (``bash Qwen-Image-Edit-Reward.sh``): "what is inside the mask turned
blue". Use it with a preservation term, so nothing outside changes, as the launcher does::

    --reward 'preserve:1,diffsynth_qie.metrics.demo_reward:blue_inside:1'

A reward function takes a :class:`~.rewards.RewardBatch` and returns one number per row (higher is better).
"""
from __future__ import annotations

import torch


def blue_inside(batch) -> torch.Tensor:
    """Per row, the mean of ``B − max(R, G)`` over the edit region (the mask; the whole image without one), in
    [−1, 1]: 1 for pure blue, about 0 for grey, negative for red."""
    out = batch.output.float()
    blueness = out[:, 2] - torch.maximum(out[:, 0], out[:, 1])
    if batch.mask is None:
        return blueness.mean(dim=(1, 2))
    region = batch.mask.float()[:, 0]
    return (blueness * region).sum(dim=(1, 2)) / region.sum(dim=(1, 2)).clamp_min(1.0)
