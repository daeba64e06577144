""""Select object": a click on the mask preview adds the object under it to the mask file.

Shown only when a SAM checkpoint is on this machine (``--sam_model``; ``inference/segment.py`` finds and loads
it); otherwise the button is hidden. The page (``ui/page.py``) arms the button and, on the next click on the
preview, writes the clicked pixel (the image's own pixels, as the box tool does) into the hidden ``#select-point``
box; :meth:`ObjectSelect.select` turns it into SAM's mask of the object there and unites it with the mask file,
so the object reaches Generate, the saved record and the ``qie edit`` command as any mask file does.
"""
from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np
from PIL import Image

from ..inference.segment import Segmenter, resolve_sam_dir
from .handlers import user_message
from .mask_events import MaskTools
from .messages import toast_html
from .uploads import UIError, to_pil

log = logging.getLogger(__name__)

LABEL = "Select object (then click it on the mask preview)"


def parse_point(text: Any, size: tuple[int, int]) -> tuple[int, int]:
    """"x,y[,...]" (the page's click, in the image's pixels) as a point inside an image of ``size``."""
    try:
        x, y = (int(round(float(v))) for v in str(text).split(",")[:2])
    except ValueError:
        raise UIError(f"the point {text!r} is not two numbers; click the object on the mask preview") from None
    return min(max(x, 0), size[0] - 1), min(max(y, 0), size[1] - 1)


def unite(mask_file: Any, size: tuple[int, int], selected: Image.Image, folder: Path) -> str:
    """A new mask file: ``mask_file`` (or black) at ``size``, united with ``selected`` (white = may change)."""
    base = to_pil(mask_file, "mask file")
    mask = np.zeros((size[1], size[0]), bool) if base is None else np.asarray(
        base.convert("L").resize(size, Image.Resampling.NEAREST)) > 127
    mask |= np.asarray(selected.convert("L").resize(size, Image.Resampling.NEAREST)) > 127
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"object-mask-{uuid.uuid4().hex[:12]}.png"
    Image.fromarray(mask.astype(np.uint8) * 255, "L").save(path)
    return str(path)


class ObjectSelect:
    """The "Select object" button's callbacks over one UI's :class:`MaskTools`; ``segmenter`` None = hidden."""

    def __init__(self, tools: MaskTools, segmenter: Segmenter | None = None):
        self.tools = tools
        self.segmenter = segmenter

    @classmethod
    def from_config(cls, tools: MaskTools) -> "ObjectSelect":
        """The SAM checkpoint ``--sam_model`` names (``auto``: one in the Hugging Face cache), loaded on first use."""
        c = tools.h.config
        folder = resolve_sam_dir(getattr(c, "sam_model", None))
        if folder is not None:
            log.info("object selection: SAM checkpoint %s (loaded on the first click)", folder)
        return cls(tools, Segmenter(folder, c.device) if folder is not None else None)

    @property
    def available(self) -> bool:
        return self.segmenter is not None

    def button(self) -> gr.Button:
        """The button, visible only with a SAM checkpoint (the page arms it; see the module docstring)."""
        return gr.Button(LABEL, size="sm", visible=self.available, elem_id="select-object")

    def select(self, point: str, editor: Any, loaded: Any, mask_file: Any, request: gr.Request = None):
        """A click on the preview while armed: (the mask file with the object added, a line for the preview)."""
        if not point or not self.available:
            return gr.skip(), gr.skip()
        try:
            image, _ = self.tools._image(editor, loaded, request)
            x, y = parse_point(point, image.size)
            selected = self.segmenter.select(image, (x, y))
            share = 100.0 * float((np.asarray(selected) > 127).mean())
            path = unite(mask_file, image.size, selected, self.tools.folder)
        except Exception as exc:  # noqa: BLE001
            raise gr.Error(toast_html(user_message(exc)), duration=6, print_exception=False) from None
        return path, f"Object at ({x}, {y}) added to the mask file ({share:.1f} % of the image)."
