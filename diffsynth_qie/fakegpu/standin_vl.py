"""The Qwen-VL prompt encoders' host bookkeeping on the fake CUDA device, for every model family.

The Qwen-VL prompt encoders (Qwen2.5-VL for Qwen-Image-Edit, Qwen3-VL for Qwen-Image-2.1) find the image tokens
and build their RoPE positions by reading token ids on the host (``get_rope_index``, the placeholder mask); a
fake device has no values to read. The stand-in runs the family's own language model over the same number of
tokens, which is what holds memory: the template, the image tokens of each reference (Qwen-Image-Edit: at the
processor's size; Qwen-Image-2.1: one slot per 2x2 latents, laid out by ``standin21.slot_mask21`` for families
whose prompt carries the references' slot mask, ``"pad"`` in ``Family.prompt_tensors``), and the prompt. The
vision tower's own activations are left out (its weights are counted; its working set is a few MB beside the
language model's). No vocabulary either: a prompt counts ``prompt_tokens`` tokens (:class:`FakeTokenizer`).

Used by the edit check (``preflight/edit_standins.py``) and by the training check's on-the-fly encode
(``preflight/train_onthefly.py``, through :class:`StandinOps`, which replaces only ``encode_prompt`` of the
family's ops: the VAE encode, the white latents and everything around them run as in a real run).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import torch

TEMPLATE_TOKENS = 64  # DiffSynth's edit prompt template (drop_idx) + "Picture N:" markers, rounded up
PROCESSOR_PIXELS = 384 * 384  # DiffSynth resizes each reference to about this area for the Qwen2.5-VL encoder


class FakeTokenizer:
    """Counts ``prompt_tokens`` tokens for a prompt, none for an empty one (``check_prompt_length`` asks)."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [0] * (self.prompt_tokens if text else 0)}


def language_model(text_encoder) -> torch.nn.Module:
    """The text encoder's language model (Qwen2.5-VL's and Qwen3-VL's are both named ``language_model``)."""
    found = next((m for n, m in text_encoder.named_modules() if n.endswith("language_model")), None)
    if found is None:
        raise ValueError(f"{type(text_encoder).__name__} has no language_model for the prompt stand-in")
    return found


def prompt_layout(family, refs: Sequence, ref_latents: Sequence[torch.Tensor], tokens: int):
    """(length, leading tokens dropped, the prompt's extra tensors) of an encoded prompt with ``tokens`` text tokens."""
    if "pad" in family.prompt_tensors:  # the references sit in the prompt as slots (their mask is on the host)
        from .standin21 import slot_mask21

        pad = slot_mask21([tuple(z.shape[-2:]) for z in ref_latents], tokens)
        return len(pad), 0, {"pad": pad}
    grids = [vision_grid(im.size) for im in refs]
    image_tokens = sum(t * h * w for t, h, w in grids) // 4  # 2x2 patch merge
    return TEMPLATE_TOKENS + image_tokens + tokens, TEMPLATE_TOKENS, {}


def vision_grid(size: tuple[int, int]) -> tuple[int, int, int]:
    """(t, h, w) patches of a reference resized to about PROCESSOR_PIXELS (multiples of 28, as Qwen2-VL's
    processor does)."""
    width, height = size
    scale = math.sqrt(PROCESSOR_PIXELS / (width * height))
    h = max(28, round(height * scale / 28) * 28)
    w = max(28, round(width * scale / 28) * 28)
    return 1, h // 14, w // 14


def encode_prompt_standin(text_encoder, family, tokens: int, refs: Sequence, ref_latents: Sequence[torch.Tensor],
                          device, dtype: torch.dtype, run: bool = True):
    """(the prompt's embedding ``[L, D]`` on ``device``, its extra tensors) of a ``tokens``-token prompt with
    ``refs``, from ``text_encoder``'s language model run over the whole encoded length (no grad). ``run=False``:
    the embedding of that shape without the language model's pass (whose transient an earlier pass showed)."""
    length, drop, extras = prompt_layout(family, refs, ref_latents, tokens)
    lm = language_model(text_encoder)
    with torch.no_grad():
        embeds = torch.empty(1, length, lm.config.hidden_size, device=device, dtype=dtype)
        if not run:
            return embeds[0, drop:], extras
        positions = torch.arange(length, device=device).view(1, 1, -1).expand(3, 1, -1)
        hidden = lm(inputs_embeds=embeds, position_ids=positions).last_hidden_state
    return hidden[0, drop:], extras


class StandinOps:
    """A family's ops (``models.family_ops``) with the prompt stand-in in place of ``encode_prompt``; the
    rest is the family's own. The prompt runs where the pipeline points (``pipe.device``, as DiffSynth's units
    send it) in the pipeline's dtype."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def encode_prompt(self, pipe, prompt, refs, ref_latents, multi_image, max_tokens):
        from ..models.prompts import check_prompt_length

        tokens = check_prompt_length(pipe, prompt, max_tokens)
        emb, extras = encode_prompt_standin(pipe.text_encoder, self._ops.family, tokens, refs, ref_latents,
                                            pipe.device, pipe.torch_dtype)
        return self._ops.join_prompt(emb, extras)


def build_encoders(fc, family, dtype: torch.dtype, device: str, preset=None):
    """The family's real text encoder and VAE built on the fake ``device`` in ``dtype`` (weights counted); a tiny
    preset's own (its builder module's ``tiny_encoders``)."""
    import importlib

    with fc.build(dtype, device), transformers_built_in(dtype):
        if preset is not None and preset.is_tiny:
            te, vae = importlib.import_module(preset.provider.partition(":")[0]).tiny_encoders()
        else:
            te, vae = family.component_type("text_encoder")(), family.component_type("vae")()
        # DiffSynth's loader casts every weight to the pipeline's dtype (here only the buffers transformers keeps
        # in fp32 are left to cast: the weights were built in ``dtype``)
        te, vae = te.to(dtype=dtype), vae.to(dtype=dtype)
    return te, vae


@contextlib.contextmanager
def transformers_built_in(dtype: torch.dtype) -> Iterator[None]:
    """transformers models built inside (their sub-models' ``_from_config``) take ``dtype`` instead of their
    config's ``torch_dtype``: Qwen-Image-Edit's Qwen2.5-VL config says float32, and each of its ~730 weights
    built in float32 on the fake device and then cast one by one to ``dtype`` costs seconds of host time for
    the same bf16 weights DiffSynth's loader ends with. A caller's own ``dtype=`` is kept."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["_from_config"]

    def from_config(cls, config, **kwargs):
        kwargs.setdefault("dtype", dtype)
        return original.__func__(cls, config, **kwargs)

    PreTrainedModel._from_config = classmethod(from_config)
    try:
        yield
    finally:
        PreTrainedModel._from_config = original


def build_vae(fc, family, dtype: torch.dtype, device: str, preset=None):
    """The family's real VAE alone, as :func:`build_encoders` builds it (a tiny preset's comes with its tiny text
    encoder, which costs nothing): for a step that decodes but never encodes."""
    if preset is not None and preset.is_tiny:
        return build_encoders(fc, family, dtype, device, preset)[1]
    with fc.build(dtype, device):
        return family.component_type("vae")().to(dtype=dtype)
