"""Batched Qwen-Image(-Edit) DiT forward: mixed shapes, per-sample RoPE and timesteps.

Why our own ``model_fn``: DiffSynth's ``model_fn_qwen_image`` hard-codes batch size 1
(``img_shapes = [(1, h, w)]``, ``rearrange(..., B=1)``, a single ``modulate_index`` row
for ``zero_cond_t``). Everything below that — ``img_in``, ``txt_in``, ``pos_embed``,
``time_text_embed``, the ``QwenImageTransformerBlock``s, ``norm_out``, ``proj_out`` — is
DiffSynth's own code, driven unchanged:

- **Per-sample RoPE.** ``QwenEmbedRope`` is called once per sample with that sample's own
  ``img_shapes`` (target first, then each reference image) and text length. The block's
  ``apply_rotary_emb_qwen`` multiplies ``x[B, H, S, D/2]`` by the frequencies, so a
  ``[B, 1, S, D/2]`` tensor broadcasts per sample with no patching.
- **Padding.** Image tokens (target + references) are padded to the longest sample and
  text tokens to the longest prompt. A boolean key mask ``[B, 1, 1, T+S]`` hides padded
  keys from every query (SDPA semantics: True = attend). Outputs at padded positions are
  discarded, so padded values cannot leak into valid outputs.
- **zero_cond_t (2511).** The conditioning is ``cat([temb(t), temb(0)])`` and
  ``modulate_index[b, s]`` is 0 for sample b's target tokens and 1 for its reference
  tokens: per sample, because each sample's target length differs.
- **Timestep dtype.** The timesteps are cast to the DiT's compute dtype (the dtype
  ``img_in`` returns) and then divided by 1000, exactly as ``QwenImagePipeline.__call__``
  and DiffSynth's ``FlowMatchSFTLoss`` feed ``model_fn_qwen_image`` (the pipeline dtype):
  in bf16, 1000·σ is rounded. Callers pass fp32 timesteps; this is the only place that
  decides, so a LoRA sees the same timesteps at training, validation and inference.
- **Fast path.** When every sample has the same image layout and prompt length no mask is
  built and RoPE is shared, so the attention can use flash/cuDNN kernels.
- **Mixed lengths on a GPU.** A padded batch's attention runs once per sample over its own
  tokens, unmasked (``models/qwen_image_edit/attention.py``), so the flash kernels stay usable; on the CPU
  (with ``per_sample_attention=False``, and with ``--compile``: ``models/load/compile.py``) the masked call
  runs. Both give the same numbers.

The batched output matches per-sample runs (tests/test_forward.py pins ≤1e-3 relative
error in fp32, usually ~1e-6).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

import torch
from einops import rearrange

Tensor = torch.Tensor


@dataclass
class PackedBatch:
    """Token-level layout of a batch (built by :func:`pack_batch`)."""

    image: Tensor            # [B, S, 64] patchified target + reference tokens, zero-padded
    text: Tensor             # [B, T, D_txt] prompt embeddings, zero-padded
    img_shapes: list[list[tuple[int, int, int]]]  # per sample: (1, h/2, w/2) per image
    target_shapes: list[tuple[int, int]]          # per sample latent (h, w) of the target
    image_lens: list[int]    # valid image tokens per sample
    target_lens: list[int]   # valid *target* tokens per sample (prefix of image tokens)
    text_lens: list[int]     # valid text tokens per sample

    @property
    def uniform(self) -> bool:
        """True when no padding is needed at all (same layout, same prompt length)."""
        return len({tuple(s) for s in self.img_shapes}) == 1 and len(set(self.text_lens)) == 1


def _patchify(latents: Tensor) -> Tensor:
    """[C, h, w] -> [(h/2)(w/2), C*4] exactly as DiffSynth's model_fn does (2x2 patches)."""
    if latents.ndim != 3 or latents.shape[1] % 2 or latents.shape[2] % 2:
        raise ValueError(f"expected latents [C, h, w] with even h, w; got shape {tuple(latents.shape)}")
    return rearrange(latents, "C (H P) (W Q) -> (H W) (C P Q)", P=2, Q=2)


def _unpatchify(tokens: Tensor, h: int, w: int) -> Tensor:
    return rearrange(tokens, "(H W) (C P Q) -> C (H P) (W Q)", H=h // 2, W=w // 2, P=2, Q=2)


def _pad_stack(items: Sequence[Tensor], length: int) -> Tensor:
    """Stack [L_i, D] tensors into [B, length, D], zero-padding at the end."""
    out = items[0].new_zeros(len(items), length, items[0].shape[-1])
    for i, x in enumerate(items):
        out[i, : x.shape[0]] = x
    return out


def as_sample_list(latents: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """Accept a [B, C, h, w] tensor or a list of [C, h, w] tensors; return the list."""
    if isinstance(latents, Tensor):
        if latents.ndim != 4:
            raise ValueError(f"expected [B, C, h, w] latents, got shape {tuple(latents.shape)}")
        return list(latents.unbind(0))
    return list(latents)


def pack_batch(
    latents: Sequence[Tensor],
    edit_latents: Sequence[Sequence[Tensor]] | None,
    prompt_embs: Sequence[Tensor],
) -> PackedBatch:
    """Patchify and pad a batch of (target, references, prompt) samples."""
    batch = len(latents)
    if len(prompt_embs) != batch:
        raise ValueError(f"got {batch} latents but {len(prompt_embs)} prompt embeddings")
    edit_latents = edit_latents if edit_latents is not None else [[] for _ in range(batch)]
    if len(edit_latents) != batch:
        raise ValueError(f"got {batch} latents but {len(edit_latents)} edit-latent lists")
    tokens, img_shapes, target_shapes, target_lens = [], [], [], []
    for target, refs in zip(latents, edit_latents):
        parts = [target, *refs]
        tokens.append(torch.cat([_patchify(p) for p in parts], dim=0))
        img_shapes.append([(1, p.shape[1] // 2, p.shape[2] // 2) for p in parts])
        target_shapes.append((target.shape[1], target.shape[2]))
        target_lens.append(prod(target.shape[1:]) // 4)
    image_lens = [t.shape[0] for t in tokens]
    text_lens = [p.shape[0] for p in prompt_embs]
    return PackedBatch(
        image=_pad_stack(tokens, max(image_lens)),
        text=_pad_stack(list(prompt_embs), max(text_lens)),
        img_shapes=img_shapes,
        target_shapes=target_shapes,
        image_lens=image_lens,
        target_lens=target_lens,
        text_lens=text_lens,
    )


def rope_for_batch(dit, packed: PackedBatch, device) -> tuple[Tensor, Tensor]:
    """Per-sample RoPE from DiffSynth's ``pos_embed``: ([B,1,S,D/2], [B,1,T,D/2]) or shared 2-D."""
    if packed.uniform:
        return dit.pos_embed(packed.img_shapes[0], packed.text_lens[:1], device=device)
    per_sample = [dit.pos_embed(shapes, [tl], device=device) for shapes, tl in zip(packed.img_shapes, packed.text_lens)]
    s_max, t_max = packed.image.shape[1], packed.text.shape[1]
    img = torch.stack([torch.nn.functional.pad(v, (0, 0, 0, s_max - v.shape[0]), value=1.0) for v, _ in per_sample])
    txt = torch.stack([torch.nn.functional.pad(t, (0, 0, 0, t_max - t.shape[0]), value=1.0) for _, t in per_sample])
    return img.unsqueeze(1), txt.unsqueeze(1)


def key_padding_mask(packed: PackedBatch, device) -> Tensor | None:
    """Boolean SDPA mask [B, 1, 1, T+S] (True = attend) over the joint [text, image] keys."""
    if packed.uniform:
        return None
    t_max, s_max = packed.text.shape[1], packed.image.shape[1]
    text_valid = torch.arange(t_max, device=device)[None] < torch.tensor(packed.text_lens, device=device)[:, None]
    image_valid = torch.arange(s_max, device=device)[None] < torch.tensor(packed.image_lens, device=device)[:, None]
    return torch.cat([text_valid, image_valid], dim=1)[:, None, None, :]


def modulate_index(packed: PackedBatch, device) -> Tensor:
    """zero_cond_t index [B, S]: 0 on each sample's target tokens, 1 on its references (and padding)."""
    s_max = packed.image.shape[1]
    return (torch.arange(s_max, device=device)[None] >= torch.tensor(packed.target_lens, device=device)[:, None]).int()


def dit_forward(
    dit,
    latents: Tensor | Sequence[Tensor],
    timesteps: Tensor,
    prompt_embs: Sequence[Tensor],
    edit_latents: Sequence[Sequence[Tensor]] | None = None,
    zero_cond_t: bool = False,
    use_gradient_checkpointing: bool = False,
    use_gradient_checkpointing_offload: bool = False,
    per_sample_attention: bool | None = None,
) -> list[Tensor]:
    """Predict the flow (velocity) for a batch of samples of any shapes.

    Args:
        dit: DiffSynth ``QwenImageDiT`` (or a subclass with the same attributes).
        latents: noisy targets, ``[B, 16, h, w]`` or a list of ``[16, h_b, w_b]``.
        timesteps: ``[B]`` in DiffSynth's 0..1000 scale (σ·1000), one per sample, any float dtype:
            they are cast to the DiT's compute dtype here (bf16 rounds them, as in DiffSynth), so
            training, validation and inference all feed the DiT the same values.
        prompt_embs: per sample ``[L_b, D_txt]``, valid tokens only (no padding).
        edit_latents: per sample a list (possibly empty) of reference latents ``[16, h_i, w_i]``.
        zero_cond_t: Qwen-Image-Edit-2511's zero-timestep modulation of reference tokens.
        per_sample_attention: a padded batch's attention per sample, unmasked (``None``: on a GPU, unless the
            blocks are compiled).

    Returns:
        One ``[16, h_b, w_b]`` prediction per sample.
    """
    from diffsynth.core import gradient_checkpoint_forward

    latents = as_sample_list(latents)
    batch = len(latents)
    timesteps = timesteps.reshape(-1)
    if timesteps.numel() == 1 and batch > 1:
        timesteps = timesteps.expand(batch)
    if timesteps.numel() != batch:
        raise ValueError(f"need one timestep per sample: got {timesteps.numel()} for batch {batch}")
    packed = pack_batch(latents, edit_latents, prompt_embs)
    device = packed.image.device

    image = dit.img_in(packed.image)
    text = dit.txt_in(dit.txt_norm(packed.text))
    # The one place the timestep dtype is decided: the DiT's compute dtype, before the /1000, as
    # DiffSynth's pipeline and its training loss feed model_fn_qwen_image (bf16 rounds 1000·σ).
    t = timesteps.to(device=device, dtype=image.dtype) / 1000
    index = None
    if zero_cond_t:
        t = torch.cat([t, t * 0], dim=0)
        index = modulate_index(packed, device)
    extra = None
    if dit.time_text_embed.use_additional_t_cond:
        extra = torch.zeros(t.shape[0], dtype=torch.long, device=device)
    conditioning = dit.time_text_embed(t, image.dtype, addition_t_cond=extra)
    rope = rope_for_batch(dit, packed, device)
    mask = key_padding_mask(packed, device)
    if per_sample_attention is None:  # (compiled blocks take the mask: a graph would bake in each sample's length)
        from ..load.compile import is_compiled

        per_sample_attention = device.type == "cuda" and not is_compiled(dit)

    for block in dit.transformer_blocks:
        if mask is not None and per_sample_attention:
            from .attention import per_sample_block

            block = per_sample_block(block, mask, packed.text.shape[1], packed.text_lens, packed.image_lens)
        text, image = gradient_checkpoint_forward(
            block,
            use_gradient_checkpointing,
            use_gradient_checkpointing_offload,
            image=image,
            text=text,
            temb=conditioning,
            image_rotary_emb=rope,
            attention_mask=mask,
            modulate_index=index,
        )

    if zero_cond_t:
        conditioning = conditioning.chunk(2, dim=0)[0]
    image = dit.proj_out(dit.norm_out(image, conditioning))
    return [
        _unpatchify(image[b, : packed.target_lens[b]], *packed.target_shapes[b])
        for b in range(batch)
    ]


ROPE_CACHE_ENTRIES = 64


def bound_rope_cache(dit, limit: int = ROPE_CACHE_ENTRIES) -> None:
    """DiffSynth's ``QwenEmbedRope`` keeps a RoPE table per (image, height, width) forever (about 2 MiB each at
    1024² on the GPU); a long-running editor fed arbitrary sizes would grow without end. Empty it once it
    holds ``limit`` entries (rebuilding one costs microseconds)."""
    cache = getattr(getattr(dit, "pos_embed", None), "rope_cache", None)
    if isinstance(cache, dict) and len(cache) >= limit:
        cache.clear()
