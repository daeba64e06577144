"""The flow-matching SFT loss, built from the pure helpers of ``common.py``.

A loss function has the signature ``loss_fn(dit, batch, config, generator=None) ->
(loss, metrics)``: ``dit`` is the (LoRA-injected) DiT, ``batch`` the collated dict from
``data.collate`` (lists, one entry per sample, already on the DiT's device/dtype),
``config`` the resolved :class:`~.config.RunConfig`, ``generator`` a CPU
``torch.Generator`` for every random draw (None = torch's global RNG). ``loss`` is a
0-dim tensor to backpropagate; ``metrics`` maps names to floats or detached 0-dim
tensors for logging (tensors avoid a device sync per micro-batch). Losses are
declared as a :class:`~.spec.LossSpec` (``SPEC`` at the end of the module) and listed in
``registry.py``.

Flow-matching SFT, DiffSynth's convention (``diffusion/flow_match.py``): σ = 1 is
noise, σ = 0 is data; ``x_σ = (1-σ)·x0 + σ·ε``; the DiT predicts the velocity and the
target is ``ε - x0``. Unlike DiffSynth's ``FlowMatchSFTLoss`` (batch 1, one σ per
step) everything is per sample: σ, noise, weight, and the mean squared error over
that sample's own target tokens (padding never counts). The batch loss is the mean of
``weight_b · mse_b``, so a batch of 2 gives the same mean gradient as two batches
of 1 accumulated.

Random draws go sample by sample (σ_b, then ε_b: ``common.draw_flow_points``, shared by the
losses), so a sample gets the same σ and noise whether it is trained in a batch or alone — that
is what makes the batch-2 vs 2×batch-1 equivalence testable.

Like ``lbm.py`` this module imports no torch at import time: the registry, and with it the flags,
stay cheap to build.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .spec import LossSpec

if TYPE_CHECKING:
    import torch

    Tensor = torch.Tensor


@dataclass
class SFTConfig:
    """Flow-matching SFT (used with --loss sft). A knob of this loss alone goes here, not in ``LossConfig``."""


# --- the loss --------------------------------------------------------------------
def flow_match_sft_loss(dit, batch: dict, config, generator: "torch.Generator | None" = None
                        ) -> "tuple[Tensor, dict[str, float | Tensor]]":
    """Flow-matching SFT loss of a batch (see the module docstring); ``config``: the resolved ``RunConfig``."""
    import torch

    from ...models.family_ops import ops_for
    from ...models.presets import family_of
    from .common import draw_flow_points, joined_prompts, per_sample_mse, pixel_weights, weighted_batch_mean

    targets = batch["target_latents"]
    ops = ops_for(family_of(config.train.model))  # the model family's DiT call and σ schedule (models/family_ops.py)
    # --timestep_sampling stratified: the loop puts each sample's stratum of the step into the batch
    points = draw_flow_points(targets, config.timesteps, generator, family=ops.family,
                              weighting=config.loss.loss_weighting, strata=batch.get("timestep_strata"))
    pred = ops.forward(
        dit, points.noisy, points.timesteps.to(targets[0].device), joined_prompts(ops, batch), batch["edit_latents"],
        zero_cond_t=bool(config.train.zero_cond_t),
        use_gradient_checkpointing=config.train.gradient_checkpointing and torch.is_grad_enabled(),
    )
    pixel_w = pixel_weights(config.loss.mask_loss_weights, batch.get("back_mask"), len(targets))
    losses = [per_sample_mse(p, t, w) for p, t, w in zip(pred, points.target, pixel_w)]
    loss = weighted_batch_mean(losses, points.weights)
    metrics = {
        "mse": torch.stack(losses).detach().mean(),
        "sigma_mean": float(points.sigmas.mean()),
        "weight_mean": float(points.weights.mean()),
    }
    return loss, metrics


SPEC = LossSpec(
    name="sft", summary="flow-matching fine-tuning (noise -> target)", fn=flow_match_sft_loss, config=SFTConfig,
    stratified_sigma=True, default_optimizer="adamw")
