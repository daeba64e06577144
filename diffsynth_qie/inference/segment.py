"""Click-to-mask: the object under a point, from a Segment Anything (SAM) checkpoint on this machine.

Uses transformers' ``SamModel`` / ``SamProcessor`` (no extra package), loaded from a local folder with
``local_files_only=True``: nothing is ever downloaded. The folder is a SAM checkpoint in the Hugging Face layout
(``config.json``, ``model.safetensors``, ``preprocessor_config.json`` or ``processor_config.json``), e.g. a download
of ``facebook/sam-vit-base``; ``auto`` finds one of the ``facebook/sam-vit-*`` checkpoints in the Hugging Face
cache, looking only at files already there.

Where no checkpoint is present there is no click-to-mask, and the UI hides its button. The project's other
automatic mask, the edit region of a (source, target) pair (``data/automask.py``, ``qie cache --auto_mask diff``),
fits where both images exist, i.e. a training pair without a hand-drawn mask; it cannot stand in here, since a mask
drawn before Generate has only the source.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

FLAG = "--sam_model"
AUTO = "auto"
CACHED_REPOS = ("facebook/sam-vit-base", "facebook/sam-vit-large", "facebook/sam-vit-huge")
_FIX = (f"give the folder of a SAM checkpoint in the Hugging Face layout (config.json, model.safetensors, "
        f"preprocessor_config.json; e.g. a download of facebook/sam-vit-base), or {FLAG} '' for no object "
        f"selection")


def _weights_present(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json",
                                                      "pytorch_model.bin"))


def check_sam_dir(path: str | Path) -> Path:
    """``path`` as a SAM checkpoint folder, checked without loading it; a ``ValueError`` naming the flag and
    the fix otherwise."""
    folder = Path(path).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{FLAG} {path}: no config.json there; {_FIX}")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise ValueError(f"{FLAG} {path}: its config.json is not readable JSON; {_FIX}") from None
    if model_type != "sam":
        raise ValueError(f"{FLAG} {path}: a {model_type!r} model, not SAM; {_FIX}")
    if not _weights_present(folder):
        raise ValueError(f"{FLAG} {path}: config.json but no weights (model.safetensors); {_FIX}")
    return folder


def cached_sam_dir() -> Path | None:
    """The snapshot folder of a ``facebook/sam-vit-*`` checkpoint already in the Hugging Face cache, or None.

    Reads the cache only (no request): ``try_to_load_from_cache`` looks up a file's path on disk."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for repo in CACHED_REPOS:
        found = try_to_load_from_cache(repo, "config.json")
        if isinstance(found, str):
            folder = Path(found).parent
            try:
                return check_sam_dir(folder)
            except ValueError:  # a partial download: config only
                continue
    return None


def resolve_sam_dir(value: str | None) -> Path | None:
    """The checkpoint folder ``--sam_model`` names: None for off ('' or none), the cache's for ``auto`` (None when
    the cache has none), else the folder given, checked (:func:`check_sam_dir`)."""
    if value is None or not str(value).strip() or str(value).strip().lower() == "none":
        return None
    if str(value).strip() == AUTO:
        return cached_sam_dir()
    return check_sam_dir(value)


class Segmenter:
    """A SAM checkpoint, loaded on first use (thread-safe), that turns a click into the mask of the object there."""

    def __init__(self, folder: str | Path, device: str | None = None):
        self.folder = Path(folder)
        self.device = device  # None: cuda when there is one, else cpu
        self._model = self._processor = None
        self._embedded: tuple[bytes, object] | None = None  # (image digest, its embedding): clicks on one image
        self._lock = threading.Lock()

    def load(self):
        """(model, processor), loaded once from :attr:`folder`, offline."""
        with self._lock:
            if self._model is None:
                import torch
                from transformers import SamModel, SamProcessor

                self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
                try:
                    processor = SamProcessor.from_pretrained(self.folder, local_files_only=True)
                    model = SamModel.from_pretrained(self.folder, local_files_only=True)
                except Exception as exc:  # noqa: BLE001 - a damaged file raises its library's own error
                    raise ValueError(f"{FLAG} {self.folder}: the SAM checkpoint does not load ({exc}); "
                                     f"{_FIX}") from None
                log.info("object selection: SAM loaded from %s", self.folder)
                self._model, self._processor = model.to(self.device).eval(), processor
        return self._model, self._processor

    def select(self, image: Image.Image, point: tuple[float, float]) -> Image.Image:
        """The object under ``point`` ((x, y) in ``image``'s pixels) as a binary "L" mask at ``image``'s size
        (255 = the object): SAM's best-scored of its three candidate masks for that one positive click."""
        import torch

        x, y = point
        if not (0 <= x < image.width and 0 <= y < image.height):
            raise ValueError(f"the point ({x:g}, {y:g}) is outside the {image.width}×{image.height} image; click "
                             f"on the image")
        model, processor = self.load()
        rgb = image.convert("RGB")
        inputs = processor(images=rgb, input_points=[[[float(x), float(y)]]], return_tensors="pt")
        with torch.no_grad():
            embedding = self._embedding(model, rgb, inputs["pixel_values"])
            out = model(image_embeddings=embedding, multimask_output=True,
                        input_points=inputs["input_points"].to(self.device, torch.float32))
        masks = processor.image_processor.post_process_masks(out.pred_masks.cpu(), inputs["original_sizes"],
                                                              inputs["reshaped_input_sizes"])[0][0]  # (3, H, W)
        best = int(out.iou_scores[0, 0].argmax())
        return Image.fromarray(masks[best].numpy().astype(np.uint8) * 255, "L")

    def _embedding(self, model, rgb: Image.Image, pixel_values):
        """The image encoder's output for ``rgb``, kept for the next click on the same image (the encoder is
        SAM's slow part; the prompt decoder is cheap)."""
        digest = hashlib.blake2b(rgb.tobytes(), digest_size=16).digest() + repr(rgb.size).encode()
        with self._lock:
            if self._embedded is not None and self._embedded[0] == digest:
                return self._embedded[1]
        embedding = model.get_image_embeddings(pixel_values.to(self.device))
        with self._lock:
            self._embedded = (digest, embedding)
        return embedding
