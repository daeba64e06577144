"""The VAE side of validation: latents to images.

The VAE loads alone (a VAE-only pipeline of the preset), lazily, on the first validation: on the main process, or
on every rank under ZeRO-3 (DiffSynth then builds it partitioned, and decoding gathers it collectively:
:meth:`PanelDecoder.gathered`). Decoding goes through the family's ops, so a validation panel is what ``qie edit``
would decode. The reference and target panels of a held-out entry do not change between validations: each is
decoded once and kept.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from PIL import Image


class PanelDecoder:
    """Decodes validation latents with the preset's VAE (loaded on first use; see the module docstring)."""

    def __init__(self, preset, model_dir: Optional[str], accelerator, dtype: torch.dtype):
        self.preset = preset
        self.model_dir = model_dir
        self.accelerator = accelerator
        self.dtype = dtype
        self.vae_pipe = None
        self._panels: dict[tuple[int, str], Image.Image] = {}  # (entry, "reference<k>"|"target"|"ref_gt")

    @staticmethod
    def zero3() -> bool:
        from transformers.integrations import is_deepspeed_zero3_enabled

        return is_deepspeed_zero3_enabled()

    def pipe(self):
        """VAE-only pipeline, loaded on first use."""
        if self.vae_pipe is None:
            from ..models.load.loading import load_pipeline

            device = self.accelerator.device
            device = "cpu" if device.type == "cpu" else str(device)
            self.vae_pipe = load_pipeline(self.preset, model_dir=self.model_dir, components=("vae",),
                                          device=device, torch_dtype=self.dtype)
        return self.vae_pipe

    def gathered(self):
        """Around decoding: under ZeRO-3 the VAE's partitions gathered on every rank, else nothing."""
        if not self.zero3():
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.pipe().vae.parameters()), modifier_rank=None)

    def decode(self, latents: torch.Tensor) -> Image.Image:
        from ..models.family_ops import ops_for
        from ..models.presets import family_of

        return ops_for(family_of(self.preset)).decode(self.pipe(), latents)

    def panel(self, key: tuple[int, str], latents: torch.Tensor) -> Image.Image:
        """The decode of a panel that does not change between validations (``key``: entry, which), kept."""
        if key not in self._panels:
            self._panels[key] = self.decode(latents)
        return self._panels[key]
