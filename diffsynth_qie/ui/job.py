"""Generate's inputs, checked: the widgets' values become a :class:`Job`, or a :class:`UIError` saying what to fix.

The check reads no model, so the UI runs it before queueing (a refused Generate
never reaches the queue and never hides the last result) and again when the job runs.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from PIL import Image

from .config import UIConfig
from .lora_picker import LoraFolder
from .masks import combine, content_digest, grow_mask
from .results import EditSettings
from .schedules import declared, job_sigmas
from .settings import MODE_FLOW, MODE_LIGHTNING, RECORDED, SETTINGS, checked_values
from .uploads import (NO_IMAGE, UIError, check_upload, editor_parts, image_from_editor, mask_from_editor, reference_images,
                      to_pil, to_rgb_image)

log = logging.getLogger(__name__)

# The values of the UI's widgets when Generate is pressed: one field per row of SETTINGS (ui/settings.py), with its
# default; keyword arguments only.
GenerateInputs = dataclasses.make_dataclass(
    "GenerateInputs", [(s.name, Any, dataclasses.field(default=s.default)) for s in SETTINGS], kw_only=True,
    namespace={"__module__": __name__})


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
    mask_source: Image.Image | None = None  # the paint and mask file united, before invert and grow (a restore's file)
    sigmas: tuple[float, ...] | None = None  # flow matching on the grid a picked LoRA declares (ui/schedules.py)
    preview_every: int = 0               # a live preview every N steps (0 = none): ``EditRequest.preview_every``


def lightning_loras(loras: list, lightning_lora: str | None, steps: int,
                    headers: dict[str, dict[str, str]] | None = None) -> tuple[list, int, float]:
    """The LoRAs, steps and CFG of the Lightning sampler: the chosen LoRA stacked with the
    configured Lightning LoRA; 4 or 8 steps (else the Lightning LoRA's own count); CFG 1 (``headers``: the files'
    metadata by path where the caller has read it already)."""
    from ..models.samplers.lightning import LIGHTNING_STEPS, is_lightning_lora, lightning_steps

    if lightning_lora and not any(Path(p) == Path(lightning_lora) for p, _ in loras):
        if not Path(lightning_lora).is_file():
            raise UIError(f"Lightning LoRA {lightning_lora} not found; fix --lightning_lora")
        loras = [*loras, (Path(lightning_lora), 1.0)]
    paths, headers = [str(p) for p, _ in loras], headers or {}
    if not any(is_lightning_lora(p, headers.get(p)) for p in paths):
        raise UIError("the Lightning sampler needs a Lightning LoRA: start the UI with --lightning_lora FILE, "
                      "or pick a LoRA whose name contains 'Lightning'")
    return loras, steps if steps in LIGHTNING_STEPS else lightning_steps(paths, headers), 1.0


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


def allowed_files(config: UIConfig, known_images: frozenset[str] | set[str],
                  own: frozenset[str] | None) -> Callable[[str], bool]:
    """Which editor images a request may read back: the examples' (``known_images``) and ``own`` (the files given
    to this browser session; None: anything under the UI's temp and outputs folders)."""
    roots = (config.resolved_temp_dir.resolve(), config.resolved_outputs_dir.resolve())

    def allowed(p: str) -> bool:
        return p in known_images or (p in own if own is not None else
                                     any(Path(p).resolve().is_relative_to(root) for root in roots))
    return allowed


def check_job(inputs: GenerateInputs, config: UIConfig, lightning_lora: str | None = None,
              known_images: frozenset[str] | set[str] = frozenset(), own: frozenset[str] | None = None,
              folder: LoraFolder | None = None) -> Job:
    """Everything Generate needs, checked; UIError (with the fix) on the first problem. Loads no model.

    ``lightning_lora`` is the Lightning LoRA the Lightning sampler stacks with the chosen LoRAs
    (default ``--lightning_lora``); ``known_images`` are the images besides its temp files that the UI puts into
    the editor (the examples'); ``folder``: the LoRA folder as the click sees it (default: a fresh look).
    """
    values = checked_values(inputs)
    settings = EditSettings(model=config.model, **{name: values[name] for name in RECORDED})

    limit = config.max_upload_bytes
    image, painted = editor_image(inputs.editor, inputs.loaded_image, limit, allowed_files(config, known_images, own))
    if inputs.mask_file is not None:
        check_upload(inputs.mask_file, limit, "mask file")
    mask_file = to_pil(inputs.mask_file, "mask file")
    mask = grow_mask(combine(painted, mask_file, image.size, settings.mask_invert), settings.mask_grow)
    refs = reference_images(inputs.references, limit)
    folder = folder or LoraFolder(config.lora_dir)
    loras = [(folder.resolve(name), scale) for name, scale in settings.loras()]
    job = Job(settings=settings, image=image, mask=mask, references=refs, loras=loras, scheduler="default",
              seeds=[settings.seed + i for i in range(values["variations"])], preview_every=values["live_preview"],
              mask_source=combine(painted, mask_file, image.size) if mask is not None else None)
    if settings.mode == MODE_LIGHTNING:
        headers = {str(p): folder.metadata(name) for (name, _), (p, _) in zip(settings.loras(), loras)}
        job.loras, steps, cfg = lightning_loras(loras, lightning_lora or config.lightning_lora, settings.steps, headers)
        job.settings, job.scheduler = dataclasses.replace(settings, steps=steps, cfg=cfg), "lightning"
        job.lightning_lora = next((p for p, _ in job.loras[len(loras):]), None)
    elif settings.mode == MODE_FLOW:  # a declared schedule unless Steps say otherwise (as qie edit --scheduler auto)
        names = [name for name, _ in settings.loras()]
        job.sigmas = job_sigmas(declared(folder, names, config.model), settings.steps)
    return job
