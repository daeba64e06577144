"""Qwen-Image-2.1's side of the family seam: encoding, the DiT forward with its prefix KV cache.

DiffSynth's own pieces do the work: ``QwenImage21Unit_EditImageEmbedder`` (references resized to the
output's area in multiples of 32, RGBA, VAE-encoded), ``QwenImage21Unit_PromptEmbedder`` (Qwen3-VL over the
template with one ``<|image_pad|>`` slot per reference, the pre-norm hidden state, the slots' mask) and
``model_fn_qwen_image_21``. What is ours, and why:

- **Batched where exact.** DiffSynth's 2.1 DiT forward reads ``img_mask[0]`` and ``img_shapes[0]``: one token
  layout per call. :func:`forward21` keeps the batch dimension at our interface (one timestep, prompt and
  reference set per sample) and makes one DiT call per group of samples that share that layout (the same
  target and reference shapes, the same prompt length and slot mask; :func:`layout_groups`), stacked on the
  batch axis; DiffSynth's modulation takes one timestep per sample. Other samples run alone, so mixed shapes
  batch exactly and every sample counts the same in any batch. A sampler's prefix KV cache is per prompt, so
  calls with caches stay per sample.
- **The prefix KV cache per prompt.** 2.1 conditions the text and reference prefix at t=0 and lets it
  attend only to itself, so its keys and values are the same at every step: :class:`Cond21` holds one
  cache per prompt (positive, negative), filled on the first step and reused after. DiffSynth's pipeline
  does the same; we keep it when we drive the sampler ourselves.
- **Fixed sigmas.** ``2.1-turbo`` samples on a fixed grid (``Preset.sigmas``) with no shift (``Qwen21Ops.schedule``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from PIL import Image

Tensor = torch.Tensor


@dataclass
class Prompt21:
    """One encoded prompt: ``emb`` [L, D] (valid tokens) and ``pad_mask`` [L] (the references' slots)."""

    emb: Tensor
    pad_mask: Tensor

    def to(self, device, dtype) -> "Prompt21":
        return Prompt21(self.emb.to(device=device, dtype=dtype), self.pad_mask.to(device=device))


def processor_min_pixels(pipe) -> Optional[int]:
    """The image processor's pixel floor, which the pipeline applies when it sizes a reference."""
    from diffsynth.pipelines.qwen_image_21 import QwenImage21Unit_EditImageEmbedder

    return QwenImage21Unit_EditImageEmbedder.get_processor_min_pixels(pipe)


def reference_size21(size: tuple[int, int], output: tuple[int, int], min_pixels: Optional[int]) -> tuple[int, int]:
    """A reference's size as 2.1's pipeline sets it: the output's area at the reference's aspect ratio, in
    multiples of 32 (``QwenImage21Unit_EditImageEmbedder.calculate_dimensions``)."""
    from diffsynth.pipelines.qwen_image_21 import QwenImage21Unit_EditImageEmbedder

    return QwenImage21Unit_EditImageEmbedder.calculate_dimensions(output[0] * output[1], size[0] / size[1],
                                                                   min_pixels)


def reference_images21(pipe, images: Sequence[Image.Image], width: int, height: int) -> list[Image.Image]:
    """The references as 2.1's pipeline resizes them: RGBA, LANCZOS, to :func:`reference_size21`."""
    floor = processor_min_pixels(pipe)
    return [im.convert("RGBA").resize(reference_size21(im.size, (width, height), floor), Image.Resampling.LANCZOS)
            for im in images]


@torch.no_grad()
def encode_image21(pipe, image: Image.Image) -> Tensor:
    """VAE latents ``[64, h/16, w/16]`` of one image (RGBA; an RGB image is opaque)."""
    if pipe.vae is None:
        raise ValueError("the pipeline has no VAE loaded; load it with components including 'vae'")
    pipe.load_models_to_device(["vae"])
    pixels = pipe.preprocess_image(image.convert("RGBA")).to(device=pipe.device, dtype=pipe.torch_dtype)
    return pipe.vae.encode(pixels)[0]


@torch.no_grad()
def decode21(pipe, latents: Tensor) -> Image.Image:
    """Decode ``[64, h, w]`` latents; the RGBA output is composited over white, as the edit's RGB result."""
    pipe.load_models_to_device(["vae"])
    image = pipe.vae_output_to_image(pipe.vae.decode(latents[None].to(device=pipe.device, dtype=pipe.torch_dtype)))
    if image.mode != "RGBA":
        return image.convert("RGB")
    canvas = Image.new("RGB", image.size, (255, 255, 255))
    canvas.paste(image, mask=image.getchannel("A"))
    return canvas


@torch.no_grad()
def encode_prompt21(pipe, prompt: str, references: Sequence[Image.Image], ref_latents: Sequence[Tensor] = ()
                    ) -> Prompt21:
    """The prompt encoded with its references (``reference_images21``'s images; ``ref_latents`` [64, h, w]
    only bound the text budget, as in DiffSynth)."""
    from diffsynth.pipelines.qwen_image_21 import QwenImage21Unit_PromptEmbedder

    if pipe.text_encoder is None or pipe.processor is None:
        raise ValueError("the pipeline has no text encoder loaded; load it with components including 'text_encoder'")
    out = QwenImage21Unit_PromptEmbedder().process(pipe, prompt, list(references) or None,
                                                   [z[None] for z in ref_latents] or None)
    emb, pad = out["prompt_embeds"][0], out["edit_image_pad_mask"][0]
    if out["prompt_embeds_mask"] is not None:
        keep = out["prompt_embeds_mask"][0].bool()
        emb, pad = emb[keep], pad[keep]
    return Prompt21(emb=emb, pad_mask=pad.bool())


def new_kv_cache(dit) -> list[dict]:
    """An empty prefix cache for one prompt: one dict per block, filled by the first DiT call."""
    return [{} for _ in dit.transformer_blocks]


@dataclass
class Cond21:
    """Per-sample 2.1 conditioning: ``prompts[b]``, ``negatives[b]`` (CFG only) and ``ref_latents[b]`` (a list
    of [64, h, w]); with ``kv_cache`` each prompt's prefix is computed once per sampling run."""

    prompts: list[Prompt21]
    ref_latents: list[list[Tensor]]
    negatives: Optional[list[Prompt21]] = None
    kv_cache: bool = True
    _caches: dict = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.prompts)

    def cache(self, dit, key: tuple[int, bool]) -> Optional[list[dict]]:
        if not self.kv_cache:
            return None
        if key not in self._caches:
            self._caches[key] = new_kv_cache(dit)
        return self._caches[key]


def layout_groups(latents: Sequence[Tensor], prompts: Sequence[Prompt21], ref_latents: Sequence[Sequence[Tensor]]
                  ) -> list[list[int]]:
    """Sample indices grouped by token layout (target shape, reference shapes, prompt length and slot mask), in
    first-seen order: each group can be one DiT call. A mask off the host is never read (its sample runs alone)."""
    groups: dict = {}
    for b, x in enumerate(latents):
        pad = prompts[b].pad_mask
        if pad.device.type != "cpu":
            groups[("alone", b)] = [b]
            continue
        key = (tuple(x.shape), tuple(tuple(z.shape) for z in ref_latents[b]), tuple(prompts[b].emb.shape),
               tuple(bool(v) for v in pad.reshape(-1).tolist()))
        groups.setdefault(key, []).append(b)
    return list(groups.values())


def forward21(dit, latents: Sequence[Tensor], timesteps: Tensor, prompts: Sequence[Prompt21],
              ref_latents: Sequence[Sequence[Tensor]], caches: Optional[Sequence[Optional[list]]] = None,
              use_gradient_checkpointing: bool = False) -> list[Tensor]:
    """The 2.1 DiT's velocity for each sample: ``latents[b]`` [64, h_b, w_b] at ``timesteps[b]`` (0..1000) with
    its own prompt and references. One DiffSynth ``model_fn_qwen_image_21`` call per group of samples with one
    token layout (:func:`layout_groups`; per sample with ``caches``); the timestep moves to the samples' device
    and takes the DiT's dtype before the division by 1000, as in the pipeline."""
    from diffsynth.pipelines.qwen_image_21 import model_fn_qwen_image_21

    dtype = next(dit.parameters()).dtype
    groups = [[b] for b in range(len(latents))] if caches is not None else layout_groups(latents, prompts, ref_latents)
    out: list[Optional[Tensor]] = [None] * len(latents)
    for group in groups:
        first = group[0]
        x = torch.stack([latents[b] for b in group])
        v = model_fn_qwen_image_21(
            # (a sampler's timesteps are the scheduler's, on the host: the DiT's timestep embedder needs them on
            # the latents' device, as DiffSynth's pipeline moves them)
            dit, latents=x, timestep=timesteps.reshape(-1)[group].to(device=x.device, dtype=dtype),
            prompt_embeds=torch.stack([prompts[b].emb for b in group]), prompt_embeds_mask=None,
            # (one slot mask for the group, as the DiT reads img_mask[0]; it goes to the latents' device: DiffSynth's
            # model_fn concatenates it with a target mask it makes there, and its forward reads it back for the token
            # bookkeeping. An edit's conditioning moved it once per prompt, so this is a no-op at every step; a
            # training sample's comes from the cache on the host. Keeping it on the host would take a copy of
            # DiffSynth's forward: docs/DIFFSYNTH_NOTES.md)
            edit_image_pad_mask=prompts[first].pad_mask[None].to(x.device),
            edit_latents=[torch.stack([ref_latents[b][k] for b in group]) for k in range(len(ref_latents[first]))]
            or None,
            kv_cache=None if caches is None else caches[first], use_gradient_checkpointing=use_gradient_checkpointing)
        for i, b in enumerate(group):
            out[b] = v[i]
    return out


def velocity21(dit, cond: Cond21, cfg: float = 1.0):
    """A sampler velocity function ``(x [B, 64, h, w], timesteps [B]) -> v`` with true CFG (any ``cfg`` != 1)."""
    if cfg != 1.0 and cond.negatives is None:
        raise ValueError(f"cfg={cfg} needs the negative prompt encoded, or use cfg=1")
    samples = range(len(cond))

    def velocity(x: Tensor, timesteps: Tensor) -> Tensor:
        timesteps = timesteps.reshape(-1).expand(x.shape[0]) if timesteps.numel() == 1 else timesteps.reshape(-1)
        pos = forward21(dit, list(x), timesteps, cond.prompts, cond.ref_latents,
                        [cond.cache(dit, (b, True)) for b in samples])
        if cfg == 1.0:
            return torch.stack(pos)
        neg = forward21(dit, list(x), timesteps, cond.negatives, cond.ref_latents,
                        [cond.cache(dit, (b, False)) for b in samples])
        return torch.stack([n + cfg * (p - n) for p, n in zip(pos, neg)])

    return velocity
