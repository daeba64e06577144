"""Qwen-Image-Edit's text and image encoding, shared by phase-1 caching, inference and validation.

Thin wrappers over DiffSynth's own units (``QwenImageUnit_PromptEmbedder``) and the
pipeline's VAE, so the cache and the editor encode exactly what DiffSynth's pipeline
would: one place decides the single- vs multi-image prompt template.
"""
from __future__ import annotations

from typing import Sequence

import torch
from PIL import Image

from ..prompts import DEFAULT_MAX_PROMPT_TOKENS, check_prompt_length

Tensor = torch.Tensor


def _prompt_unit():
    from diffsynth.pipelines.qwen_image import QwenImageUnit_PromptEmbedder

    return QwenImageUnit_PromptEmbedder()


@torch.no_grad()
def encode_prompt(pipe, prompt: str, edit_images: Sequence[Image.Image] = (), multi_image: bool = True,
                  max_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS) -> Tensor:
    """Prompt embedding ``[L, D]`` (valid tokens only), encoded together with the reference images.

    A prompt longer than ``max_tokens`` tokens raises ``ValueError`` before encoding.

    ``multi_image`` selects DiffSynth's "Picture N:" template (2509/2511); the original
    Qwen-Image-Edit encodes exactly one reference image with the single-image template.
    With no reference image the text-to-image template is used.
    """
    if pipe.text_encoder is None:
        raise ValueError("the pipeline has no text encoder loaded; load it with components including 'text_encoder'")
    check_prompt_length(pipe, prompt, max_tokens)
    edit_images = list(edit_images)
    if not multi_image and len(edit_images) > 1:
        raise ValueError(
            f"this model takes one reference image, got {len(edit_images)}; "
            "use the 2509 or 2511 preset for several reference images"
        )
    edit: Image.Image | list[Image.Image] | None
    if not edit_images:
        edit = None
    else:
        edit = edit_images if multi_image else edit_images[0]
    out = _prompt_unit().process(pipe, prompt, edit)
    emb, mask = out["prompt_emb"][0], out["prompt_emb_mask"][0]
    emb = emb[mask.bool()]
    if emb.shape[0] == 0:
        raise ValueError(f"prompt {prompt!r} encoded to an empty embedding; the template may be shorter than DiffSynth's drop_idx")
    return emb


@torch.no_grad()
def encode_image(pipe, image: Image.Image) -> Tensor:
    """VAE latents ``[16, h/8, w/8]`` of one RGB image, as DiffSynth's units encode it."""
    if pipe.vae is None:
        raise ValueError("the pipeline has no VAE loaded; load it with components including 'vae'")
    pipe.load_models_to_device(["vae"])  # no-op unless VRAM management/offload is on
    pixels = pipe.preprocess_image(image.convert("RGB")).to(device=pipe.device, dtype=pipe.torch_dtype)
    return pipe.vae.encode(pixels, device=pipe.device)[0]


@torch.no_grad()
def white_latents(pipe, width: int, height: int) -> Tensor:
    """VAE latents of a pure white image of the given pixel size (LBM's sub-stream prior)."""
    return encode_image(pipe, Image.new("RGB", (width, height), (255, 255, 255)))


@torch.no_grad()
def decode_latents(pipe, latents: Tensor) -> Image.Image:
    """Decode ``[16, h, w]`` latents to a PIL image with DiffSynth's VAE and post-processing."""
    pipe.load_models_to_device(["vae"])
    image = pipe.vae.decode(latents[None].to(device=pipe.device, dtype=pipe.torch_dtype), device=pipe.device)
    return pipe.vae_output_to_image(image)
