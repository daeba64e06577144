"""Generate's inputs, checked: the widgets' values become a :class:`Job`, or a :class:`UIError` saying what to fix.

The check reads no model, so the UI runs it before queueing (a refused Generate
never reaches the queue and never hides the last result) and again when the job runs.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from PIL import Image

from ..utils.text import is_empty_prompt, visible_text
from .config import UIConfig
from .lora_picker import NO_LORA, resolve_lora
from .masks import combine, content_digest, grow_mask
from .results import EditSettings
from .uploads import (NO_IMAGE, UIError, check_upload, editor_parts, image_from_editor, mask_from_editor, reference_images,
                      to_pil, to_rgb_image)

log = logging.getLogger(__name__)

MODE_FLOW = "flow"
MODE_LBM = "lbm"
MODE_LIGHTNING = "lightning"
MODES: tuple[str, ...] = (MODE_FLOW, MODE_LBM, MODE_LIGHTNING)
LBM_MAX_STEPS = 4
MAX_VARIATIONS = 8
MAX_GROW = 64


@dataclass
class GenerateInputs:
    """The values of the UI's widgets when Generate is pressed."""

    editor: Any                      # ImageEditor value {"background", "layers", "composite"}
    prompt: str
    negative_prompt: str = ""
    references: Sequence[Any] | None = None   # gallery value: [(path, caption), ...]
    steps: int = 40
    cfg: float = 4.0
    seed: int = 0                    # < 0 = random
    mask_blend: float = 1.0
    lora: str | None = None          # name relative to the LoRA folder, or NO_LORA
    lora_scale: float = 1.0
    strength: float = 1.0            # edit strength: 0 = the source, 1 = the full edit
    mode: str = MODE_FLOW
    lbm_steps: int = 1
    lora2: str | None = None         # a second LoRA, stacked with the first
    lora2_scale: float = 1.0
    mask_grow: int = 0               # dilate the painted region by this many pixels
    mask_feather: float = 0.0        # soften the mask's inner edge (Gaussian radius, px)
    variations: int = 1              # seeds seed, seed+1, ..., seed+N-1
    mask_file: Any = None            # an uploaded mask (white = may change), united with the paint
    mask_invert: bool = False        # edit everything except the painted region
    loaded_image: str | None = None  # masks.loaded_record of the image the UI last put into the editor


@dataclass
class Job:
    """A checked generation: decoded images, resolved LoRA files, and the settings record."""

    settings: EditSettings
    image: Image.Image
    mask: Image.Image | None
    references: list[Image.Image]
    loras: list[tuple[Path, float]]
    scheduler: str
    seeds: list[int]                 # one generation each (variations)
    lightning_lora: Path | None = None  # the Lightning LoRA the Lightning sampler stacked with the chosen ones


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise UIError(f"{name} must be a whole number, got {value!r}") from None
    if not math.isfinite(as_float) or as_float != int(as_float) or not lo <= as_float <= hi:
        raise UIError(f"{name} must be a whole number in {lo}..{hi}, got {value!r}")
    return int(as_float)


def _float(value: Any, name: str, lo: float, hi: float) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise UIError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(out) or not lo <= out <= hi:
        raise UIError(f"{name} must be in {lo:g}..{hi:g}, got {value!r}")
    return out


def lightning_loras(loras: list, lightning_lora: str | None, steps: int) -> tuple[list, int, float]:
    """The LoRAs, steps and CFG of the Lightning sampler: the chosen LoRA stacked with the
    configured Lightning LoRA; 4 or 8 steps (else the Lightning LoRA's own count); CFG 1."""
    from ..models.lightning import LIGHTNING_STEPS, is_lightning_lora, lightning_steps

    if lightning_lora and not any(Path(p) == Path(lightning_lora) for p, _ in loras):
        if not Path(lightning_lora).is_file():
            raise UIError(f"Lightning LoRA {lightning_lora} not found; fix --lightning_lora")
        loras = [*loras, (Path(lightning_lora), 1.0)]
    paths = [str(p) for p, _ in loras]
    if not any(is_lightning_lora(p) for p in paths):
        raise UIError("the Lightning sampler needs a Lightning LoRA: start the UI with --lightning_lora FILE, "
                      "or pick a LoRA whose name contains 'Lightning'")
    return loras, steps if steps in LIGHTNING_STEPS else lightning_steps(paths), 1.0


def editor_image(editor: Any, loaded: str | None, limit: int,
                 allowed: Callable[[str], bool]) -> tuple[Image.Image, Image.Image | None]:
    """(image, painted mask) of the editor; ``loaded`` is :func:`masks.loaded_record` of the image the UI last put
    into it (an example, "Edit this result", "Clear paint").

    The editor loads such an image into its canvas asynchronously, with no event saying when,
    and until then still sends what it held before. When it sends exactly that (same pixels and
    paint), the loaded image is what the user sees, and without paint (the paint was the old
    image's). Anything else (the loaded image, now painted; a newer upload) is used as sent.
    The browser sends ``loaded`` back, so only images ``allowed`` (the UI's own) are read.
    """
    record = json.loads(loaded) if loaded else {}
    path = record.get("image") if isinstance(record, dict) else None
    if path and not allowed(path):
        log.warning("ignored an editor image the UI did not serve: %s", path)  # a crafted request
        path = None
    empty = editor_parts(editor)[0] is None
    image = None if empty else image_from_editor(editor, limit)
    painted = None if empty else mask_from_editor(editor, size=image.size, max_bytes=limit)
    if path and content_digest(image, painted) == record.get("replaced"):
        log.info("the editor had not shown %s yet: using it, without the paint of the image it replaced", path)
        return to_rgb_image(path, "image"), None
    if empty:
        raise UIError(NO_IMAGE)
    return image, painted


def _lora_name(value: Any) -> str | None:
    return None if value is None or not str(value).strip() or value == NO_LORA else str(value).strip()


def check_job(inputs: GenerateInputs, config: UIConfig, lightning_lora: str | None = None,
              known_images: frozenset[str] | set[str] = frozenset()) -> Job:
    """Everything Generate needs, checked; UIError (with the fix) on the first problem. Loads no model.

    ``lightning_lora`` is the Lightning LoRA the Lightning sampler stacks with the chosen LoRAs
    (default ``--lightning_lora``); ``known_images`` are the images besides its temp files that the UI puts into
    the editor (the examples').
    """
    prompt = visible_text(inputs.prompt)
    if is_empty_prompt(prompt):
        raise UIError("type a prompt describing the edit")
    if inputs.mode not in MODES:
        raise UIError(f"unknown mode {inputs.mode!r}; valid: {', '.join(MODES)}")
    steps = _int(inputs.steps, "steps", 1, 1000)
    lbm_steps = _int(inputs.lbm_steps, "LBM steps", 1, LBM_MAX_STEPS) if inputs.mode == MODE_LBM else 1
    cfg = _float(inputs.cfg, "CFG", 0.0, 100.0)
    seed = _int(inputs.seed, "seed", -1, 2**32 - 1) if inputs.seed is not None else 0
    if seed < 0:
        seed = secrets.randbelow(2**31)
    variations = _int(inputs.variations, "variations", 1, MAX_VARIATIONS)
    scales = [_float(v, name, -10.0, 10.0) for v, name in ((inputs.lora_scale, "LoRA scale"),
                                                           (inputs.lora2_scale, "second LoRA scale"))]
    mask_grow = _int(inputs.mask_grow, "mask grow", 0, MAX_GROW)
    settings = EditSettings(
        prompt=prompt, model=config.model, negative_prompt=inputs.negative_prompt or "", mode=inputs.mode,
        steps=steps, lbm_steps=lbm_steps, cfg=cfg, seed=seed, lora=_lora_name(inputs.lora), lora_scale=scales[0],
        lora2=_lora_name(inputs.lora2), lora2_scale=scales[1],
        strength=_float(inputs.strength, "edit strength", 0.0, 1.0),
        mask_blend=_float(inputs.mask_blend, "mask blend", 0.0, 1.0), mask_grow=mask_grow,
        mask_invert=bool(inputs.mask_invert),
        mask_feather=_float(inputs.mask_feather, "mask feather", 0.0, 64.0))

    limit = config.max_upload_bytes
    temp = config.resolved_temp_dir.resolve()
    image, painted = editor_image(inputs.editor, inputs.loaded_image, limit,
                                  lambda p: p in known_images or Path(p).resolve().is_relative_to(temp))
    if inputs.mask_file is not None:
        check_upload(inputs.mask_file, limit, "mask file")
    mask = grow_mask(combine(painted, to_pil(inputs.mask_file, "mask file"), image.size, settings.mask_invert),
                     mask_grow)
    refs = reference_images(inputs.references, limit)
    loras = [(resolve_lora(config.lora_dir, name), scale) for name, scale in settings.loras()]
    job = Job(settings=settings, image=image, mask=mask, references=refs, loras=loras, scheduler="default",
              seeds=[seed + i for i in range(variations)])
    if inputs.mode == MODE_LIGHTNING:
        job.loras, steps, cfg = lightning_loras(loras, lightning_lora or config.lightning_lora, steps)
        job.settings, job.scheduler = dataclasses.replace(settings, steps=steps, cfg=cfg), "lightning"
        job.lightning_lora = next((p for p, _ in job.loras[len(loras):]), None)
    return job
