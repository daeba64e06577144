"""Diffusion-DPO for flow matching (``--loss dpo``): offline preference tuning from chosen / rejected pairs.

Each row of a preference cache holds the chosen output (the row's target, ``target_latents``) and the rejected
output (``rejected_latents``, same size; ``docs/PREFERENCE.md``). Per sample b, one σ_b and one noise ε_b are
drawn and used for both images (w = chosen, l = rejected), and the DiT's flow-matching error is measured on each:

    e_θ^k = mean ‖v_θ(x_σ^k) − (ε − x0^k)‖²          k ∈ {w, l}   (the SFT target of ``sft.py``)
    e_ref^k: the same with the LoRA switched off (the base model: no second copy, no graph)
    L_b = −log σ( −β/2 · [ (e_θ^w − e_ref^w) − (e_θ^l − e_ref^l) ] )

Diffusion-DPO (Wallace et al. 2023, arXiv 2311.12908, eq. 14) with the ε-prediction error replaced by the
velocity error as Flow-DPO does (Liu et al. 2025, arXiv 2501.13918); the factor T·ω(λ_t) of eq. 14 is taken
constant over σ and folded into β, and the ½ and the per-element mean follow the reference implementation of
Diffusion-DPO (so its β values mean the same here). The batch loss is ``mean_b(weight_b · L_b)`` with the σ
weighting of ``--loss_weighting``, as SFT. With the LoRA at zero the policy is the reference and L_b = log 2.

The implicit reward of a sample is r^k = −β/2 · (e_θ^k − e_ref^k); the metrics log the reward margin
r^w − r^l and the implicit accuracy (the share of samples whose margin is > 0).

Like ``sft.py`` this module imports no torch at import time (the registry builds the flags from it).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...utils.config_cli import cli_help
from .spec import LossSpec

if TYPE_CHECKING:
    import torch

    Tensor = torch.Tensor

DEFAULT_BETA = 5000.0
"""β of the Diffusion-DPO reference implementation's training runs (Wallace et al. 2023, with the ½ and the
per-element mean error used here). The error is a mean over latent elements, so β does not depend on the
image size; a larger β keeps the LoRA closer to the base."""


@dataclass
class DPOConfig:
    """Diffusion-DPO for flow matching (used with --loss dpo)."""

    dpo_beta: float = field(default=DEFAULT_BETA, metadata=cli_help(
        "β of Diffusion-DPO: how strongly the LoRA is held to the base (the reference); the error is the "
        "per-element mean, as in the Diffusion-DPO reference code (default 5000)", min=1e-6, max=1e9))

    def __post_init__(self):
        """Raise ``ValueError`` naming the bad flag (so `qie train` fails before loading anything)."""
        if not float(self.dpo_beta) > 0:
            raise ValueError(f"--dpo_beta must be > 0 (e.g. the default {DEFAULT_BETA:g}), got {self.dpo_beta}")


# --- pure helpers ----------------------------------------------------------------
def dpo_terms(err_w: "Tensor", err_l: "Tensor", ref_w: "Tensor", ref_l: "Tensor", beta: float
              ) -> "tuple[Tensor, Tensor]":
    """``(losses [B], margins [B])``: per-sample −log σ(margin) and the implicit reward margin
    ``−β/2 · ((e_θ^w − e_ref^w) − (e_θ^l − e_ref^l))`` from per-sample errors ``[B]``."""
    import torch.nn.functional as F

    margin = -0.5 * beta * ((err_w - ref_w) - (err_l - ref_l))
    return -F.logsigmoid(margin), margin


def lora_layers(dit) -> list:
    """The DiT's trained LoRA layers (PEFT's); ``ValueError`` when it has none (no reference to compare with)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in dit.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError("--loss dpo compares the LoRA with the base model and needs a LoRA: pass --lora_rank > 0")
    return layers


@contextlib.contextmanager
def lora_switched_off(dit):
    """The DiT with its trained LoRA layers bypassed (PEFT's flag, set on each layer), restored on exit.

    PEFT's ``enable_adapters(False)`` would also clear the adapters' ``requires_grad``, which the optimizer and
    DeepSpeed hold on to; only the forward's switch is flipped here. ``--frozen_lora`` branches are not PEFT
    layers and stay on: they are part of the base."""
    layers = lora_layers(dit)
    saved = [m._disable_adapters for m in layers]
    try:
        for m in layers:
            m._disable_adapters = True
        yield dit
    finally:
        for m, s in zip(layers, saved):
            m._disable_adapters = s


FIX_PAIRS = ("give each such row a rejected image (the 'rejected' column beside the target, docs/PREFERENCE.md) and "
             "re-run `qie cache`, or drop the rows from the metadata file")


def _source(store) -> str:
    """Where a store's rows come from, for a message: the metadata file (and the cache made from it)."""
    cache = getattr(store, "cache_dir", None)
    if cache is None:  # --on_the_fly: the LiveStore reads its metadata file itself
        return str(store.config.dataset.dataset_metadata)
    return f"{store.manifest.get('metadata', 'its metadata file')}, cached in {cache}"


def check_pairs(dataset) -> None:
    """Before anything loads: every training row of ``dataset`` (a ``training.data.CacheDataset``) is a pair, else
    one ``ValueError`` naming the rows without a rejected image, their metadata file and the fix."""
    missing: dict[str, list[str]] = {}
    for part in dataset.parts:
        for i in part.indices:
            meta = part.store.meta(i)
            if not meta.has_rejected:
                missing.setdefault(_source(part.store), []).append(meta.row_id)
    if missing:
        n = sum(map(len, missing.values()))
        rows = "; ".join(f"{', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''} ({where})"
                         for where, ids in missing.items())
        raise ValueError(f"--loss dpo trains on chosen/rejected pairs, but {n} of {len(dataset)} training rows have "
                         f"no rejected image: {rows}; {FIX_PAIRS}")


def _rejected_of(batch: dict) -> list:
    rejected = batch.get("rejected_latents") or [None] * len(batch["target_latents"])
    for b, (w, l) in enumerate(zip(batch["target_latents"], rejected)):
        where = f"entry {batch['entry_id'][b]!r}" if "entry_id" in batch else f"batch position {b}"
        if l is None:
            raise ValueError(f"--loss dpo: {where} has no rejected image; {FIX_PAIRS}")
        if tuple(l.shape) != tuple(w.shape):
            raise ValueError(f"--loss dpo: {where}: rejected latents {tuple(l.shape)} differ from the chosen "
                             f"{tuple(w.shape)}; re-run `qie cache` (it fits the rejected image to the target's size)")
    return rejected


# --- the loss --------------------------------------------------------------------
def flow_dpo_loss(dit, batch: dict, config, generator: "torch.Generator | None" = None
                  ) -> "tuple[Tensor, dict[str, float | Tensor]]":
    """Diffusion-DPO loss of a batch of preference pairs (see the module docstring)."""
    import torch

    from ...models.family_ops import ops_for
    from ...models.presets import family_of
    from .common import draw_flow_points, joined_prompts, per_sample_mse, pixel_weights, weighted_batch_mean

    chosen = batch["target_latents"]
    rejected = _rejected_of(batch)
    n, beta = len(chosen), float(SPEC.config_of(config).dpo_beta)
    ops = ops_for(family_of(config.train.model))
    # σ_b then ε_b, sample by sample (as sft.py), one ε for both images of the pair
    points = draw_flow_points(chosen, config.timesteps, generator, family=ops.family,
                              weighting=config.loss.loss_weighting, strata=batch.get("timestep_strata"))
    noisy_l, velocity_l = points.at(rejected)
    noisy, velocity = [points.noisy, noisy_l], [points.target, velocity_l]
    timesteps = points.timesteps.to(chosen[0].device)
    prompts = joined_prompts(ops, batch)
    pixel_w = pixel_weights(config.loss.mask_loss_weights, batch.get("back_mask"), n)

    def errors(grad: bool) -> "Tensor":  # [2, B]: chosen and rejected in one DiT call of 2B samples
        pred = ops.forward(dit, noisy[0] + noisy[1], torch.cat([timesteps, timesteps]), prompts * 2,
                           list(batch["edit_latents"]) * 2, zero_cond_t=bool(config.train.zero_cond_t),
                           use_gradient_checkpointing=grad and config.train.gradient_checkpointing)
        errs = [per_sample_mse(p, t, w) for p, t, w in zip(pred, velocity[0] + velocity[1], pixel_w * 2)]
        return torch.stack(errs).view(2, n)

    policy = errors(torch.is_grad_enabled())
    with torch.no_grad(), lora_switched_off(dit):
        ref = errors(False)
    losses, margin = dpo_terms(policy[0], policy[1], ref[0], ref[1], beta)
    loss = weighted_batch_mean(list(losses), points.weights)
    metrics = {
        "dpo_accuracy": (margin > 0).float().mean().detach(),
        "dpo_margin": margin.detach().mean(),
        "mse_chosen": policy[0].detach().mean(),
        "mse_rejected": policy[1].detach().mean(),
        "sigma_mean": float(points.sigmas.mean()),
        "weight_mean": float(points.weights.mean()),
    }
    return loss, metrics


def _setup(module, cfg, preset, device, dtype, ds_config) -> None:
    """Before anything trains: the reference is the base with the LoRA off, so every trained weight must be
    a LoRA weight."""
    if cfg.lora.full_finetune_modules:
        raise ValueError("--loss dpo takes the base with the LoRA switched off as its reference; fully trained "
                         f"modules ({', '.join(cfg.lora.full_finetune_modules)}) cannot be switched off: drop "
                         "--full_finetune_modules")
    lora_layers(module.dit)


SPEC = LossSpec(
    name="dpo", summary="Diffusion-DPO on chosen/rejected pairs, reference = the base (docs/PREFERENCE.md)",
    fn=flow_dpo_loss, config=DPOConfig, stratified_sigma=True, default_optimizer="adamw", preference=True, setup=_setup,
    check_data=check_pairs)
