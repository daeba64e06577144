"""Qwen-Image-Edit's side of the family seam (original, 2509, 2511): DiffSynth's ``QwenImagePipeline`` units,
our batched forward (``forward.py``) and samplers' conditioning (``sampling.py``)."""
from __future__ import annotations

from PIL import Image

from ...utils.sizes import fit_image
from .encoding import decode_latents, encode_image, encode_prompt, white_latents
from ..family import EDIT, Family
from ..family_ops import FamilyOps
from ..load.block_checkpoint import outer_checkpointing
from .forward import dit_forward
from ..samplers.sampling import Conditioning, dit_velocity
from ..samplers.schedules import ScheduleSpec, edit_schedule


def reference_size(image: Image.Image, ref_max_pixels: int | None) -> tuple[int, int]:
    """A reference image's encoding size in the editor (Qwen-Image-Edit): fitted to the budget (downscale only),
    multiple of 16."""
    budget = ref_max_pixels if ref_max_pixels is not None else image.size[0] * image.size[1]
    return fit_image(image.size, max(budget, 256), 16, "a reference image")


class EditOps(FamilyOps):
    """Qwen-Image-Edit (original, 2509, 2511)."""

    family: Family = EDIT
    supports_lbm = True
    supports_zero_cond_t = True  # 2511's zero-timestep modulation of the reference tokens

    def reference_sizes(self, pipe, images, width, height, ref_max_pixels):
        """Each fitted to ``ref_max_pixels`` (downscale only), multiples of 16."""
        return [reference_size(im, ref_max_pixels) for im in images]

    def cache_reference_size(self, size, target_size, max_pixels, divisor, source):
        """Fitted to the references' own budget (``--edit_max_pixels``)."""
        return fit_image(size, max_pixels, divisor, source)

    def encode_image(self, pipe, image):
        return encode_image(pipe, image)

    def vae_pixels(self, pipe, image):
        return pipe.preprocess_image(image.convert("RGB")).to(device=pipe.device, dtype=pipe.torch_dtype)

    def white(self, pipe, width, height):
        return white_latents(pipe, width, height)

    def encode_prompt(self, pipe, prompt, refs, ref_latents, multi_image, max_tokens):
        return encode_prompt(pipe, prompt, refs, multi_image=multi_image, max_tokens=max_tokens)

    def split_prompt(self, encoded):
        return encoded, {}

    def join_prompt(self, emb, extras):
        return emb

    def forward(self, dit, latents, timesteps, prompts, ref_latents, zero_cond_t=False,
                use_gradient_checkpointing=False):
        return dit_forward(dit, latents, timesteps, prompts, ref_latents, zero_cond_t=zero_cond_t,
                           use_gradient_checkpointing=outer_checkpointing(dit, use_gradient_checkpointing))

    def conditioning(self, prompts, negatives, ref_latents, zero_cond_t, to_dit) -> Conditioning:
        return Conditioning(prompt_embs=[to_dit(p) for p in prompts],
                            edit_latents=[[to_dit(z) for z in refs] for refs in ref_latents],
                            negative_embs=None if negatives is None else [to_dit(n) for n in negatives],
                            zero_cond_t=zero_cond_t)

    def velocity(self, dit, cond, cfg):
        return dit_velocity(dit, cond, cfg)

    def schedule(self, spec: ScheduleSpec):
        return edit_schedule(spec)

    def decode(self, pipe, latents):
        return decode_latents(pipe, latents)


