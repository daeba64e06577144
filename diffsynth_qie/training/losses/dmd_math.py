"""DMD2's distribution-matching gradient (Yin et al. 2024, "Improved Distribution Matching Distillation for Fast
Image Synthesis", arXiv 2405.14867), in the flow-matching terms of this trainer (``docs/DISTILL.md``).

With ``x_t = α_t x + σ_t ε`` (flow matching: ``α_t = 1 − σ``, ``σ_t = σ``) and a model's velocity ``v`` at
``x_t``, its clean prediction is ``μ(x_t) = x_t − σ v`` and its score ``s(x_t) = −(x_t − α_t μ(x_t)) / σ_t²``.
The paper's gradient of the generator's output ``x`` (DMD, eq. 7 and 8, kept by DMD2) is

    ∇_x = w_t α_t (s_fake(x_t) − s_real(x_t)),   w_t = σ_t² / α_t · C·S / ‖μ_real(x_t) − x‖₁

which this module computes from the two velocities without forming the scores (they divide by σ²):

    ∇_x = α_t (μ_fake − μ_real) / mean|μ_real − x| = α_t σ (v_real − v_fake) / mean|μ_real − x|

``v_real`` is the teacher's CFG velocity, ``v_fake`` the fake score's. The loss whose gradient in ``x`` is that
(up to the mean over elements) is ``½ ‖x − sg(x − ∇_x)‖²`` (the authors' code). Everything keeps the batch
dimension: one value per sample.
"""
from __future__ import annotations

from typing import Sequence

import torch

Tensor = torch.Tensor
DEFAULT_SHIFT = 3.0  # the student's grid: the uniform grid shifted once, as the few-step lines declare theirs


def _per_sample(sigma: Tensor | float, like: Tensor) -> Tensor:
    s = torch.as_tensor(sigma, dtype=torch.float32, device=like.device)
    return s.reshape(-1, *([1] * (like.ndim - 1))) if s.ndim else s


def clean_prediction(x_t: Tensor, v: Tensor, sigma: Tensor | float) -> Tensor:
    """``μ = x_t − σ v`` in fp32 (``sigma``: a number or one per sample)."""
    return x_t.float() - _per_sample(sigma, x_t) * v.float()


def dmd_gradient(x: Tensor, x_t: Tensor, v_real: Tensor, v_fake: Tensor, sigma: Tensor | float,
                 eps: float = 1e-6) -> Tensor:
    """The normalised distribution-matching gradient ``[B, ...]`` of the generator's outputs ``x`` noised to
    ``x_t`` at ``sigma`` (see the module docstring); a non-finite value becomes 0 (the authors' ``nan_to_num``)."""
    s = _per_sample(sigma, x)
    mu_real, mu_fake = clean_prediction(x_t, v_real, s), clean_prediction(x_t, v_fake, s)
    dims = tuple(range(1, x.ndim))
    norm = (mu_real - x.float()).abs().mean(dims, keepdim=True).clamp_min(eps)
    return torch.nan_to_num((1 - s) * (mu_fake - mu_real) / norm)


def dmd_loss(x: Tensor, grad: Tensor, weight: Tensor | None = None) -> Tensor:
    """``½ mean((x − sg(x − grad))²)`` per sample ``[B]``: its gradient in ``x`` is ``grad`` over the number of
    elements (``weight``: per-pixel weights broadcast over the channels, as ``--mask_loss_weights`` gives)."""
    target = (x.float() - grad.float()).detach()
    err = (x.float() - target) ** 2
    if weight is not None:
        err = err * weight.to(err.dtype)
    return 0.5 * err.mean(tuple(range(1, x.ndim)))


def student_sigmas(steps: int, shift: float = DEFAULT_SHIFT) -> tuple[float, ...]:
    """The student's fixed σ grid of ``steps`` values (without the final 0): the uniform grid ``1, 1 − 1/N, ...``
    shifted once, ``σ' = s·σ / (1 + (s − 1)·σ)``; 1 step samples at σ = 1."""
    if not 1 <= int(steps) <= 8:
        raise ValueError(f"--student_steps {steps}: the student samples in 1 to 8 steps")
    uniform = [1 - k / steps for k in range(steps)]
    return tuple(round(shift * s / (1 + (shift - 1) * s), 6) for s in uniform)


def euler_steps(velocity, x: Tensor, sigmas: Sequence[float]) -> Tensor:
    """``x`` at ``sigmas[0]`` carried to ``sigmas[-1]`` by Euler steps ``x + v·(σ' − σ)`` (the sampler's step), with
    ``velocity(x [1, ...], timesteps [1])`` (timesteps σ·1000, as the schedulers give them)."""
    for a, b in zip(sigmas, sigmas[1:]):
        v = velocity(x, torch.full((x.shape[0],), a * 1000.0, device=x.device))
        x = (x.float() + v.float() * (b - a)).to(x.dtype)
    return x
