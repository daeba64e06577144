"""Qwen-Image-2.1's side of the family seam: DiffSynth's ``QwenImage21Pipeline`` units, per-sample DiT calls with
the prefix KV cache (``qwen21.py``).

LBM (Latent Bridge Matching) needs nothing of its own here: the bridge's noisy target is the DiT's image
stream at σ while the references stay in the prefix at t=0 (as in every 2.1 call), so the loss and the
sampler go through :meth:`Qwen21Ops.forward` / :meth:`Qwen21Ops.velocity` as flow matching does. The bridge
sampler runs the main and the sub-stream as one batch of the same conditioning (:meth:`Cond21Batch.repeat`:
one prefix cache per prompt for both streams).
"""
from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from . import qwen21
from ..prompts import check_prompt_length
from ..family import QWEN21, Family
from ..family_ops import FamilyOps
from ..load.block_checkpoint import outer_checkpointing
from ..samplers.schedules import ScheduleSpec, flow_match_scheduler


@dataclass
class Cond21Batch(qwen21.Cond21):
    """:class:`~.qwen21.Cond21` that can repeat itself (the LBM sampler's main and sub-stream, one batch).

    A repeat shares the prefix caches: sample ``b`` uses sample ``b % period``'s (the same prompt and
    references, so the same keys and values), so each prefix is computed and held once."""

    period: int = 0  # 0: every sample its own caches

    def cache(self, dit, key):
        b, positive = key
        return super().cache(dit, (b % self.period if self.period else b, positive))

    def repeat(self, n: int) -> "Cond21Batch":
        """The same conditioning for ``n`` times as many samples, sharing this one's prefix caches."""
        return Cond21Batch(prompts=self.prompts * n, ref_latents=self.ref_latents * n,
                           negatives=None if self.negatives is None else self.negatives * n, kv_cache=self.kv_cache,
                           _caches=self._caches, period=self.period or len(self))


class Qwen21Ops(FamilyOps):
    """Qwen-Image-2.1 (and its Turbo preset's fixed grid)."""

    family: Family = QWEN21
    supports_lbm = True  # (the bridge's target stream at σ, the references in the t=0 prefix: see the docstring)
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
        check_prompt_length(pipe, prompt, max_tokens)
        return qwen21.encode_prompt21(pipe, prompt, [im.convert("RGBA") for im in refs], ref_latents)

    def split_prompt(self, encoded):
        return encoded.emb, {"pad": encoded.pad_mask}

    def join_prompt(self, emb, extras):
        if extras.get("pad") is None:
            raise ValueError("a Qwen-Image-2.1 prompt needs its reference-slot mask; the cache holds none (was it "
                             "written for Qwen-Image-Edit?)")
        return qwen21.Prompt21(emb=emb, pad_mask=extras["pad"].bool())

    def forward(self, dit, latents, timesteps, prompts, ref_latents, zero_cond_t=False,
                use_gradient_checkpointing=False):
        return qwen21.forward21(dit, latents, timesteps, prompts, ref_latents,
                                use_gradient_checkpointing=outer_checkpointing(dit, use_gradient_checkpointing))

    def conditioning(self, prompts, negatives, ref_latents, zero_cond_t, to_dit):
        def move(p: qwen21.Prompt21) -> qwen21.Prompt21:
            emb = to_dit(p.emb)
            return qwen21.Prompt21(emb=emb, pad_mask=p.pad_mask.to(emb.device))

        return Cond21Batch(prompts=[move(p) for p in prompts], ref_latents=[[to_dit(z) for z in refs] for refs in ref_latents],
                           negatives=None if negatives is None else [move(n) for n in negatives])

    def velocity(self, dit, cond, cfg):
        return qwen21.velocity21(dit, cond, cfg)

    def schedule(self, spec: ScheduleSpec):
        if spec.lightning:
            raise ValueError("scheduler 'lightning' is for Qwen-Image-Edit's Lightning LoRAs; Qwen-Image-2.1 samples "
                             "with its own schedule (use the 2.1-turbo preset for few steps)")
        # 2.1's pipeline shifts by its image-token count: one token per latent
        return flow_match_scheduler(spec.steps, spec.latent_hw[0] * spec.latent_hw[1], spec.strength, spec.sigmas)

    def decode(self, pipe, latents):
        return qwen21.decode21(pipe, latents)
