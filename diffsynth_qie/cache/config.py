"""What `qie cache` is asked to do (``CacheConfig``) and what one call did (``CacheSummary``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from ..data.formats import DatasetConfig, FieldNames
from ..models.preset_flags import preset_help, preset_type
from ..models.presets import DEFAULT_MAX_PROMPT_TOKENS


@dataclass
class CacheConfig:
    """Phase-1 cache: where it goes, which model encodes, how images are sized."""

    cache_dir: Optional[str] = field(default=None, metadata={
        "help": "output directory (a rerun into the same directory resumes and updates it)", "metavar": "DIR"})
    model: str = field(default="2511", metadata={"help": preset_help(), "type": preset_type(), "metavar": "PRESET"})
    model_dir: Optional[str] = field(default=None, metadata={
        "help": "local model directory (the preset's repo layout); default: DiffSynth's download folders",
        "metavar": "DIR"})
    max_pixels: int = field(default=1024 * 1024, metadata={
        "help": "pixel budget of target and ref_gt images (sides rounded down to --divisor, never enlarged)",
        "min": 256, "max": 1 << 32})
    edit_max_pixels: Optional[int] = field(default=None, metadata={
        "help": "pixel budget of each reference image (default: --max_pixels)", "unbounded": True})
    divisor: int = field(default=16, metadata={"help": "image sides are multiples of this", "unbounded": True})
    shard_size: int = field(default=64, metadata={
        "help": "entries per shard file; an interrupted run loses at most this many entries per rank",
        "unbounded": True})
    device: Optional[str] = field(default=None, metadata={
        "help": "encoding device (default: this rank's GPU, else CPU)"})
    text_encoder_device: Optional[str] = field(default=None, metadata={
        "help": "device of the text encoder (default: --device); e.g. a second GPU, or cpu"})
    vae_device: Optional[str] = field(default=None, metadata={
        "help": "device of the VAE (default: --device)"})
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = field(default=None, metadata={
        "help": "encoder and storage dtype (default: bfloat16 on GPU, float32 on CPU)"})
    num_workers: int = field(default=4, metadata={
        "help": "threads decoding and resizing images ahead of the encoders", "min": 0, "max": 1024})
    auto_mask: Literal["none", "diff"] = field(default="none", metadata={
        "help": "diff: rows without a back_mask get one derived from |target - source| (blurred, thresholded, "
                "dilated; marked as derived), for the mask-weighted loss (--mask_loss_weights)"})
    auto_mask_blur: float = field(default=2.0, metadata={
        "help": "--auto_mask diff: Gaussian blur radius, pixels", "unbounded": True})
    auto_mask_threshold: float = field(default=0.1, metadata={
        "help": "--auto_mask diff: a blurred difference above this fraction of the full range is part of the edit",
        "unbounded": True})
    auto_mask_dilate: int = field(default=8, metadata={
        "help": "--auto_mask diff: pixels the region grows by", "unbounded": True})
    check_images: bool = field(default=True, metadata={
        "help": "fully decode every image while validating rows (catches truncated files before encoding)"})
    max_prompt_tokens: int = field(default=DEFAULT_MAX_PROMPT_TOKENS, metadata={
        "help": "rows with a longer prompt (in tokens) are skipped and listed in skipped.jsonl",
        "min": 1, "max": 1 << 20})
    lock_timeout: float = field(default=0.0, metadata={
        "help": "seconds to wait for another `qie cache` run on the same --cache_dir to finish (0: exit at once)",
        "unbounded": True})
    # Filled from their own flag groups by commands/cache.py (shared with `qie train`).
    dataset: DatasetConfig = field(default_factory=DatasetConfig, metadata={"cli": False})
    fields: FieldNames = field(default_factory=FieldNames, metadata={"cli": False})

    def resolved_edit_max_pixels(self) -> int:
        return self.edit_max_pixels or self.max_pixels

    def auto_mask_params(self):
        """The ``--auto_mask diff`` parameters (``data.automask.AutoMask``), or None when it is off."""
        from ..data.automask import AutoMask

        if self.auto_mask == "none":
            return None
        return AutoMask(blur=self.auto_mask_blur, threshold=self.auto_mask_threshold, dilate=self.auto_mask_dilate)


@dataclass
class CacheSummary:
    """What one ``write_cache`` call did (this rank's share)."""

    rank: int
    world_size: int
    rows: int  # rows assigned to this rank that passed validation
    computed: int
    reused: int
    skipped: int
    seconds: float  # the whole call, model loading included
    encode_seconds: float  # decoding + encoding + writing the computed rows
    manifest: Optional[dict] = None  # set on the rank that finalised

    @property
    def rows_per_second(self) -> float:
        """Encoding throughput of this rank (what the progress bar shows)."""
        return self.computed / self.encode_seconds if self.encode_seconds > 0 else 0.0
