"""What an edit is asked for (:class:`EditRequest`), what it gives back (:class:`EditResult`), and its output
size. Pure data: ``qie edit``, the UI, evaluation and the fake-device check all build an ``EditRequest``, and
``inference/editor.py`` runs it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from PIL import Image

from ..data.images import MAX_IMAGE_PIXELS, fit_image
from ..models.prompts import DEFAULT_MAX_PROMPT_TOKENS
from ..models.samplers.cached_blocks import CacheStats

Tensor = torch.Tensor
DEFAULT_MAX_PIXELS = 1024 * 1024


@dataclass
class EditRequest:
    """One edit. Sizes are pixels; the output size must be a multiple of 16."""

    images: Sequence[Image.Image]            # 1..n reference images; the first is the one being edited
    prompt: str
    negative_prompt: str = ""
    mask: Optional[Image.Image] = None       # white (>=128) = may change; None = whole image
    steps: Optional[int] = None              # flow-matching steps (ignored with lbm_steps); None: the model's default
    cfg: Optional[float] = None              # true CFG scale (flow matching); 1 = no negative pass; None: the model's
                                             # default (4 for Qwen-Image-Edit, 1 for Qwen-Image-2.1)
    seed: int = 0
    height: Optional[int] = None             # default: first image fitted to max_pixels
    width: Optional[int] = None
    max_pixels: int = DEFAULT_MAX_PIXELS     # output budget when height/width are not given
    max_output_pixels: int = MAX_IMAGE_PIXELS  # refuse a larger explicit height x width (the input cap)
    ref_max_pixels: Optional[int] = DEFAULT_MAX_PIXELS  # per reference image (downscale only); None = as given
    mask_blend: float = 1.0                  # 0 = ignore the mask, 1 = outside kept exactly
    mask_feather: float = 0.0                # pixel-blend feather (Gaussian radius, px) inside the mask
    lbm_steps: Optional[int] = None          # None = flow matching; N >= 1 = LBM bridge sampling
    lbm_noise: float = 0.005                 # LBM bridge noise s
    lbm_cfg: float = 1.0                     # CFG for LBM (off by default)
    max_prompt_tokens: Optional[int] = DEFAULT_MAX_PROMPT_TOKENS  # longer prompts are refused; None = no limit
    scheduler: str = "default"               # flow matching: "default" or "lightning" (few-step LoRAs, CFG 1)
    strength: float = 1.0                    # edit strength: 0 = the source, 1 = the full edit (SDEdit-style start)
    kv_cache: bool = True                    # keep a prefix's keys/values across steps (Qwen-Image-2.1); False
                                             # recomputes them at every step: slower, GiBs less at 10 references
    sigmas: Optional[Sequence[float]] = None  # a fixed grid (a LoRA's declared schedule); None: the model's own
    cache: Any = "off"                       # step cache: off (exact), balanced, fast, or a CacheSettings (step_cache.py)
    cache_method: Optional[str] = None       # first_block or schedule; None: the level's own
    cache_threshold: Optional[float] = None  # None: the level's own
    progress: Optional[Callable[[int, int], None]] = field(default=None, repr=False)
    preview_every: int = 0                   # a live preview every N denoising steps (0 = none; the last step never:
                                             # that is the result); needs ``preview``
    # preview(step, total, image): the decoded clean latents that step predicted (flow matching: x − σ·v; LBM: the
    # main stream's); the result is bit-identical with and without previews
    preview: Optional[Callable[[int, int, Image.Image], None]] = field(default=None, repr=False)


@dataclass
class EditResult:
    image: Image.Image                       # the edit (LBM: main stream)
    sub_image: Optional[Image.Image]         # LBM sub-stream (white prior) result; None for flow matching
    latents: Tensor                          # final latents [B, 16, h, w] on CPU (LBM: B=2, main then sub)
    width: int
    height: int
    seconds: float
    cache: Optional[CacheStats] = None       # what the step cache reused (None: no cache)


# --- sizes --------------------------------------------------------------------------
def output_size(request: EditRequest, first: Image.Image, divisor: int = 16) -> tuple[int, int]:
    """(width, height): explicit (multiples of ``divisor``: 16, or 32 for Qwen-Image-2.1) or the first image
    fitted to ``max_pixels``."""
    if (request.height is None) != (request.width is None):
        raise ValueError(f"give both height and width or neither (got height={request.height}, "
                         f"width={request.width})")
    if request.height is None:
        return fit_image(first.size, request.max_pixels, divisor, "the first reference image")
    for name, value in (("height", request.height), ("width", request.width)):
        if value < divisor or value % divisor:
            raise ValueError(f"{name}={value} must be a positive multiple of {divisor} for this model "
                             f"(e.g. {max(divisor, value // divisor * divisor)})")
    return int(request.width), int(request.height)
