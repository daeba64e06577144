"""The callbacks of the mask preview and the box tool (``ui/mask_preview.py`` does the work), and the editor's brush."""
from __future__ import annotations

from typing import Any

import gradio as gr

from . import mask_preview, masks
from .handlers import UIHandlers, user_message
from .job import allowed_files, editor_image
from .messages import toast_html
from .model_fit import size_divisor
from .settings import output_side
from .uploads import UIError

EMPTY = "Load an image (or an example) to see the mask Generate will use."


class MaskTools:
    def __init__(self, handlers: UIHandlers):
        self.h = handlers

    @property
    def folder(self):
        return self.h.config.resolved_temp_dir / "masks"

    def _image(self, editor: Any, loaded: Any, request: gr.Request | None):
        c = self.h.config
        allowed = allowed_files(c, self.h.known_images, self.h.given(getattr(request, "session_hash", None)))
        return editor_image(editor, loaded, c.max_upload_bytes, allowed)

    def preview(self, editor: Any, loaded: Any, mask_file: Any, invert: Any, grow: Any, feather: Any,
                request: gr.Request = None):
        """The mask preview image and its line; a problem (a mask file of another image) is the line, never a
        toast: the preview follows every stroke."""
        try:
            image, painted = self._image(editor, loaded, request)
        except UIError:
            return None, EMPTY
        except Exception as exc:  # noqa: BLE001 - an unreadable upload: the editor's own check says more
            return None, f"No preview: {user_message(exc)}"
        try:
            return mask_preview.preview(image, painted, mask_file, invert, grow, feather)
        except Exception as exc:  # noqa: BLE001
            return None, f"No preview: {user_message(exc)}"

    def input_size(self, editor: Any, loaded: Any, request: gr.Request = None):
        """"Keep the input's size": width and height of the editor's image, rounded to what the model takes (said
        in the status when rounded)."""
        try:
            image, _ = self._image(editor, loaded, request)
        except Exception as exc:  # noqa: BLE001
            raise gr.Error(toast_html(user_message(exc)), duration=6, print_exception=False) from None
        step = size_divisor(self.h.config.model)
        w, h = (output_side(v, step=step) for v in image.size)
        rounded = "" if (w, h) == image.size else f", rounded from {image.width}×{image.height} (sides are multiples " \
                                                  f"of {step} for this model)"
        return w, h, f"Output size {w}×{h}{rounded}."

    def box(self, drag: str, editor: Any, loaded: Any, mask_file: Any, request: gr.Request = None):
        """A box dragged on the preview (the page writes its corners into a hidden box): added to the mask file."""
        if not drag:
            return gr.skip(), gr.skip()
        try:
            image, _ = self._image(editor, loaded, request)
            return mask_preview.box_from_drag(drag, mask_file, image.size, self.folder)
        except Exception as exc:  # noqa: BLE001
            raise gr.Error(toast_html(user_message(exc)), duration=6, print_exception=False) from None


def brush(size: int) -> gr.Brush:
    """The editor's one brush (magenta at 60 %: the image stays visible under the paint), ``size`` px across."""
    return gr.Brush(colors=[masks.BRUSH_COLOR], color_mode="fixed", default_size=int(size))


def image_brush(path: str) -> int:
    """The brush size for the image file ``path`` (read from its header), whatever loaded it."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return masks.brush_size(im.size)
    except (OSError, ValueError):
        return masks.DEFAULT_BRUSH
