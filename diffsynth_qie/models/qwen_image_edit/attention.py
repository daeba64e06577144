"""Mixed-length batches without a padding mask: each sample attends over its own tokens only.

A batch whose samples differ in prompt length or image layout is padded to the longest
(``models/qwen_image_edit/forward.py``), and DiffSynth's attention then gets a boolean key mask. With a mask, SDPA cannot use
the flash kernels (it falls back to the memory-efficient kernel, slower at 8 k tokens) and DiffSynth's FA3
branch is skipped. This piece keeps DiffSynth's block code unchanged and replaces only the masked attention
call: while a block runs inside :func:`per_sample_block`, an ``F.scaled_dot_product_attention`` call that
carries *this batch's* mask (recognised by identity) runs once per sample, unmasked, over that sample's
valid text and image tokens; padded query positions get zeros (they are never attended to, and the
forward drops them). The valid outputs are the same attention over the same keys as the masked call, and
the same computation a batch of one does. Its own small piece, not DiffSynth's code, because DiffSynth's
attention takes one dense mask.

The block is entered through the wrapper in the forward pass and again in a checkpointed block's recompute,
so both compute the same tensors; module hooks (block swapping) still fire, since the wrapper calls the block.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.overrides import TorchFunctionMode

F = torch.nn.functional
_SDPA = torch._C._nn.scaled_dot_product_attention  # what F.scaled_dot_product_attention is


def per_sample_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_max: int,
                         text_lens: Sequence[int], image_lens: Sequence[int]) -> torch.Tensor:
    """SDPA over joint ``[text (text_max), image]`` tokens ``[B, H, L, D]``: sample ``b`` attends over its first
    ``text_lens[b]`` text and first ``image_lens[b]`` image tokens, unmasked; padded queries get zeros."""
    heads, length, dim = q.shape[1], q.shape[2], q.shape[3]
    out = []
    for b, (tl, il) in enumerate(zip(text_lens, image_lens)):
        def valid(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[b:b + 1, :, :tl], x[b:b + 1, :, text_max:text_max + il]], dim=2)

        o = F.scaled_dot_product_attention(valid(q), valid(k), valid(v))
        pad_text = o.new_zeros(1, heads, text_max - tl, dim)
        pad_image = o.new_zeros(1, heads, length - text_max - il, dim)
        out.append(torch.cat([o[:, :, :tl], pad_text, o[:, :, tl:], pad_image], dim=2))
    return torch.cat(out, dim=0)


class _PerSampleSDPA(TorchFunctionMode):
    """Routes the SDPA calls that pass ``mask`` to :func:`per_sample_attention`; everything else as is."""

    def __init__(self, mask: torch.Tensor, text_max: int, text_lens: Sequence[int], image_lens: Sequence[int]):
        super().__init__()
        self.mask, self.text_max, self.text_lens, self.image_lens = mask, text_max, text_lens, image_lens

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA and kwargs.get("attn_mask") is self.mask \
                and len(args) == 3 and set(kwargs) == {"attn_mask"}:
            return per_sample_attention(*args, self.text_max, self.text_lens, self.image_lens)
        return func(*args, **kwargs)


class per_sample_block:
    """``block(**inputs)`` with its masked attention run per sample (module docstring); a callable for
    DiffSynth's ``gradient_checkpoint_forward``, which calls it in the forward pass and in the recompute."""

    def __init__(self, block, mask: torch.Tensor, text_max: int, text_lens: Sequence[int],
                 image_lens: Sequence[int]):
        self.block, self.args = block, (mask, text_max, list(text_lens), list(image_lens))

    def __call__(self, *args, **kwargs):
        with _PerSampleSDPA(*self.args):
            return self.block(*args, **kwargs)
