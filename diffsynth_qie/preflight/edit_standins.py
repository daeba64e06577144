"""The host-side stand-ins of an edit on the fake CUDA device (``preflight/edit_step.py``), for every model family.

- **Prompt encoding and token counts** (Qwen-VL's host bookkeeping): ``fakegpu/standin_vl.py``, shared with the
  training check's on-the-fly encode.
- **The finished image's host copy.** Converting decoded pixels to a PIL image reads them on the host by design;
  the decode runs on the fake device and a blank image of the right size stands for the copy.
- **The family's DiT bookkeeping.** A family whose DiT reads token masks on the host names a stand-in context
  (``Family.fake_standin``, a dotted path; Qwen-Image-2.1's is ``fakegpu.standin21.host_bookkeeping21``), entered
  inside the fake device by :func:`family_standin`.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from PIL import Image

from ..fakegpu.standin_vl import FakeTokenizer, encode_prompt_standin  # noqa: F401 (FakeTokenizer: public here)
from ..inference.editor import Editor

DEVICE = "cuda:0"


def family_standin(family):
    """The family's fake-device stand-in context (``Family.fake_standin``, a dotted path), or a no-op."""
    dotted = getattr(family, "fake_standin", "") or ""
    if not dotted:
        return contextlib.nullcontext()
    import importlib

    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)()


class FakeEditor(Editor):
    """The editor with the host-side stand-ins of the module docstring."""

    language_model_runs = True  # False: the prompt stand-in makes its embedding without the language model's pass

    def _encode_prompt(self, prompt, refs, ref_latents, max_tokens):
        tokens = len(self.pipe.tokenizer(prompt)["input_ids"])
        with self._running("text_encoder"):
            emb, extras = encode_prompt_standin(self.pipe.text_encoder, self.family, tokens, refs, ref_latents,
                                                DEVICE, self.dtype, run=self.language_model_runs)
        return self.ops.join_prompt(emb, extras)

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
