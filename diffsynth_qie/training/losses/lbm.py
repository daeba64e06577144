"""Latent Bridge Matching (LBM): train an edit model into a 1–4-step image-to-image translator.

DiffSynth's scheduler convention throughout: σ = 1 at the prior, σ = 0 at the target,
``v = dx/dσ`` and the DiT sees ``timestep = 1000·σ``. Two streams, one per sample:

- **main**: prior z_S = the first reference image encoded at the target's latent
  size (cache field ``lbm_source_latents``), target z_T = ``target_latents``;
- **sub**: prior z_W = the white-image latents (``sub_noise``), target z_T, or with
  ``--lbm_sub_target ref_gt`` the row's ``ref_gt_latents`` (prior ``sub_noise_ref_gt``,
  the white latents at ref_gt's size) where the row has one.

Bridge ``x_σ = (1−σ)·z_T + σ·z_prior + s·√(σ(1−σ))·ε``, regression target
``v* = z_prior − z_T`` (``models/samplers/bridge.py``, shared with the sampler). The DiT sees the noisy target tokens next to the reference
images' tokens and the cached prompt embedding exactly as in editing, through the model family's DiT call
(``FamilyOps.forward``: ``zero_cond_t`` from the run config for Qwen-Image-Edit; Qwen-Image-2.1 reads the
references in its prefix at t=0 whatever σ the target is at), so the sampler (``models/samplers/sampling.py``: start at the prior,
σ_k = linspace(1, 1/N, N), Euler ``x ← x + (σ_{k+1} − σ_k)·v``) runs the same
conditioning. Loss: MSE over the target tokens, optionally ``back_mask``-weighted
(``--mask_loss_weights``), at weight 1 — not DiffSynth's bell-shaped
``training_weight``, which is ≈0 at σ = 1, the only σ a 1-step sampler uses
(``--loss_weighting`` is ignored here).

Per sample, in this order from the loss's generator: a uniform draw u for the stream
(sub when ``u < p_sub``), σ, then ε. A sample that lacks what its stream needs (no
``lbm_source_latents``: a text-to-image row) takes the other stream, so every row is
used. The whole batch is one call of the family's forward.

This module imports no torch at import time (``qie --help`` builds the flags from
:class:`LBMConfig`); its :class:`~.spec.LossSpec` is ``SPEC`` at the end, listed in ``registry.py``.
With ``--loss lbm`` the optimizer defaults to ProdigyPlusScheduleFree (lr 1.0, no
weight decay, no clipping: ``RunConfig.resolved``), and training refuses clipping
with it (``optim.check_clipping``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional, Sequence

from .spec import LossSpec

if TYPE_CHECKING:
    import torch

    Tensor = torch.Tensor

STREAMS = ("main", "sub")


@dataclass
class LBMConfig:
    """Latent bridge matching (used with --loss lbm)."""

    lbm_p_sub: float = field(default=0.5, metadata={"help": (
        "probability per sample of training the sub-stream (white image -> target) instead of the main "
        "stream (source image -> target); 0.5 trains both equally, 0 only main, 1 only sub. A row lacking "
        "a stream's inputs uses the other stream"), "unbounded": True})
    lbm_sub_target: Literal["target", "ref_gt"] = field(default="target", metadata={"help": (
        "what the sub-stream bridges the white image to: the row's target, or its ref_gt image where the "
        "row has one (else its target)")})
    lbm_sigma_sampling: Literal["grid", "uniform"] = field(default="grid", metadata={"help": (
        "training σ per sample: uniform over --lbm_sigma_grid (match the sampler's steps), or uniform in (0, 1]")})
    lbm_sigma_grid: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0], metadata={"help": (
        "σ values for --lbm_sigma_sampling grid; the default covers the 1-, 2- and 4-step samplers' σ's "
        "(linspace(1, 1/N, N))"), "metavar": "SIGMA", "unbounded": True})
    lbm_bridge_noise: float = field(default=0.005, metadata={"help": (
        "bridge noise s: x_σ gets s·sqrt(σ(1-σ))·ε (use the same value at inference, qie edit --lbm_noise)"),
        "unbounded": True})
    lbm_pixel_loss: Literal["none", "lpips"] = field(default="none", metadata={"help": (
        "add a pixel-space perceptual loss as in the LBM reference: LPIPS between the VAE-decoded predicted "
        "target and the target, on a random crop (loads the VAE decoder in phase 2; LPIPS backbone weights "
        "must be in the torch hub cache)")})
    lbm_pixel_weight: float = field(default=10.0, metadata={"help": (
        "weight W of the pixel loss: loss = mse + W·LPIPS (the LBM reference example uses 10)"), "unbounded": True})
    lbm_pixel_crop: int = field(default=512, metadata={"help": (
        "largest side in pixels of the random crop decoded for the pixel loss (a multiple of 8, >= 64)"),
        "unbounded": True})

    def __post_init__(self):
        """Raise ``ValueError`` naming the bad flag (so `qie train` fails before loading anything)."""
        if not 0.0 <= float(self.lbm_p_sub) <= 1.0:
            raise ValueError(f"--lbm_p_sub is a probability in [0, 1], got {self.lbm_p_sub}")
        if self.lbm_sub_target not in ("target", "ref_gt"):
            raise ValueError(f"--lbm_sub_target must be target or ref_gt, got {self.lbm_sub_target!r}")
        if self.lbm_sigma_sampling not in ("grid", "uniform"):
            raise ValueError(f"--lbm_sigma_sampling must be grid or uniform, got {self.lbm_sigma_sampling!r}")
        grid = [float(s) for s in (self.lbm_sigma_grid or [])]
        if self.lbm_sigma_sampling == "grid" and (not grid or not all(0.0 < s <= 1.0 for s in grid)):
            raise ValueError(f"--lbm_sigma_grid needs one or more values in (0, 1], got {self.lbm_sigma_grid}")
        self.lbm_sigma_grid = grid
        if not self.lbm_bridge_noise >= 0:
            raise ValueError(f"--lbm_bridge_noise must be >= 0, got {self.lbm_bridge_noise}")
        if self.lbm_pixel_loss not in ("none", "lpips"):
            raise ValueError(f"--lbm_pixel_loss must be none or lpips, got {self.lbm_pixel_loss!r}")
        if not float(self.lbm_pixel_weight) >= 0:
            raise ValueError(f"--lbm_pixel_weight must be >= 0, got {self.lbm_pixel_weight}")
        if int(self.lbm_pixel_crop) < 64 or int(self.lbm_pixel_crop) % 8:
            raise ValueError(f"--lbm_pixel_crop must be a multiple of 8 (pixels per latent pixel) and at least 64 "
                             f"(LPIPS's smallest input), got {self.lbm_pixel_crop}")


def lbm_config_of(config) -> LBMConfig:
    """The run's :class:`LBMConfig` (defaults when the run config carries none)."""
    lbm = getattr(config, "lbm", None)
    if lbm is None:
        return LBMConfig()
    if isinstance(lbm, dict):  # a RunConfig read back from JSON
        return LBMConfig(**{f.name: lbm[f.name] for f in dataclasses.fields(LBMConfig) if f.name in lbm})
    return lbm


# --- pure helpers ----------------------------------------------------------------
def draw_sigmas(n: int, config: LBMConfig, generator: Optional["torch.Generator"] = None) -> "Tensor":
    """``[n]`` float32 σ's: uniform over ``lbm_sigma_grid``, or uniform in (0, 1]."""
    import torch

    if config.lbm_sigma_sampling == "grid":
        grid = torch.tensor(config.lbm_sigma_grid, dtype=torch.float32)
        return grid[torch.randint(len(grid), (n,), generator=generator)]
    if config.lbm_sigma_sampling == "uniform":
        return 1.0 - torch.rand(n, generator=generator)  # [0, 1) -> (0, 1]
    raise ValueError(f"unknown --lbm_sigma_sampling {config.lbm_sigma_sampling!r}; use grid or uniform")


@dataclass
class BridgeEnds:
    """One sample's bridge: which stream, its prior (σ = 1) and target (σ = 0), loss mask."""

    stream: str                         # "main" | "sub"
    prior: "Tensor"                     # [C, h, w] (the family's latent channels)
    target: "Tensor"                    # [C, h, w]
    back_mask: Optional["Tensor"]       # [1, h, w] at the target's latent size, or None


def _row_name(batch: dict, b: int) -> str:
    for key in ("entry_id", "index"):
        if key in batch:
            return f"{key}={batch[key][b]!r}"
    return f"batch position {b}"


def _get(batch: dict, key: str, b: int):
    values = batch.get(key)
    return None if values is None else values[b]


def _fit_mask(mask: Optional["Tensor"], shape: Sequence[int]) -> Optional["Tensor"]:
    """The ``[1, h, w]`` mask at latent size ``shape`` (ref_gt may have its own size;
    target, mask and ref_gt of a row are resized without cropping, so they stay aligned)."""
    if mask is None or tuple(mask.shape[-2:]) == tuple(shape):
        return mask
    import torch.nn.functional as F

    return F.interpolate(mask[None].float(), size=tuple(shape), mode="bilinear", antialias=True,
                         align_corners=False)[0].to(mask.dtype)


def stream_ends(batch: dict, b: int, want_sub: bool, sub_target: str = "target") -> BridgeEnds:
    """Sample ``b``'s bridge for the wanted stream, or the other one if the row lacks its inputs.

    main needs ``lbm_source_latents``; sub needs ``sub_noise`` (with ``sub_target="ref_gt"``
    it uses ``ref_gt_latents`` + ``sub_noise_ref_gt`` when both are present, otherwise
    the target with ``sub_noise``). A row with neither raises ``ValueError`` naming it.
    """
    target = batch["target_latents"][b]
    source = _get(batch, "lbm_source_latents", b)
    main = None
    if source is not None:
        if tuple(source.shape) != tuple(target.shape):
            raise ValueError(f"LBM: {_row_name(batch, b)} has lbm_source_latents of shape {tuple(source.shape)} but "
                             f"target_latents of shape {tuple(target.shape)}; rebuild the cache with `qie cache`")
        main = BridgeEnds("main", source, target, _get(batch, "back_mask", b))
    sub = None
    ref_gt, white_ref_gt = _get(batch, "ref_gt_latents", b), _get(batch, "sub_noise_ref_gt", b)
    white = _get(batch, "sub_noise", b)
    if sub_target == "ref_gt" and ref_gt is not None and white_ref_gt is not None:
        sub = BridgeEnds("sub", white_ref_gt, ref_gt, _fit_mask(_get(batch, "back_mask", b), ref_gt.shape[-2:]))
    elif white is not None:
        sub = BridgeEnds("sub", white, target, _get(batch, "back_mask", b))
    if sub is not None and tuple(sub.prior.shape) != tuple(sub.target.shape):
        raise ValueError(f"LBM: {_row_name(batch, b)} has white latents of shape {tuple(sub.prior.shape)} for a "
                         f"sub-stream target of shape {tuple(sub.target.shape)}; rebuild the cache with `qie cache`")
    chosen = (sub or main) if want_sub else (main or sub)
    if chosen is None:
        raise ValueError(f"LBM: {_row_name(batch, b)} has neither lbm_source_latents (main stream) nor sub_noise "
                         "(sub-stream); rebuild the cache with `qie cache` (it writes both)")
    return chosen


@dataclass
class BridgeBatch:
    """What the LBM loss feeds the DiT and regresses, per sample (lists of length B)."""

    ends: list[BridgeEnds]
    sigmas: "Tensor"          # [B] float32
    noise: list["Tensor"]     # ε per sample
    noisy: list["Tensor"]     # x_σ, in the latents' dtype
    velocity: list["Tensor"]  # v* = prior − target, fp32

    @property
    def timesteps(self) -> "Tensor":
        """``[B]`` DiT timesteps 1000·σ (float32)."""
        return 1000.0 * self.sigmas

    @property
    def streams(self) -> list[str]:
        return [e.stream for e in self.ends]


def make_bridge_batch(batch: dict, config: LBMConfig, generator: Optional["torch.Generator"] = None) -> BridgeBatch:
    """Draw per sample: stream (u < p_sub -> sub), σ, ε; build x_σ and v*."""
    import torch

    from ...models.samplers.bridge import bridge_interpolate, bridge_target
    from .common import sample_noise

    ends, sigmas, noise, noisy, velocity = [], [], [], [], []
    for b in range(len(batch["target_latents"])):
        want_sub = float(torch.rand(1, generator=generator)) < config.lbm_p_sub
        e = stream_ends(batch, b, want_sub, config.lbm_sub_target)
        sigma = draw_sigmas(1, config, generator)
        eps = sample_noise(e.target, generator)
        ends.append(e)
        sigmas.append(sigma)
        noise.append(eps)
        noisy.append(bridge_interpolate(e.target, e.prior, sigma, config.lbm_bridge_noise, eps))
        velocity.append(bridge_target(e.target, e.prior))
    return BridgeBatch(ends, torch.cat(sigmas), noise, noisy, velocity)


# --- the loss --------------------------------------------------------------------
def lbm_loss(dit, batch: dict, config, generator: Optional["torch.Generator"] = None, pixel_critic=None):
    """Latent bridge matching loss of a batch: ``(loss, metrics)`` (see the module docstring).

    Metrics: ``mse`` (all samples), ``mse_main`` / ``mse_sub`` (only when the batch has
    that stream), ``frac_sub`` (share of sub-stream samples), ``sigma_mean``; with a
    ``pixel_critic`` (``--lbm_pixel_loss lpips``, ``lbm_pixel.py``) each sample adds
    ``W·LPIPS`` and ``lpips`` is logged.
    """
    import torch

    from ...models.family_ops import ops_for
    from ...models.presets import family_of
    from .common import joined_prompts, per_sample_mse, pixel_weights

    lbm = lbm_config_of(config)
    ops = ops_for(family_of(config.train.model))  # the family's DiT call (2.1: references in its t=0 prefix)
    bridge = make_bridge_batch(batch, lbm, generator)
    pred = ops.forward(
        dit, bridge.noisy, bridge.timesteps.to(bridge.noisy[0].device), joined_prompts(ops, batch),
        batch["edit_latents"], zero_cond_t=bool(config.train.zero_cond_t),
        use_gradient_checkpointing=bool(config.train.gradient_checkpointing) and torch.is_grad_enabled(),
    )
    pixel_w = pixel_weights(config.loss.mask_loss_weights, [e.back_mask for e in bridge.ends], len(pred))
    losses = torch.stack([per_sample_mse(p, v, w) for p, v, w in zip(pred, bridge.velocity, pixel_w)])
    detached = losses.detach()
    extra = {}
    if pixel_critic is not None:
        from .lbm_pixel import predicted_targets

        perceptual = pixel_critic.losses(predicted_targets(bridge.noisy, pred, bridge.sigmas),
                                         [e.target for e in bridge.ends], generator)
        losses = losses + pixel_critic.weight * perceptual.to(losses.device)
        extra["lpips"] = perceptual.detach().mean()
    loss = losses.mean()
    metrics = {"mse": detached.mean(), "frac_sub": bridge.streams.count("sub") / len(bridge.streams),
               "sigma_mean": float(bridge.sigmas.mean())}
    for stream in STREAMS:
        rows = [i for i, s in enumerate(bridge.streams) if s == stream]
        if rows:  # logged only when the batch has the stream (the loop averages over batches that do)
            metrics[f"mse_{stream}"] = detached[rows].mean()
    return loss, {**metrics, **extra}


def attach_pixel_critic(module, cfg, preset, device, dtype, ds_config) -> None:
    """Run set-up: with ``--lbm_pixel_loss lpips`` give the module its :class:`~.lbm_pixel.PixelCritic`."""
    lbm = lbm_config_of(cfg)
    if lbm.lbm_pixel_loss == "none":
        return
    from .lbm_pixel import build_pixel_critic

    module.pixel_critic = build_pixel_critic(lbm, preset, cfg.train.model_dir, device, dtype, ds_config)


SPEC = LossSpec(
    name="lbm", summary="latent bridge matching (source image -> target, 1-4 step edits)", fn=lbm_loss,
    config=LBMConfig, bridge=True, sigma_note="draws its σ's with --lbm_sigma_sampling",
    default_optimizer="prodigy_sf", setup=attach_pixel_critic)
