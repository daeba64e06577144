"""``qie train --on_the_fly``'s settings (part of :class:`~.config.RunConfig`; their own module to keep
``config.py`` small)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..utils.config_cli import cli_help as _help


@dataclass
class OnTheFlyConfig:
    """Training without a cache: the metadata is read directly (the dataset and field-name flags of `qie cache`)
    and every batch is encoded as training asks for it (``cache/live.py``)."""

    on_the_fly: bool = field(default=False, metadata=_help(
        "encode each batch during training instead of reading a `qie cache` directory (--dataset_metadata "
        "instead of --cache_dir): for datasets too large to cache, augmentation, or quick experiments"))
    max_pixels: int = field(default=1024 * 1024, metadata=_help(
        "--on_the_fly: pixel budget of target and ref_gt images (as `qie cache --max_pixels`)", min=256, max=1 << 32))
    edit_max_pixels: Optional[int] = field(default=None, metadata=_help(
        "--on_the_fly: pixel budget of each reference image (default: --max_pixels)", unbounded=True))
    text_encoder_device: Optional[str] = field(default=None, metadata=_help(
        "--on_the_fly: device of the text encoder (default: the training device; cpu runs it beside the DiT step)"))
    vae_device: Optional[str] = field(default=None, metadata=_help(
        "--on_the_fly: device of the VAE encoder (default: the training device); its decoder loads only for validation"))
    augment: bool = field(default=False, metadata=_help(
        "--on_the_fly: per sample and epoch, a random crop-and-resize (80-100 %% of the side) of target, "
        "references and mask together, and a horizontal flip of all of them with probability 0.5; seeded by "
        "(seed, epoch, sample), so a resume repeats it"))
    prefetch: int = field(default=2, metadata=_help(
        "--on_the_fly: batches encoded ahead in a background thread while the DiT trains (0: encode inline)",
        unbounded=True))
