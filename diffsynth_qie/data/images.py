"""Image loading, mask loading and pixel-budget resizing for dataset rows.

Why a module of its own: every consumer (cache writer, `qie edit`, the UI,
validation) must see *the same pixels* for the same file, or cached latents and
inference inputs drift apart. So decoding rules live in one place:

- EXIF orientation is applied (phones store portrait photos as rotated
  landscape pixels plus a tag).
- Transparency is composited on **white** (the same white the LBM `sub_noise`
  latents encode), grayscale/CMYK/palette become RGB, 16-bit images are scaled
  to 8 bit instead of being clipped to white.
- Truncated files are an error: ``Image.LOAD_TRUNCATED_IMAGES`` is never set,
  and every image is fully decoded with ``.load()`` so a half-downloaded JPEG is
  reported instead of silently training on grey stripes.
- Size limits are checked from the header, *before* decoding: a 17 KB PNG can
  declare 12000x12000 pixels and cost gigabytes once decoded. Images above
  :data:`MAX_IMAGE_PIXELS` are refused; images with a side below the resize
  divisor are refused where they are fitted (:func:`fit_image`) instead of being
  silently enlarged.

The cache, ``qie edit`` and the web UI all load images through :func:`open_image`
/ :func:`load_rgb` / :func:`load_mask` and convert with :func:`to_rgb`.

Masks: white (>= 128 after conversion to 8-bit gray) marks the *edit region*;
everything else is kept. Masks are binarised to exactly {0, 255}.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageOps

from ..utils.sizes import fit_image, fit_to_budget  # noqa: F401 (part of this module's API)

#: Gray level at and above which a mask pixel counts as "edit region".
MASK_THRESHOLD = 128

_SIXTEEN_BIT_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I"}
#: Modes :func:`to_rgb` scales to 8 bit (PIL's own ``convert`` would clip them).
HIGH_BIT_DEPTH_MODES = frozenset(_SIXTEEN_BIT_MODES | {"F"})

#: Largest image (width x height) any loader decodes: 8192 x 8192 = 64 MP, about
#: 200 MB as 8-bit RGB and more during conversion. Photos from 50 MP cameras fit;
#: larger files must be downscaled before use (training resizes to ~1 MP anyway).
MAX_IMAGE_PIXELS = 8192 * 8192


class ImageTooLarge(ValueError):
    """An image with more pixels than allowed (refused before decoding)."""


def check_pixels(width: int, height: int, name: str, max_pixels: int | None = None) -> None:
    """Refuse an image of ``width`` x ``height`` above ``max_pixels`` (default :data:`MAX_IMAGE_PIXELS`).

    ``name`` says which image, e.g. ``"image a.png"`` or ``"the uploaded image"``.
    """
    limit = MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    if width * height > limit:
        raise ImageTooLarge(f"{name} is {width}x{height} = {width * height / 1e6:.1f} MP, more than the "
                            f"limit of {limit / 1e6:.1f} MP; downscale it before use")


_ORIENTATION = 0x0112                  # the EXIF orientation tag
_TRANSPOSES = {2, 3, 4, 5, 6, 7, 8}    # its values that flip or rotate the stored pixels
_SWAPS_SIDES = {5, 6, 7, 8}            # those that rotate by 90 degrees


def open_image(path: str | os.PathLike, max_pixels: int | None = None) -> Image.Image:
    """Open and fully decode ``path`` with EXIF orientation applied, in its own mode.

    The pixel count is checked from the header before anything is decoded.
    Raises FileNotFoundError for a missing file and ValueError (naming the path)
    for an image too large or anything PIL cannot decode completely. Decoding
    errors come from many layers (OSError for truncation, SyntaxError for broken
    headers, zlib/struct errors for corrupt PNG chunks), so this boundary catches
    them all and turns them into one user-facing error type.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {path}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit applies
            with Image.open(path) as im:
                check_pixels(*im.size, f"image {path}", max_pixels)  # header only: nothing decoded yet
                im.load()  # full decode (once): raises on truncated data
                if im.getexif().get(_ORIENTATION, 1) in _TRANSPOSES:  # (else the decoded image is already upright)
                    im = ImageOps.exif_transpose(im)
    except Image.DecompressionBombError as e:  # beyond PIL's own hard limit, refused in Image.open
        raise ImageTooLarge(f"image {path} has too many pixels ({e}); downscale it before use") from e
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - corrupt input may fail anywhere in PIL
        raise ValueError(f"cannot read image {path}: {type(e).__name__}: {e}. "
                         "Re-export or re-download the file, or remove the row.") from e
    return im


def image_size(path: str | os.PathLike) -> tuple[int, int]:
    """``(width, height)`` of an image as :func:`open_image` returns it (EXIF orientation applied), read from
    the header alone: nothing is decoded."""
    with Image.open(path) as im:
        width, height = im.size
        orientation = im.getexif().get(_ORIENTATION, 1)
    return (height, width) if orientation in _SWAPS_SIDES else (width, height)


def _to_8bit_gray(im: Image.Image) -> Image.Image:
    """Single-channel high-bit-depth or float image -> mode "L".

    PIL decodes 16-bit PNG/TIFF to "I;16*" or "I" (int32 holding 0..65535), so
    both are treated as 16-bit and divided by 257 (65535 -> 255). An "I" image with
    values above 65535 is a 32-bit image: it is scaled by its own range (min..max -> 0..255)
    instead of saturating white. Float ("F") images are taken as [0, 1] when their max is
    <= 1, else as [0, 255].
    """
    arr = np.asarray(im)
    if im.mode in _SIXTEEN_BIT_MODES and arr.size and (arr.max() > 65535 or arr.min() < 0):
        a = arr.astype(np.float64)
        lo, hi = float(a.min()), float(a.max())
        out = np.rint((a - lo) * (255.0 / (hi - lo))) if hi > lo else np.zeros_like(a)
    elif im.mode in _SIXTEEN_BIT_MODES:
        out = np.rint(arr.astype(np.float64) / 257.0)
    else:  # "F"
        a = arr.astype(np.float64)
        out = np.rint(a * 255.0) if a.size and np.nanmax(a) <= 1.0 else np.rint(a)
    return Image.fromarray(np.clip(np.nan_to_num(out), 0, 255).astype(np.uint8), mode="L")


def _has_alpha(im: Image.Image) -> bool:
    return im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info)


def to_rgb(im: Image.Image) -> Image.Image:
    """Convert any decoded PIL image to 8-bit "RGB" (alpha composited on white)."""
    if im.mode == "RGB":
        return im
    if im.mode in _SIXTEEN_BIT_MODES or im.mode == "F":
        return _to_8bit_gray(im).convert("RGB")
    if _has_alpha(im):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    try:
        return im.convert("RGB")  # L, 1, P, CMYK, YCbCr, ...
    except ValueError as e:
        raise ValueError(f"unsupported image mode {im.mode!r}: {e}") from e


def load_rgb(path: str | os.PathLike) -> Image.Image:
    """Load ``path`` as an 8-bit RGB image (EXIF-rotated, alpha on white)."""
    im = open_image(path)
    try:
        return to_rgb(im)
    except ValueError as e:
        raise ValueError(f"cannot convert image {path} to RGB: {e}") from e


def binarize_mask(mask: Image.Image) -> Image.Image:
    """Threshold an "L" image at MASK_THRESHOLD to exactly {0, 255}."""
    assert mask.mode == "L", mask.mode
    return mask.point(_BINARY)


_BINARY = [255 if v >= MASK_THRESHOLD else 0 for v in range(256)]  # binarize_mask's lookup table


def to_mask(im: Image.Image) -> Image.Image:
    """Convert a decoded image to a binary "L" mask (255 = edit region).

    An image with a *non-opaque* alpha channel (a painted layer exported from an
    editor: transparent = untouched) uses its alpha as the mask. Otherwise the
    mask is the gray level (luminance) of the image, so black/white masks in any
    mode — RGB, palette, 1-bit, 16-bit — mean the same thing.
    """
    if _has_alpha(im):
        alpha = im.convert("RGBA").getchannel("A")
        if alpha.getextrema() != (255, 255):
            return binarize_mask(alpha)
        im = im.convert("RGBA").convert("RGB")
    if im.mode in _SIXTEEN_BIT_MODES or im.mode == "F":
        gray = _to_8bit_gray(im)
    else:
        gray = im if im.mode == "L" else im.convert("L")
    return binarize_mask(gray)


def load_mask(path: str | os.PathLike) -> Image.Image:
    """Load ``path`` as a binary mode-"L" mask: 255 = edit region, 0 = keep."""
    im = open_image(path)
    try:
        return to_mask(im)
    except ValueError as e:
        raise ValueError(f"cannot convert mask {path} to grayscale: {e}") from e


MIN_SIDE = 16     # the resize divisor: a shorter side could only be met by enlarging
MAX_ASPECT = 200  # Qwen2-VL's image processor (the text encoder's view of a reference) refuses longer strips


def aspect_differs(size: tuple[int, int], reference: tuple[int, int], tolerance: float = 0.01) -> bool:
    """Whether ``size``'s aspect ratio (W, H) is off ``reference``'s by more than ``tolerance`` of it: a mask
    made for another image, rather than the same image at another resolution."""
    ratio = reference[0] / reference[1]
    return abs(size[0] / size[1] - ratio) > tolerance * ratio


def check_geometry(size: tuple[int, int], source: str = "image") -> None:
    """Refuse (``ValueError`` naming ``source``) an image no model input can be made from: a side below
    :data:`MIN_SIDE` pixels, or an aspect ratio beyond :data:`MAX_ASPECT`:1 (it would reach DiffSynth's
    resizing as a 0-pixel side, with an error naming no file)."""
    width, height = size
    if width < MIN_SIDE or height < MIN_SIDE:
        raise ValueError(f"{source} is {width}x{height} pixels; images need at least {MIN_SIDE} pixels per side "
                         "(they are never enlarged). Use a larger image.")
    aspect = max(width, height) / min(width, height)
    if aspect > MAX_ASPECT:
        raise ValueError(f"{source} is {width}x{height} pixels, an aspect ratio of {aspect:.0f}:1, beyond "
                         f"{MAX_ASPECT}:1 (the text encoder's image processor refuses it); crop it")


def resize_mask(mask: Image.Image, size: tuple[int, int], *, threshold: bool = True) -> Image.Image:
    """Resize an "L" mask to ``size`` = (w, h).

    Bilinear (which PIL antialiases when shrinking, i.e. area-like) followed by
    the same MASK_THRESHOLD as :func:`load_mask`, so a mask stays binary and a
    region keeps its place at any scale; NEAREST would drop thin strokes when
    shrinking. ``threshold=False`` keeps the soft coverage (0..255), e.g. for a
    latent-resolution loss weight.
    """
    if mask.mode != "L":
        raise ValueError(f"resize_mask expects a mode 'L' mask, got mode {mask.mode!r}")
    out = mask if mask.size == tuple(size) else mask.resize(tuple(size), Image.BILINEAR)
    return binarize_mask(out) if threshold else out


def resize_to(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    """Resize to ``size`` = (w, h): LANCZOS for RGB images, :func:`resize_mask` for "L" masks.

    Plain resize, no crop: target, mask and ``ref_gt`` of a row stay aligned
    pixel for pixel. The aspect distortion from :func:`fit_to_budget` rounding
    is below ``divisor / side``.
    """
    size = (int(size[0]), int(size[1]))
    if img.mode == "L":
        return resize_mask(img, size)
    if img.mode != "RGB":
        raise ValueError(f"resize_to expects an RGB image or an L mask, got mode {img.mode!r}; "
                         "load it with load_rgb() or load_mask() first")
    return img if img.size == size else img.resize(size, Image.LANCZOS)


def side_by_side(panels: Sequence[Image.Image], height: int | None = None) -> Image.Image:
    """Panels left to right, each scaled to ``height`` (default: the last panel's, the model
    output) keeping its aspect ratio; panels already that high are pasted unchanged."""
    if not panels:
        raise ValueError("side_by_side needs at least one image")
    height = int(height or panels[-1].height)
    scaled = [p if p.height == height else
              p.resize((max(1, round(p.width * height / p.height)), height), Image.Resampling.BICUBIC)
              for p in panels]
    strip = Image.new("RGB", (sum(p.width for p in scaled), height), (255, 255, 255))
    x = 0
    for p in scaled:
        strip.paste(p.convert("RGB"), (x, 0))
        x += p.width
    return strip


def image_bytes_hash(path: str | os.PathLike) -> str:
    """sha256 hex digest of the file's bytes (cache invalidation key)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
