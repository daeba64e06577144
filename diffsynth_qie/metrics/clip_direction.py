"""Prompt adherence as CLIP directional similarity: does the image change point where the text change points?

``clip_direction = cos(E_img(output) − E_img(source), E_txt(after) − E_txt(before))`` per row
(Gal et al., StyleGAN-NADA; the InstructPix2Pix evaluation). Edit rows carry an instruction, not
two captions, so by default the text change is ``E_txt(instruction) − E_txt("")``; rows with
captions can pass ``before`` / ``after`` texts instead.

The CLIP model (transformers' ``CLIPModel`` + ``CLIPProcessor``) is read only from a local
directory (``local_files_only``), never downloaded: :func:`load_clip` returns ``None`` with one
logged line when it is not there, and the field is then absent from the scorecard.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

import torch

log = logging.getLogger(__name__)
_said: set[str] = set()


def load_clip(path: str | Path):
    """(model, processor) from a local CLIP directory, or None with one logged line saying why."""
    p = Path(path)
    reason = None
    if not (p / "config.json").is_file():
        reason = f"no CLIP model at {p} (a local copy of e.g. openai/clip-vit-base-patch32; nothing is downloaded)"
    else:
        try:
            from transformers import CLIPModel, CLIPProcessor
        except ImportError as e:
            reason = f"CLIP needs transformers ({e})"
    if reason is not None:
        if reason not in _said:
            _said.add(reason)
            log.warning("skipping clip_direction: %s", reason)
        return None
    model = CLIPModel.from_pretrained(p, local_files_only=True).eval()
    return model, CLIPProcessor.from_pretrained(p, local_files_only=True)


@torch.no_grad()
def clip_direction(clip, sources: Sequence, outputs: Sequence, after: Sequence[str],
                   before: Optional[Sequence[str]] = None) -> torch.Tensor:
    """``[B]`` cosine between the image change (PIL ``sources`` -> ``outputs``) and the text change
    (``before`` -> ``after``; ``before`` defaults to empty texts)."""
    model, processor = clip
    if not len(sources) == len(outputs) == len(after):
        raise ValueError(f"clip_direction needs one source, output and text per row, got {len(sources)}, "
                         f"{len(outputs)}, {len(after)}")
    before = list(before) if before is not None else [""] * len(after)
    pixels = processor(images=[im.convert("RGB") for im in (*sources, *outputs)], return_tensors="pt")
    img = model.get_image_features(pixel_values=pixels["pixel_values"])
    tokens = processor(text=[*before, *after], return_tensors="pt", padding=True)
    txt = model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
    img, txt = (getattr(t, "pooler_output", t) for t in (img, txt))
    img = torch.nn.functional.normalize(img.float(), dim=-1)
    txt = torch.nn.functional.normalize(txt.float(), dim=-1)
    n = len(sources)
    d_img, d_txt = img[n:] - img[:n], txt[n:] - txt[:n]
    return torch.nn.functional.cosine_similarity(d_img, d_txt, dim=-1, eps=1e-8)
