"""An :class:`~.editor.EditRequest` checked before anything is encoded: every value a caller can get wrong
ends in one ``ValueError`` naming the field and the fix (the command line checks its flags too, in
``utils/cli_checks.py``; Python callers and the UI come through here)."""
from __future__ import annotations

import math

from PIL import Image

from ..data.images import check_pixels
from ..models.samplers.lightning import check_scheduler
from ..models.samplers.step_cache import cache_settings
from ..utils.text import is_empty_prompt
from .masking import check_strength


def _finite(name: str, value, lo: float | None = None) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


def check_request(request) -> None:
    if not request.images:
        raise ValueError("an edit needs at least one reference image")
    for i, im in enumerate(request.images):
        if not isinstance(im, Image.Image):
            raise ValueError(f"images[{i}] is a {type(im).__name__}, not a PIL image; load it with data.images.load_rgb")
        check_pixels(*im.size, f"images[{i}]")
    if is_empty_prompt(request.prompt):
        raise ValueError(f"the prompt {request.prompt!r} says nothing (empty, spaces or invisible characters); "
                         "describe the edit")
    check_scheduler(request.scheduler)
    if request.lbm_steps is None and request.steps is not None and request.steps < 1:
        raise ValueError(f"steps must be >= 1, got {request.steps}")
    if request.lbm_steps is not None and (int(request.lbm_steps) != request.lbm_steps or request.lbm_steps < 1):
        raise ValueError(f"lbm_steps must be a positive integer (1-4 typical), got {request.lbm_steps!r}")
    for name in ("cfg", "lbm_cfg"):
        if getattr(request, name) is not None:  # (None: the model's default)
            _finite(name, getattr(request, name), 0)
    _finite("mask_feather", request.mask_feather, 0)
    _finite("strength", request.strength, 0)
    if request.strength > 1:
        raise ValueError(f"strength must be in [0, 1] (0 = the source, 1 = the full edit), got {request.strength}")
    _finite("lbm_noise", request.lbm_noise, 0)
    every = getattr(request, "preview_every", 0)
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ValueError(f"preview_every must be a whole number of steps >= 0 (0 = no previews), got {every!r}")
    check_strength(request.mask_blend)
    cache_settings(getattr(request, "cache", "off"), getattr(request, "cache_method", None),
                   getattr(request, "cache_threshold", None))
    if request.height is not None and request.width is not None \
            and request.height * request.width > request.max_output_pixels:
        raise ValueError(f"the requested output {request.width}x{request.height} is "
                         f"{request.width * request.height / 1e6:.1f} MP, more than max_output_pixels "
                         f"({request.max_output_pixels / 1e6:.1f} MP); ask for a smaller size, or raise the limit "
                         "(qie edit --max_output_pixels) if you mean it")
