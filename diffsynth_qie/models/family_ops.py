"""What the cache, the training loss and the :class:`~diffsynth_qie.inference.editor.Editor` do differently per
model family, behind one small interface.

The flows are the same for every family: the cache sizes the images, VAE-encodes them and encodes the
prompts with the references; the loss runs the DiT on noisy latents; the editor samples from seeded noise
and decodes. These classes supply the family's steps, and :func:`ops_for` picks one by ``Family.name``
(``family.py``): nothing else asks which family it serves.

A prompt encoding is family-specific (a tensor [L, D] for Qwen-Image-Edit, a :class:`~.qwen21.Prompt21` with
the references' slot mask for 2.1); :meth:`EditOps.split_prompt` / :meth:`EditOps.join_prompt` turn it into
tensors for the cache and back.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from PIL import Image

from ..utils.sizes import fit_image
from . import qwen21
from .encoding import decode_latents, encode_image, encode_prompt, white_latents
from .family import EDIT, QWEN21, Family
from .forward import dit_forward
from .sampling import Conditioning, dit_velocity

Tensor = torch.Tensor


def reference_size(image: Image.Image, ref_max_pixels: int | None) -> tuple[int, int]:
    """A reference image's encoding size in the editor (Qwen-Image-Edit): fitted to the budget (downscale only),
    multiple of 16."""
    budget = ref_max_pixels if ref_max_pixels is not None else image.size[0] * image.size[1]
    return fit_image(image.size, max(budget, 256), 16, "a reference image")


class EditOps:
    """Qwen-Image-Edit (original, 2509, 2511): DiffSynth's ``QwenImagePipeline`` units, our batched forward."""

    family: Family = EDIT
    supports_lbm = True
    supports_zero_cond_t = True  # 2511's zero-timestep modulation of the reference tokens

    # --- sizes -----------------------------------------------------------------------------------------
    def reference_sizes(self, pipe, images: Sequence[Image.Image], width: int, height: int,
                        ref_max_pixels: Optional[int]) -> list[tuple[int, int]]:
        """The editor's reference sizes: each fitted to ``ref_max_pixels`` (downscale only), multiples of 16."""
        return [reference_size(im, ref_max_pixels) for im in images]

    def cache_reference_size(self, size: tuple[int, int], target_size: tuple[int, int], max_pixels: int,
                             divisor: int, source: str) -> tuple[int, int]:
        """A cached reference's size: fitted to the references' own budget (``--edit_max_pixels``)."""
        return fit_image(size, max_pixels, divisor, source)

    # --- encoding --------------------------------------------------------------------------------------
    def encode_image(self, pipe, image: Image.Image) -> Tensor:
        return encode_image(pipe, image)

    def vae_pixels(self, pipe, image: Image.Image) -> Tensor:
        """One image as the VAE takes it (``[1, C, H, W]`` on the pipeline's device and dtype)."""
        return pipe.preprocess_image(image.convert("RGB")).to(device=pipe.device, dtype=pipe.torch_dtype)

    def white(self, pipe, width: int, height: int) -> Tensor:
        return white_latents(pipe, width, height)

    def encode_prompt(self, pipe, prompt: str, refs: Sequence[Image.Image], ref_latents: Sequence[Tensor],
                      multi_image: bool, max_tokens: Optional[int]):
        return encode_prompt(pipe, prompt, refs, multi_image=multi_image, max_tokens=max_tokens)

    def split_prompt(self, encoded) -> tuple[Tensor, Optional[Tensor]]:
        """An encoded prompt as cache tensors: (embedding [L, D], the references' slot mask [L] or None)."""
        return encoded, None

    def join_prompt(self, emb: Tensor, pad_mask: Optional[Tensor]):
        return emb

    # --- the DiT -----------------------------------------------------------------------------------------
    def forward(self, dit, latents: Sequence[Tensor], timesteps: Tensor, prompts: Sequence, ref_latents,
                zero_cond_t: bool = False, use_gradient_checkpointing: bool = False) -> list[Tensor]:
        """The training loss's DiT call: one velocity per sample (``prompts`` as :meth:`join_prompt` gives)."""
        return dit_forward(dit, latents, timesteps, prompts, ref_latents, zero_cond_t=zero_cond_t,
                           use_gradient_checkpointing=use_gradient_checkpointing)

    def conditioning(self, prompts: Sequence, negatives: Optional[Sequence], ref_latents: Sequence[Sequence[Tensor]],
                     zero_cond_t: bool, to_dit: Callable[[Tensor], Tensor]) -> Conditioning:
        """The sampler's per-sample conditioning (``prompts[b]`` as :meth:`encode_prompt` / :meth:`join_prompt`
        give them; ``negatives`` only for CFG), moved with ``to_dit``."""
        return Conditioning(prompt_embs=[to_dit(p) for p in prompts],
                            edit_latents=[[to_dit(z) for z in refs] for refs in ref_latents],
                            negative_embs=None if negatives is None else [to_dit(n) for n in negatives],
                            zero_cond_t=zero_cond_t)

    def velocity(self, dit, cond, cfg: float):
        return dit_velocity(dit, cond, cfg)

    def schedule(self, preset, steps: int, latent_hw: tuple[int, int], kind: str, strength: float = 1.0):
        return None  # the sampler's own (default or Lightning)

    def decode(self, pipe, latents: Tensor) -> Image.Image:
        return decode_latents(pipe, latents)


class Qwen21Ops(EditOps):
    """Qwen-Image-2.1: DiffSynth's ``QwenImage21Pipeline`` units, per-sample DiT calls with the prefix KV cache."""

    family: Family = QWEN21
    supports_lbm = False  # (LBM is built for the Edit family; 2.1's references sit in a t=0 prefix instead)
    supports_zero_cond_t = False  # (2.1 conditions its whole prefix at t=0 by design)

    def reference_sizes(self, pipe, images, width, height, ref_max_pixels):
        """As 2.1's pipeline sizes them: the output's area at each reference's aspect ratio, multiples of 32, at
        least the processor's minimum (``ref_max_pixels`` unused)."""
        return [qwen21.reference_size21(im.size, (width, height), qwen21.processor_min_pixels(pipe)) for im in images]

    def cache_reference_size(self, size, target_size, max_pixels, divisor, source):
        """As the pipeline sizes them at inference: the target's area at the reference's aspect ratio (the
        processor's minimum is not known here; it matters only for targets below it, 256x256 for the real model)."""
        return qwen21.reference_size21(size, target_size, None)

    def encode_image(self, pipe, image):
        return qwen21.encode_image21(pipe, image)

    def vae_pixels(self, pipe, image):
        return pipe.preprocess_image(image.convert("RGBA")).to(device=pipe.device, dtype=pipe.torch_dtype)

    def white(self, pipe, width, height):
        return qwen21.encode_image21(pipe, Image.new("RGB", (width, height), (255, 255, 255)))

    def encode_prompt(self, pipe, prompt, refs, ref_latents, multi_image, max_tokens):
        from .encoding import check_prompt_length

        check_prompt_length(pipe, prompt, max_tokens)
        return qwen21.encode_prompt21(pipe, prompt, [im.convert("RGBA") for im in refs], ref_latents)

    def split_prompt(self, encoded):
        return encoded.emb, encoded.pad_mask

    def join_prompt(self, emb, pad_mask):
        if pad_mask is None:
            raise ValueError("a Qwen-Image-2.1 prompt needs its reference-slot mask; the cache holds none (was it "
                             "written for Qwen-Image-Edit?)")
        return qwen21.Prompt21(emb=emb, pad_mask=pad_mask.bool())

    def forward(self, dit, latents, timesteps, prompts, ref_latents, zero_cond_t=False,
                use_gradient_checkpointing=False):
        return qwen21.forward21(dit, latents, timesteps, prompts, ref_latents,
                                use_gradient_checkpointing=use_gradient_checkpointing)

    def conditioning(self, prompts, negatives, ref_latents, zero_cond_t, to_dit):
        def move(p: qwen21.Prompt21) -> qwen21.Prompt21:
            emb = to_dit(p.emb)
            return qwen21.Prompt21(emb=emb, pad_mask=p.pad_mask.to(emb.device))

        return qwen21.Cond21(prompts=[move(p) for p in prompts], ref_latents=[[to_dit(z) for z in refs] for refs in ref_latents],
                             negatives=None if negatives is None else [move(n) for n in negatives])

    def velocity(self, dit, cond, cfg):
        return qwen21.velocity21(dit, cond, cfg)

    def schedule(self, preset, steps, latent_hw, kind, strength=1.0):
        if kind != "default":
            raise ValueError(f"scheduler {kind!r} is for Qwen-Image-Edit's Lightning LoRAs; Qwen-Image-2.1 samples "
                             "with its own schedule (use the 2.1-turbo preset for few steps)")
        return qwen21.scheduler21(steps, *latent_hw, sigmas=getattr(preset, "sigmas", None), strength=strength)

    def decode(self, pipe, latents):
        return qwen21.decode21(pipe, latents)


_OPS = {ops.family.name: ops for ops in (EditOps(), Qwen21Ops())}


def ops_for(family: Family | str) -> EditOps:
    """The ops of a family (or of a family name)."""
    return _OPS[family if isinstance(family, str) else family.name]
