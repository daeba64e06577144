"""Uploaded images and painted masks, as the UI's handlers receive them from gradio.

- Every upload is checked before anything decodes it (:func:`check_upload`): bytes
  against ``--max_upload_mb``, the header's pixel count against the loader's limit,
  and whether it is an image at all.
- Files are decoded by the project's one image loader (``data.images``), so the UI
  sees the same pixels as ``qie edit`` and the cache (16-bit scaled, EXIF applied,
  transparency on white).
- The UI's temporary files are kept under a size cap, the oldest removed first
  (:func:`prune_temp_files`).
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image

from ..data.images import HIGH_BIT_DEPTH_MODES, ImageTooLarge, check_pixels, open_image, to_rgb
from ..utils.dir_lock import UITempLock

log = logging.getLogger(__name__)


NO_IMAGE = "upload an image to edit first (drop it on the image editor)"


class UIError(ValueError):
    """A problem the user can fix; its message is shown in the UI as is."""


# --- images and masks ----------------------------------------------------------------
def _file_of(item: Any) -> str | None:
    """The file path behind a gradio value (path string, FileData-like dict), or None."""
    if isinstance(item, (str, os.PathLike)):
        return os.fspath(item)
    if isinstance(item, Mapping) and isinstance(item.get("path"), str):
        return item["path"]
    return None


def check_upload_size(item: Any, max_bytes: int, what: str = "image") -> None:
    """Refuse a file-backed upload larger than ``max_bytes`` (in-memory images pass)."""
    path = _file_of(item)
    if path is None:
        return
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise UIError(f"the uploaded {what} could not be read ({exc.strerror}); upload it again") from None
    if size > max_bytes:
        raise UIError(f"the uploaded {what} is {size / 2**20:.3g} MB; the limit is "
                      f"{max_bytes / 2**20:.3g} MB (--max_upload_mb) — upload a smaller file")


def check_upload(item: Any, max_bytes: int, what: str = "image") -> None:
    """Refuse an uploaded file before anything decodes it: too many bytes, not an image,
    or too many pixels (read from the header; a small PNG can declare 12000x12000)."""
    check_upload_size(item, max_bytes, what)
    path = _file_of(item)
    if path is None:
        return
    name = f"the uploaded {what}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as im:  # lazy: reads the header only
                size = im.size
    except Image.DecompressionBombError:
        raise UIError(f"{name} has too many pixels; downscale it") from None
    except Exception:  # noqa: BLE001 - PIL raises many types for non-images
        raise UIError(f"{name} is not a readable image; upload a PNG/JPEG/WebP file") from None
    try:
        check_pixels(*size, name)
    except ImageTooLarge as exc:
        raise UIError(str(exc)) from None


def to_8bit_upload(path: str | os.PathLike) -> None:
    """Rewrite a 16-bit or float image file as 8-bit RGB, in place, with the project's loader.

    Gradio's ImageEditor converts its files with PIL's ``convert("RGBA")``, which clips
    16-bit values to white; after this it sees the same 8-bit pixels as ``qie edit``.
    """
    with Image.open(path) as im:
        mode = im.mode
    if mode not in HIGH_BIT_DEPTH_MODES:
        return
    from ..utils.atomic import atomic_path

    image = to_rgb(open_image(path))
    with atomic_path(Path(path)) as tmp:
        image.save(tmp, format="PNG")


def prune_temp_files(root: str | os.PathLike, max_bytes: int, keep_seconds: float = 60.0) -> list[Path]:
    """Delete the oldest files under ``root`` until their total size is at most ``max_bytes``.

    Files modified in the last ``keep_seconds`` are kept (uploads of a request in
    flight), so the total may stay above the cap until they age, and so is the folder's
    lock file (``UITempLock``: which running UI uses it). Returns the removed paths.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    files = []
    for path in root.rglob("*"):
        if path == root / UITempLock.name:
            continue
        try:
            st = path.lstat()
        except OSError:
            continue
        if path.is_file() and not path.is_symlink():
            files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    removed = []
    now = time.time()
    for mtime, size, path in sorted(files, key=lambda f: f[0]):
        if total <= max_bytes:
            break
        if now - mtime < keep_seconds:
            break  # the rest is newer still
        try:
            path.unlink()
        except OSError:
            continue
        total -= size
        removed.append(path)
    if removed:
        log.info("removed %d temporary file(s) from %s (over %.3g MB)", len(removed), root, max_bytes / 2**20)
    remove_empty_dirs(root, keep_seconds)
    return removed


def remove_empty_dirs(root: str | os.PathLike, keep_seconds: float = 60.0) -> int:
    """Remove the empty folders under ``root`` (deepest first; ``root`` stays), except those changed in the last
    ``keep_seconds`` (a request in flight may be about to write there). Returns how many were removed."""
    now, emptied, count = time.time(), set(), 0  # folders emptied by this pass count as old
    for path in sorted((p for p in Path(root).rglob("*") if p.is_dir() and not p.is_symlink()),
                       key=lambda p: len(p.parts), reverse=True):
        try:
            if (path in emptied or now - path.stat().st_mtime >= keep_seconds) and not any(path.iterdir()):
                path.rmdir()
                emptied.add(path.parent)
                count += 1
        except OSError:
            continue
    return count


def to_pil(item: Any, what: str = "image") -> Image.Image | None:
    """A decoded PIL image, in its own mode, from any gradio image value (PIL, numpy, path,
    FileData dict, (media, caption)).

    Files go through the project's one image loader (``data.images.open_image``): the
    pixel count is checked from the header before decoding, EXIF rotation applied.
    """
    if item is None:
        return None
    if isinstance(item, (tuple, list)) and len(item) == 2 and not isinstance(item, np.ndarray):
        item = item[0]  # gr.Gallery gives (media, caption)
    name = f"the uploaded {what}"
    if isinstance(item, Image.Image):
        check_pixels(*item.size, name)
        return item
    if isinstance(item, np.ndarray):
        check_pixels(item.shape[1] if item.ndim > 1 else 1, item.shape[0], name)
        arr = item
        if arr.dtype == np.uint16:  # 16-bit pixels: scale, never clip to white
            arr = np.rint(arr.astype(np.float64) / 257.0)
        if arr.dtype != np.uint8:
            arr = np.clip(arr, 0, 255).astype(np.uint8)
        return Image.fromarray(arr)
    path = _file_of(item)
    if path is None:
        raise UIError(f"unsupported {what} value of type {type(item).__name__}; upload a PNG/JPEG/WebP file")
    try:
        return open_image(path)
    except ImageTooLarge as exc:
        raise UIError(str(exc).replace(f"image {path}", name)) from None
    except (ValueError, OSError):
        raise UIError(f"{name} is not a readable image; upload a PNG/JPEG/WebP file") from None


def to_rgb_image(item: Any, what: str = "image") -> Image.Image | None:
    """:func:`to_pil` converted like every other input (``data.images.to_rgb``: 16-bit
    scaled to 8 bit, transparency on white)."""
    image = to_pil(item, what)
    if image is None:
        return None
    try:
        return to_rgb(image)
    except ValueError:
        raise UIError(f"the uploaded {what} has an unsupported colour mode ({image.mode}); "
                      "upload a PNG/JPEG/WebP file") from None


def painted_pixels(layer: Image.Image) -> np.ndarray:
    """Boolean [H, W]: where a brush layer has paint.

    With an alpha channel, painted = alpha > 0 (any opacity counts; the canvas writes
    RGB 0 under alpha 0, so the colour says nothing). Without one (a layer converted
    to RGB/L upstream) painted = any non-black pixel.
    """
    if "A" in layer.getbands():
        return np.asarray(layer.getchannel("A")) > 0
    arr = np.asarray(layer.convert("RGB"))
    return arr.max(axis=-1) > 0


def editor_parts(value: Any) -> tuple[Any, list[Any]]:
    """(background, layers) of an ImageEditor value ``{"background", "layers", "composite"}``.

    A bare image (API clients) is a background with no layers. Without a background
    the composite stands in for it (gradio sends only a composite for pasted images).
    """
    if value is None:
        return None, []
    if isinstance(value, Mapping):
        background = value.get("background")
        if background is None:
            background = value.get("composite")
        return background, [x for x in (value.get("layers") or []) if x is not None]
    return value, []


def image_from_editor(value: Any, max_bytes: int | None = None) -> Image.Image:
    """The image to edit (RGB) from the editor's value; UIError if none was uploaded."""
    background, _ = editor_parts(value)
    if background is None:
        raise UIError(NO_IMAGE)
    if max_bytes is not None:
        check_upload(background, max_bytes, "image")
    return to_rgb_image(background)


def mask_from_editor(value: Any, size: tuple[int, int] | None = None,
                     max_bytes: int | None = None) -> Image.Image | None:
    """The edit mask ("L", white = may change) from the editor's brush layers, or None.

    All layers are united. Layers of another size than ``size`` (the image's, W×H)
    are scaled to it with nearest-neighbour sampling so the mask stays binary.
    Returns None when nothing is painted: then the whole image may change, as in
    ``qie edit`` without ``--mask``.
    """
    _, layers = editor_parts(value)
    union: np.ndarray | None = None
    for i, item in enumerate(layers):
        if max_bytes is not None:
            check_upload(item, max_bytes, f"mask layer {i + 1}")
        layer = to_pil(item, f"mask layer {i + 1}")
        if size is not None and layer.size != tuple(size):
            layer = layer.resize(tuple(size), Image.Resampling.NEAREST)
        painted = painted_pixels(layer)
        if union is None:
            union = painted
        elif union.shape != painted.shape:  # no target size given and layers disagree
            raise UIError("the mask layers have different sizes; clear the mask and paint it again")
        else:
            union = union | painted
    if union is None or not union.any():
        return None
    return Image.fromarray(union.astype(np.uint8) * 255, mode="L")


def reference_images(items: Sequence[Any] | None, max_bytes: int | None = None) -> list[Image.Image]:
    """Extra reference images (gallery value) as RGB images, each size-checked."""
    out = []
    for i, item in enumerate(items or []):
        media = item[0] if isinstance(item, (tuple, list)) and len(item) == 2 else item
        if max_bytes is not None:
            check_upload(media, max_bytes, f"reference image {i + 1}")
        out.append(to_rgb_image(media, f"reference image {i + 1}"))
    return out
