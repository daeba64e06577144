"""The host-side stand-ins of an edit on the fake CUDA device (``inference/verify.py``), for every model family.

- **Prompt encoding.** The Qwen-VL prompt encoders find the image tokens and build their RoPE positions by
  reading token ids on the host (Qwen2.5-VL's ``get_rope_index``, the placeholder mask; Qwen3-VL's likewise);
  a fake device has no values to read. The stand-in runs the family's own language model over the same
  number of tokens, which is what holds memory: the template, the image tokens of each reference (Qwen-Image-Edit:
  at the processor's size; Qwen-Image-2.1: one slot per 2x2 latents, laid out by ``memory.standin21.slot_mask21``
  for families whose prompt carries the references' slot mask, ``"pad"`` in ``Family.prompt_tensors``), and the
  prompt. The vision tower's own activations are left out (its weights are counted; its working set is a few MB
  beside the language model's).
- **Token counts.** No vocabulary on a fake run: a prompt counts ``prompt_tokens`` tokens (an empty one none).
- **The finished image's host copy.** Converting decoded pixels to a PIL image reads them on the host by design;
  the decode runs on the fake device and a blank image of the right size stands for the copy.
- **The family's DiT bookkeeping.** A family whose DiT reads token masks on the host names a stand-in context
  (``Family.fake_standin``, a dotted path; Qwen-Image-2.1's is ``memory.standin21.host_bookkeeping21``), entered
  inside the fake device by :func:`family_standin`.
"""
from __future__ import annotations

import contextlib
import math
from typing import Sequence

import torch
from PIL import Image

from .editor import Editor

DEVICE = "cuda:0"
TEMPLATE_TOKENS = 64  # DiffSynth's edit prompt template (drop_idx) + "Picture N:" markers, rounded up
PROCESSOR_PIXELS = 384 * 384  # DiffSynth resizes each reference to about this area for the Qwen2.5-VL encoder


def family_standin(family):
    """The family's fake-device stand-in context (``Family.fake_standin``, a dotted path), or a no-op."""
    dotted = getattr(family, "fake_standin", "") or ""
    if not dotted:
        return contextlib.nullcontext()
    import importlib

    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)()


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


class FakeEditor(Editor):
    """The editor with the host-side stand-ins of the module docstring."""

    def _encode_prompt(self, prompt, refs, ref_latents, max_tokens):
        tokens = len(self.pipe.tokenizer(prompt)["input_ids"])
        length, drop, extras = prompt_layout(self.family, refs, ref_latents, tokens)
        lm = language_model(self.pipe.text_encoder)
        with self._running("text_encoder"), torch.no_grad():
            embeds = torch.empty(1, length, lm.config.hidden_size, device=DEVICE, dtype=self.dtype)
            positions = torch.arange(length, device=DEVICE).view(1, 1, -1).expand(3, 1, -1)
            hidden = lm(inputs_embeds=embeds, position_ids=positions).last_hidden_state
        return self.ops.join_prompt(hidden[0, drop:], extras)

    def _swap_blocks(self, blocks_to_swap):
        """The real swapper, its hooks and its CUDA transport, on the fake device's modelled streams."""
        from ..memory.block_swap import BlockSwapper

        if not blocks_to_swap:
            return None
        return BlockSwapper(self.pipe.dit, blocks_to_swap, DEVICE).install()

    def _decode(self, latents):
        super_decode = self.pipe.vae_output_to_image
        self.pipe.vae_output_to_image = lambda image: Image.new("RGB", (image.shape[-1], image.shape[-2]))
        try:
            return super()._decode(latents)
        finally:
            self.pipe.vae_output_to_image = super_decode


def prompt_layout(family, refs: Sequence[Image.Image], ref_latents: Sequence[torch.Tensor], tokens: int):
    """(length, leading tokens dropped, the prompt's extra tensors) of an encoded prompt with ``tokens`` text tokens."""
    if "pad" in family.prompt_tensors:  # the references sit in the prompt as slots (their mask is on the host)
        from ..memory.standin21 import slot_mask21

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


def attach_loras(dit, targets: Sequence[str], ranks: Sequence[int], scales: Sequence[float], dtype) -> int:
    """One set of unmerged LoRA branches per rank on ``targets``, as ``qie edit --lora`` (repeated) attaches them
    (``lora.branch.attach``, the function ``LoraManager`` calls); returns how many branches."""
    from ..lora.branch import attach
    from ..lora.state import LoraModule

    count = 0
    for rank, scale in zip(ranks, scales):
        for name, module in dit.named_modules():
            if hasattr(module, "in_features") and any(name == t or name.endswith("." + t) for t in targets):
                a = torch.empty(rank, module.in_features, device=DEVICE, dtype=dtype)
                b = torch.empty(module.out_features, rank, device=DEVICE, dtype=dtype)
                attach(module, LoraModule(a, b), scale)
                count += 1
    return count


def lora_rank_of(path, default: int = 32) -> int:
    """A LoRA file's rank from its header (no tensor is read): the smaller side of its first down/A matrix."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if any(k in key for k in ("lora_A", "lora_down", "lora.down")):
                    shape = f.get_slice(key).get_shape()
                    if len(shape) == 2:
                        return int(min(shape))
    except Exception:  # not a safetensors file: the LoRA loader names it when the real run reads it
        pass
    return default
