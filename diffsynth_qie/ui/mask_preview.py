"""The mask Generate will use, shown before Generate, and the box tool that adds rectangles to it.

:func:`preview` builds the mask exactly as Generate does (``ui/job.py``: the paint united with the mask file,
inverted, grown) and the edit weight of the blend (``inference/masking.py``: feathered), and draws it over the
image: the region that may change in its own colours, the kept part dimmed.

:func:`add_box` is the box tool: a box dragged on the preview adds a white rectangle to the mask file, so
that a box reaches Generate, the saved record and the ``qie edit`` command as any mask file does.
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .masks import combine, grow_mask
from .settings import SETTING
from .uploads import UIError, to_pil


def _checked(name: str, value: Any) -> Any:
    return SETTING[name].check(value, None)


def preview(image: Image.Image, painted: Image.Image | None, mask_file: Any, invert: Any, grow: Any,
            feather: Any) -> tuple[Image.Image, str]:
    """(the image with the region that may change in colour and the rest dimmed, a line saying how much).

    The same mask as Generate: :func:`combine` then :func:`grow_mask`, feathered by the blend's own weight."""
    from ..inference.masking import pixel_edit_weight

    invert, grow, feather = bool(invert), _checked("mask_grow", grow), _checked("mask_feather", feather)
    mask = grow_mask(combine(painted, to_pil(mask_file, "mask file"), image.size, invert), grow)
    if mask is None:
        return image, "No mask: Generate may change **the whole image** (paint a region, or give a mask file)."
    weight = pixel_edit_weight(mask, image.size, feather)[..., None]
    rgb = np.asarray(image.convert("RGB"), np.float32)
    shown = rgb * (0.25 + 0.75 * weight) + np.array([40, 0, 40], np.float32) * (1 - weight)
    out = Image.fromarray(np.clip(shown, 0, 255).astype(np.uint8), "RGB")
    tools = [t for t in ("inverted" if invert else "", f"grown {grow} px" if grow else "",
                         f"feathered {feather:g} px" if feather else "") if t]
    share = 100.0 * float(np.asarray(mask).astype(bool).mean())
    return out, f"Generate may change **{share:.1f} %** of the image (bright){': ' + ', '.join(tools) if tools else ''}."


def add_box(mask_file: Any, size: tuple[int, int], start: tuple[int, int], end: tuple[int, int],
            folder: Path) -> str:
    """A new mask file: ``mask_file`` (or black) at the image's ``size`` with the rectangle from ``start`` to
    ``end`` (both corners included, W×H pixel coordinates) painted white."""
    base = to_pil(mask_file, "mask file")
    mask = np.zeros((size[1], size[0]), np.uint8) if base is None else np.array(
        base.convert("L").resize(size, Image.Resampling.NEAREST))
    (x0, x1), (y0, y1) = sorted((start[0], end[0])), sorted((start[1], end[1]))
    mask[max(0, y0):y1 + 1, max(0, x0):x1 + 1] = 255
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"box-mask-{uuid.uuid4().hex[:12]}.png"
    Image.fromarray(mask, "L").save(path)
    return str(path)


def box_from_drag(drag: Any, mask_file: Any, size: tuple[int, int] | None, folder: Path) -> tuple[str, str]:
    """The box tool: ``drag`` is "x0,y0,x1,y1[,...]" in the image's pixels (the page writes it when a box is dragged
    on the mask preview). Returns (the new mask file, a line for the preview)."""
    if size is None:
        raise UIError("load an image first: the box tool draws on the mask preview")
    try:
        x0, y0, x1, y1 = (int(round(float(v))) for v in str(drag).split(",")[:4])
    except ValueError:
        raise UIError(f"the box {drag!r} is not four numbers; drag a box on the mask preview") from None
    clip = lambda v, hi: min(max(v, 0), hi - 1)  # noqa: E731
    (x0, x1), (y0, y1) = (clip(x0, size[0]), clip(x1, size[0])), (clip(y0, size[1]), clip(y1, size[1]))
    path = add_box(mask_file, size, (x0, y0), (x1, y1), folder)
    return path, f"Box ({min(x0, x1)}, {min(y0, y1)})–({max(x0, x1)}, {max(y0, y1)}) added to the mask file."
