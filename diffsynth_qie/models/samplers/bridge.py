"""Latent Bridge Matching math, shared by the LBM loss (training) and the bridge sampler (inference).

DiffSynth's scheduler convention: σ = 1 at the prior (source or white latents), σ = 0 at
the target. The bridge is x_σ = (1−σ)·z_T + σ·z_prior + s·√(σ(1−σ))·ε, its velocity
v* = dx/dσ = z_prior − z_T, and the sampler walks σ_k = linspace(1, 1/N, N) → 0 with
Euler steps, re-injecting the bridge noise after every step but the last. Pure functions.
"""
from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def bridge_sigmas(n: int) -> Tensor:
    """σ_k = linspace(1, 1/n, n) (float32): the LBM sampler's σ grid, also the default training grid."""
    if int(n) != n or n < 1:
        raise ValueError(f"LBM steps must be a positive integer, got {n!r}")
    return torch.linspace(1.0, 1.0 / n, int(n), dtype=torch.float32)


def _as_batch(sigma, like: Tensor) -> Tensor | float:
    """A python float stays a float; a [B] tensor becomes [B, 1, 1, 1] on ``like``'s device/dtype."""
    if isinstance(sigma, Tensor) and sigma.numel() > 1:
        return sigma.to(device=like.device, dtype=like.dtype).reshape(-1, *([1] * (like.ndim - 1)))
    return float(sigma)


def bridge_noise_scale(sigma, bridge_noise: float):
    """s·√(σ(1−σ)): the bridge's noise standard deviation at σ (0 at both ends)."""
    if isinstance(sigma, Tensor):
        return bridge_noise * torch.sqrt((sigma * (1 - sigma)).clamp_min(0))
    return bridge_noise * math.sqrt(max(sigma * (1 - sigma), 0.0))


def bridge_interpolate(z_target: Tensor, z_prior: Tensor, sigma, bridge_noise: float = 0.0,
                       noise: Tensor | None = None) -> Tensor:
    """x_σ = (1−σ)·z_T + σ·z_prior + s·√(σ(1−σ))·ε; σ a float or a per-sample [B] tensor.

    Exactly z_T at σ = 0 and exactly the prior at σ = 1 (the noise term vanishes at both
    ends). Computed in fp32, returned in ``z_target``'s dtype.
    """
    zt, zp = z_target.float(), z_prior.float()
    s = _as_batch(sigma, zt)
    x = (1 - s) * zt + s * zp
    if noise is not None and bridge_noise:
        x = x + bridge_noise_scale(s, bridge_noise) * noise.float()
    return x.to(z_target.dtype)


def bridge_target(z_target: Tensor, z_prior: Tensor) -> Tensor:
    """The bridge's velocity dx/dσ: v* = z_prior − z_T (fp32; what the DiT regresses).

    One Euler step from σ = 1 to 0 with v* lands exactly on z_T.
    """
    return z_prior.float() - z_target.float()


def bridge_step(x: Tensor, v: Tensor, sigma, sigma_next, bridge_noise: float = 0.0,
                noise: Tensor | None = None) -> Tensor:
    """One Euler step x + (σ_next − σ)·v, then re-inject s·√(σ_next(1−σ_next))·ε (zero at σ_next = 0)."""
    s, s_next = _as_batch(sigma, x), _as_batch(sigma_next, x)
    x = x + (s_next - s) * v
    if noise is not None and bridge_noise:
        x = x + bridge_noise_scale(s_next, bridge_noise) * noise
    return x
