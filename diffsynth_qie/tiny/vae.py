"""A tiny ``QwenImageVAE`` with plain convolutional encoder and decoder (the pretrained tiny base).

Why not DiffSynth's own ``QwenImageVAE`` at small widths: its per-pixel RMS
normalisation layers keep a tiny VAE from learning flat colours in minutes of CPU
(red decodes as purple, about 12 dB PSNR on shape pixels). Small plain conv nets
reach about 23 dB on shape pixels in the same time.

The subclass keeps everything the pipeline relies on from the parent: ``encode`` and
``decode`` (5-D ``[B, C, 1, H, W]`` internally, tiling), ``quant_conv`` /
``post_quant_conv`` and the latent normalisation (``mean``/``std``), 16 latent
channels and 8x downscale. Only ``encoder`` and ``decoder`` are replaced. It is
registered in ``diffsynth.configs.MODEL_CONFIGS`` under ``qwen_image_vae`` (see
:func:`register_tiny_vae_config`), so DiffSynth's own loader recognises its file by
the key hash and builds this class.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from diffsynth.models.qwen_image_vae import QwenImageCausalConv3d, QwenImageVAE

Z_DIM = 16
#: Channel widths of the encoder's four levels (the decoder mirrors them).
WIDTHS = (16, 32, 48, 64)


class _Frames2d(nn.Module):
    """Runs a 2-D network on ``[B, C, T, H, W]`` frame by frame (images have T = 1)."""

    def __init__(self, net: nn.Sequential):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = self.net(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        return y.reshape(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)


def _encoder(widths=WIDTHS, z_dim: int = Z_DIM, channels: int = 3) -> nn.Sequential:
    """Image (``channels``: 3 RGB; 4 RGBA for the tiny 2.1) -> mean and log-variance, halving per width step."""
    layers: list[nn.Module] = [nn.Conv2d(channels, widths[0], 3, padding=1), nn.SiLU()]
    for cin, cout in zip(widths[:-1], widths[1:]):
        layers += [nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.SiLU()]
    layers += [nn.Conv2d(widths[-1], 2 * z_dim, 3, padding=1)]
    return nn.Sequential(*layers)


def _decoder(widths=WIDTHS, z_dim: int = Z_DIM, channels: int = 3) -> nn.Sequential:
    rev = widths[::-1]
    layers: list[nn.Module] = [nn.Conv2d(z_dim, rev[0], 3, padding=1), nn.SiLU()]
    for cin, cout in zip(rev[:-1], rev[1:]):
        layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(cin, cout, 3, padding=1), nn.SiLU()]
    layers += [nn.Conv2d(rev[-1], channels, 3, padding=1)]
    return nn.Sequential(*layers)


class TinyConvQwenImageVAE(QwenImageVAE):
    """``QwenImageVAE`` whose encoder/decoder are small plain conv nets (about 120 k parameters)."""

    def __init__(self, widths=WIDTHS, z_dim: int = Z_DIM):
        nn.Module.__init__(self)
        assert z_dim == 16, "the pipeline's latent statistics and the DiT assume 16 latent channels"
        widths = tuple(widths)
        self.z_dim = z_dim
        self.temperal_downsample = [False, True, True]
        self.temperal_upsample = self.temperal_downsample[::-1]
        self.encoder = _Frames2d(_encoder(widths, z_dim))
        self.quant_conv = QwenImageCausalConv3d(z_dim * 2, z_dim * 2, 1)
        self.post_quant_conv = QwenImageCausalConv3d(z_dim, z_dim, 1)
        self.decoder = _Frames2d(_decoder(widths, z_dim))
        # The parent's latent normalisation constants (plain tensors, as in the parent).
        mean, inv_std = _parent_stats()
        self.mean, self.std = mean.clone(), inv_std.clone()


@functools.lru_cache(maxsize=1)
def _parent_stats() -> tuple[torch.Tensor, torch.Tensor]:
    """The parent's ``mean`` and ``1/std`` tensors (built once on the CPU, small widths)."""
    vae = QwenImageVAE(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    return vae.mean.clone(), vae.std.clone()


_VAE_CLASS = f"{__name__}.TinyConvQwenImageVAE"


@functools.lru_cache(maxsize=1)
def tiny_vae_model_config() -> dict:
    """The ``MODEL_CONFIGS`` entry of the conv VAE's weight file (hash of its key names and shapes)."""
    from .install import model_config

    return model_config(TinyConvQwenImageVAE(), _VAE_CLASS, "qwen_image_vae", widths=list(WIDTHS), z_dim=Z_DIM)


def register_tiny_vae_config() -> None:
    """Append the conv VAE to ``diffsynth.configs.MODEL_CONFIGS`` (idempotent; same list object)."""
    from .install import register_model_configs

    register_model_configs((tiny_vae_model_config(),), {})
