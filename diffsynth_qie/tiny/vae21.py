"""A tiny ``QwenImage21VAE`` with plain convolutional encoder and decoder (the pretrained tiny 2.1 base).

The 2.1 counterpart of ``vae.py``, for the same reason: the per-pixel RMS normalisation layers of DiffSynth's
VAE keep a tiny one from learning flat colours in minutes of CPU, and small plain conv nets do. The subclass
keeps everything the pipeline relies on from the parent: ``encode`` and ``decode`` (5-D ``[B, C, 1, H, W]``
internally, the clamp, tiling), ``quant_conv`` / ``post_quant_conv`` and the latent normalisation
(``latents_mean`` / ``latents_std``), 64 latent channels, 16x downscale, RGBA in and out. Only ``encoder`` and
``decoder`` are replaced. It is registered in ``diffsynth.configs.MODEL_CONFIGS`` under ``qwen_image_21_vae``
(:func:`register_tiny_vae21_config`), so DiffSynth's own loader recognises its file by the key hash.
"""
from __future__ import annotations

import functools

from torch import nn

from diffsynth.models.qwen_image_21_vae import QwenImage21CausalConv3d, QwenImage21VAE

from .vae import _decoder, _encoder, _Frames2d

Z_DIM = 64
CHANNELS = 4  # RGBA
#: Channel widths of the encoder's five levels (four stride-2 steps: 16x); the decoder mirrors them.
WIDTHS = (16, 32, 48, 64, 96)


class TinyConvQwenImage21VAE(QwenImage21VAE):
    """``QwenImage21VAE`` whose encoder/decoder are small plain conv nets."""

    def __init__(self, widths=WIDTHS, z_dim: int = Z_DIM):
        nn.Module.__init__(self)
        if z_dim != Z_DIM:
            raise ValueError(f"the 2.1 pipeline and DiT take {Z_DIM} latent channels, got z_dim={z_dim}")
        parent = _parent()
        widths = tuple(widths)
        self.z_dim = z_dim
        self.temperal_downsample = parent.temperal_downsample
        self.temperal_upsample = parent.temperal_upsample
        self.patch_size = None
        self.scale_factor_temporal, self.scale_factor_spatial = parent.scale_factor_temporal, 16
        self.latents_mean, self.latents_std = parent.latents_mean.clone(), parent.latents_std.clone()
        self.encoder = _Frames2d(_encoder(widths, z_dim, CHANNELS))
        self.quant_conv = QwenImage21CausalConv3d(z_dim * 2, z_dim * 2, 1)
        self.post_quant_conv = QwenImage21CausalConv3d(z_dim, z_dim, 1)
        self.decoder = _Frames2d(_decoder(widths, z_dim, CHANNELS))
        self.spatial_compression_ratio = 2 ** (len(widths) - 1)
        self.use_slicing, self.use_tiling = False, False
        self.tile_sample_min_height = self.tile_sample_min_width = 256
        self.tile_sample_stride_height = self.tile_sample_stride_width = 192
        self._cached_conv_counts = {"decoder": 0, "encoder": 0}  # no causal caches: images only


@functools.lru_cache(maxsize=1)
def _parent() -> QwenImage21VAE:
    """The parent at its smallest (its constants: latent statistics, temporal flags)."""
    return QwenImage21VAE(base_dim=8, decoder_base_dim=8, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1)


_VAE_CLASS = f"{__name__}.TinyConvQwenImage21VAE"


@functools.lru_cache(maxsize=1)
def tiny_vae21_model_config() -> dict:
    """The ``MODEL_CONFIGS`` entry of the conv VAE's weight file (hash of its key names and shapes)."""
    from .install import model_config

    return model_config(TinyConvQwenImage21VAE(), _VAE_CLASS, "qwen_image_21_vae", widths=list(WIDTHS), z_dim=Z_DIM)


def register_tiny_vae21_config() -> None:
    """Append the conv VAE to ``diffsynth.configs.MODEL_CONFIGS`` (idempotent), with its parent's VRAM map."""
    from .install import register_model_configs

    register_model_configs((tiny_vae21_model_config(),),
                           {_VAE_CLASS: "diffsynth.models.qwen_image_21_vae.QwenImage21VAE"})
