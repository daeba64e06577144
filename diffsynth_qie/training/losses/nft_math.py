"""DiffusionNFT's objective (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward
Process", arXiv 2509.16117): the pieces that turn rewarded rollouts into a flow-matching loss.

``docs/REWARD.md`` writes out the equations these follow:

- :func:`optimality` — rewards of ``K`` rollouts per source → optimality probabilities ``r`` in [0, 1]: the
  group-normalised advantage ``A = (R − mean_group) / std_group``, clipped to ``±adv_clip``, mapped by
  ``r = 1/2 + A / (2 adv_clip)``;
- :func:`nft_loss` — per rollout, with the old policy's velocity ``v_old`` (no gradient), the current one
  ``v_θ`` and the flow-matching target ``v = ε − x₀`` at the same noisy point:
  ``v⁺ = (1 − β) v_old + β v_θ`` (the implicit positive policy), ``v⁻ = (1 + β) v_old − β v_θ`` (the implicit
  negative one), and ``L = [r ‖v⁺ − v‖² + (1 − r) ‖v⁻ − v‖²] / β`` (the ``1/β`` keeps the gradient's scale
  independent of β, as the authors' code does);
- :func:`soft_update_` — the old policy follows the trained one: ``θ_old ← η θ_old + (1 − η) θ``.

All three keep the batch dimension: one value per rollout.
"""
from __future__ import annotations

from typing import Iterable

import torch

Tensor = torch.Tensor


def optimality(rewards: Tensor, group_size: int, adv_clip: float = 5.0, eps: float = 1e-4) -> Tensor:
    """``r`` for ``rewards`` [G·K] laid out group by group (``K = group_size`` rollouts of one source each)."""
    if group_size < 2:
        raise ValueError(f"--nft_group_size {group_size}: DiffusionNFT compares the rollouts of one source, so it "
                         "needs at least 2 per source")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if adv_clip <= 0:
        raise ValueError(f"--nft_adv_clip {adv_clip} must be > 0")
    grouped = rewards.double().reshape(-1, group_size)
    adv = (grouped - grouped.mean(1, keepdim=True)) / grouped.std(1, keepdim=True).clamp_min(eps)
    return (0.5 + adv.clamp(-adv_clip, adv_clip) / (2 * adv_clip)).reshape(-1).to(rewards.dtype)


def nft_loss(v_theta: Tensor, v_old: Tensor, v_target: Tensor, r: Tensor, beta: float) -> Tensor:
    """Per-rollout DiffusionNFT loss ``[B]`` (mean squared error over each rollout's elements)."""
    if beta <= 0:
        raise ValueError(f"--nft_beta {beta} must be > 0")
    v_old = v_old.detach().float()
    v_theta, v_target = v_theta.float(), v_target.float()
    positive = (1 - beta) * v_old + beta * v_theta
    negative = (1 + beta) * v_old - beta * v_theta
    dims = tuple(range(1, v_theta.ndim))
    pos_err = (positive - v_target).square().mean(dims)
    neg_err = (negative - v_target).square().mean(dims)
    r = r.to(pos_err)
    return (r * pos_err + (1 - r) * neg_err) / beta


@torch.no_grad()
def soft_update_(old: Iterable[Tensor], current: Iterable[Tensor], decay: float) -> None:
    """``old ← decay · old + (1 − decay) · current``, in place, tensor by tensor."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"--nft_old_decay {decay} must be in [0, 1)")
    for o, c in zip(old, current, strict=True):
        o.mul_(decay).add_(c.detach().to(o.dtype), alpha=1 - decay)
