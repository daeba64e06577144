"""Mask tools: paint united with a mask file, invert, grow, clear, and a brush sized to the image.

The edit mask follows ``qie edit --mask``: white (painted) = the region that may change.
Invert and grow are applied when Generate runs (the editor keeps showing what was
painted); clearing the paint swaps the editor's image for a copy of itself.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFilter

from ..data.images import aspect_differs

log = logging.getLogger(__name__)
from .uploads import UIError, editor_parts, image_from_editor, mask_from_editor

BRUSH_FRACTION = 0.06             # default brush diameter: 6 % of the image's longer side
BRUSH_COLOR = "rgba(255, 0, 255, 0.6)"  # magenta at 60 %: the image stays visible under the paint
DEFAULT_BRUSH, MAX_BRUSH = 25, 100  # the editor's own default and largest brush


def brush_size(size: tuple[int, int]) -> int:
    """The default brush diameter for an image of ``size`` (W, H): about 6 % of its longer side, at least 2 px."""
    return min(MAX_BRUSH, max(2, round(BRUSH_FRACTION * max(size))))


def editor_digest(value: Any) -> str | None:
    """A digest of what the image editor holds (image pixels and paint), or None when it holds no image."""
    if editor_parts(value)[0] is None:
        return None
    image = image_from_editor(value)
    return content_digest(image, mask_from_editor(value, size=image.size))


def content_digest(image: Image.Image | None, painted: Image.Image | None) -> str | None:
    """:func:`editor_digest` of a decoded editor value (its image and painted mask)."""
    if image is None:
        return None
    h = hashlib.sha1(repr(image.size).encode())
    h.update(np.ascontiguousarray(np.asarray(image)).tobytes())
    if painted is not None:
        h.update(np.asarray(painted).tobytes())
    return h.hexdigest()


def loaded_record(image: str, replaced: Any) -> str:
    """What the UI just put into the editor: ``image``, and the digest of the editor value it replaced (None when
    that value cannot be read, e.g. an upload cut short: it can then never be mistaken for the loaded image)."""
    try:
        digest = editor_digest(replaced)
    except Exception as exc:  # noqa: BLE001 - the new image must load (and Generate unlock) whatever was there
        log.info("the editor's previous image could not be read (%s); loading the new one", exc)
        digest = None
    return json.dumps({"image": str(image), "replaced": digest})


def grow_mask(mask: Image.Image | None, pixels: int) -> Image.Image | None:
    """``mask`` dilated by ``pixels`` (a square of side 2·pixels+1); None stays None."""
    if mask is None or pixels <= 0:
        return mask
    return mask.filter(ImageFilter.MaxFilter(2 * int(pixels) + 1))


def combine(painted: Image.Image | None, mask_file: Image.Image | None, size: tuple[int, int],
            invert: bool = False) -> Image.Image | None:
    """The edit mask ("L", white = may change) at ``size`` (W, H): the painted region united with a mask file
    (white = may change; scaled to the image), inverted on request. None = no mask (the whole image may change).

    Inverting "nothing painted" gives nothing to edit, which is refused rather than run as a no-op.
    """
    if mask_file is not None and aspect_differs(mask_file.size, size):
        raise UIError(f"the mask file is {mask_file.width}x{mask_file.height} but the image is {size[0]}x{size[1]}: it "
                      "belongs to another image; remove it (the × on the mask file) or give this image's mask")
    on = np.zeros((size[1], size[0]), bool)
    for mask in (painted, mask_file):
        if mask is not None:
            on |= np.asarray(mask.convert("L").resize(size, Image.Resampling.NEAREST)) >= 128
    if invert:
        if not on.any():
            raise UIError("Nothing to invert: “Invert mask” needs a painted region (or a mask file), as inverting "
                          "nothing leaves nothing to edit. Paint the part to keep, or untick “Invert mask”.")
        on = ~on
    return Image.fromarray(on.astype(np.uint8) * 255, "L") if on.any() else None


def clear(value: Any, folder: Path) -> dict:
    """The editor's image without any paint.

    The image is served under a new file name: the editor resets its paint layers when its
    background changes, and only then (an empty layer list alone leaves the paint on screen).
    """
    background, _ = editor_parts(value)
    image = image_from_editor(value)  # UIError when there is no image
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"image-{uuid.uuid4().hex[:12]}.png"
    source = background if isinstance(background, (str, Path)) else None
    if source is not None and Path(source).is_file():
        shutil.copyfile(source, path)
    else:
        image.save(path)
    return {"background": str(path), "layers": [], "composite": str(path)}
