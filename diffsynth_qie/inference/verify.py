"""One real edit at full size on a fake CUDA device (``qie plan --task edit --verify``, ``qie edit``'s preflight).

It runs :meth:`Editor.edit` with the preset's real DiT, the real Qwen2.5-VL-7B text encoder and the real VAE,
all built on the fake device (``memory/fake_device.py``) in bf16: VAE encoding of the references at their
real size, the denoising steps with true CFG, the LoRA branches (rank ``lora_rank`` on the preset's targets,
unmerged, as ``qie edit`` runs them by default), the FP8 base as configured, and the VAE decode.

Two stand-ins, both host-side, and why:

- **Prompt encoding.** Qwen2.5-VL's own code finds the image tokens and builds its 3-D RoPE positions by
  reading token ids on the host (``get_rope_index``, the placeholder mask); a fake device has no values to
  read. The stand-in runs the same language model over the same number of tokens (template + image tokens
  of each reference at the processor's size + the prompt), which is what holds memory. The vision tower's
  own activations (about 730 patches per reference, width 1280) are left out: its weights are counted, and
  its working set is a few MB beside the language model's.
- **The finished image's host copy.** Converting the decoded pixels to a PIL image reads them on the host by
  design; the decode itself runs on the fake device and a blank image of the right size stands for the copy.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
from PIL import Image

from ..memory.fake_device import FakeCuda, StandInTransport
from .editor import EditRequest, Editor

log = logging.getLogger(__name__)

DEVICE = "cuda:0"
TEMPLATE_TOKENS = 64  # DiffSynth's edit prompt template (drop_idx) + "Picture N:" markers, rounded up
PROCESSOR_PIXELS = 384 * 384  # DiffSynth resizes each reference to about this area for the text encoder


@dataclass
class EditVerifyReport:
    weights: int = 0          # text encoder + DiT + VAE (+ LoRA branches) on the device
    encode_peak: int = 0      # prompt + reference encoding
    denoise_peak: int = 0     # the denoising steps (CFG batch)
    decode_peak: int = 0
    seconds: float = 0.0

    @property
    def peak(self) -> int:
        return max(self.encode_peak, self.denoise_peak, self.decode_peak)


class _FakeTokenizer:
    """Counts tokens as ``prompt_tokens`` (no vocabulary on a fake run; ``check_prompt_length`` asks)."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [0] * self.prompt_tokens}


class _FakeEditor(Editor):
    """The editor with the two host-side stand-ins of the module docstring."""

    prompt_tokens = 300

    def _encode_prompt(self, prompt, refs, ref_latents, max_tokens):
        te = self.pipe.text_encoder
        patches = [_vision_grid(im.size) for im in refs]
        image_tokens = sum(t * h * w for t, h, w in patches) // 4  # 2x2 patch merge
        length = TEMPLATE_TOKENS + image_tokens + (self.prompt_tokens if prompt else 0)
        with torch.no_grad():
            embeds = torch.empty(1, length, te.model.config.text_config.hidden_size, device=DEVICE, dtype=self.dtype)
            positions = torch.arange(length, device=DEVICE).view(1, 1, -1).expand(3, 1, -1)
            hidden = te.model.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
        return hidden[0, TEMPLATE_TOKENS:]

    def _swap_blocks(self, blocks_to_swap):
        """The real swapper and its hooks; copies through the fake device's stand-in for a CUDA stream."""
        from ..memory.block_swap import BlockSwapper

        if not blocks_to_swap:
            return None
        return BlockSwapper(self.pipe.dit, blocks_to_swap, DEVICE, transport=StandInTransport(DEVICE, "cpu")).install()

    def _decode(self, latents):
        super_decode = self.pipe.vae_output_to_image
        self.pipe.vae_output_to_image = lambda image: Image.new("RGB", (image.shape[-1], image.shape[-2]))
        try:
            return super()._decode(latents)
        finally:
            self.pipe.vae_output_to_image = super_decode


def _vision_grid(size: tuple[int, int]) -> tuple[int, int, int]:
    """(t, h, w) patches of a reference resized to about PROCESSOR_PIXELS (multiples of 28, as Qwen2-VL's
    processor does)."""
    width, height = size
    scale = math.sqrt(PROCESSOR_PIXELS / (width * height))
    h = max(28, round(height * scale / 28) * 28)
    w = max(28, round(width * scale / 28) * 28)
    return 1, h // 14, w // 14


def verify_edit(preset, resolution: int = 1024, ref_images: int = 1, prompt_tokens: int = 300, steps: int = 2,
                cfg: float = 4.0, lora_rank: int = 0, fp8_base: bool = False, blocks_to_swap: int = 0,
                lbm_steps: Optional[int] = None, num_layers: Optional[int] = None) -> EditVerifyReport:
    """Run one edit on the fake device; the peak of live device bytes per phase. ``steps`` denoising steps
    (every step has the same peak; 2 shows it), ``num_layers`` a shallower DiT (tests)."""
    from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder
    from diffsynth.models.qwen_image_vae import QwenImageVAE
    from diffsynth.pipelines.qwen_image import QwenImagePipeline

    from ..memory.census import build_dit
    from ..utils.logging import library_warnings_once

    library_warnings_once()
    report = EditVerifyReport()
    t0 = time.perf_counter()
    dtype = torch.bfloat16
    with FakeCuda() as fc:
        with fc.build(dtype, DEVICE):
            # DiffSynth's loader casts every weight to the pipeline's dtype (transformers builds some in fp32)
            te, vae = QwenImageTextEncoder().to(dtype=dtype), QwenImageVAE().to(dtype=dtype)
        with fc.build(dtype, DEVICE):  # (a real load goes through the host; the steps after it are what counts)
            dit = build_dit(preset, num_layers)
        pipe = QwenImagePipeline(device=DEVICE, torch_dtype=dtype)
        pipe.text_encoder, pipe.dit, pipe.vae = te, dit.requires_grad_(False), vae
        pipe.tokenizer = _FakeTokenizer(prompt_tokens)
        pipe.qie_preset = preset
        if fp8_base:
            from ..memory.fp8 import quantize_linears

            quantize_linears(pipe.dit, device=DEVICE)  # (swapped blocks: the swapper evicts them below)
        fc.register(te), fc.register(vae), fc.register(pipe.dit)  # before the swapper evicts blocks
        editor = _FakeEditor(pipe, blocks_to_swap=blocks_to_swap)
        editor.prompt_tokens = prompt_tokens
        if lora_rank:
            _attach_lora(editor, preset, lora_rank)
        report.weights = fc.current_bytes
        image = Image.new("RGB", (resolution, resolution), (128, 128, 128))
        request = EditRequest(images=[image] * max(1, ref_images), prompt="edit", steps=steps, cfg=cfg,
                              height=resolution, width=resolution, lbm_steps=lbm_steps, max_pixels=resolution ** 2,
                              ref_max_pixels=resolution ** 2, max_prompt_tokens=None)
        marks = {}
        with fc.phase("edit"):
            _run_phased(editor, request, fc, marks)
        report.encode_peak, report.denoise_peak, report.decode_peak = (marks.get(k, 0) for k in
                                                                       ("encode", "denoise", "decode"))
        del editor, pipe, te, vae, dit
    report.seconds = time.perf_counter() - t0
    return report


def _run_phased(editor: _FakeEditor, request: EditRequest, fc: FakeCuda, marks: dict) -> None:
    """``editor.edit(request)`` with the device peak recorded per phase (encode, denoise, decode)."""
    memory = fc.memory
    originals = {name: getattr(editor, name) for name in ("_encode_prompt", "_encode_images", "_sample", "_decode")}
    phase_of = {"_encode_prompt": "encode", "_encode_images": "encode", "_sample": "denoise", "_decode": "decode"}

    def wrap(name):
        def run(*args, **kwargs):
            memory.reset_peak()
            try:
                return originals[name](*args, **kwargs)
            finally:
                key = phase_of[name]
                marks[key] = max(marks.get(key, 0), memory.peak)
        return run

    for name in originals:
        setattr(editor, name, wrap(name))
    editor.edit(request)


def _attach_lora(editor: Editor, preset, rank: int) -> None:
    """Unmerged LoRA branches of ``rank`` on the preset's targets, as ``qie edit --lora`` attaches them."""
    from ..lora.branch import attach
    from ..lora.state import LoraModule

    targets = preset.lora_target_modules
    for name, module in editor.pipe.dit.named_modules():
        if hasattr(module, "in_features") and any(name == t or name.endswith("." + t) for t in targets):
            a = torch.empty(rank, module.in_features, device=DEVICE, dtype=torch.bfloat16)
            b = torch.empty(module.out_features, rank, device=DEVICE, dtype=torch.bfloat16)
            attach(module, LoraModule(a, b), 1.0)


PREFLIGHT_BLOCKS = 2


def preflight(model: str, images: int = 1, fp8_base: bool = False, blocks_to_swap: int = 0, lora_rank: int = 0,
              lbm_steps: Optional[int] = None, cfg: Optional[float] = None) -> EditVerifyReport:
    """``qie edit``'s check before a real preset loads: one edit with these options on a
    :data:`PREFLIGHT_BLOCKS`-block DiT at full width on the fake device; a device/dtype mismatch or a host
    read inside the sampling loop raises ``ValueError`` in seconds instead of after the load."""
    from ..memory.fake_device import FakeRunError
    from ..models.presets import get_preset

    preset = get_preset(model)
    try:
        report = verify_edit(preset, resolution=512, ref_images=images, steps=1, cfg=4.0 if cfg is None else cfg,
                             lora_rank=lora_rank, fp8_base=fp8_base,
                             blocks_to_swap=min(blocks_to_swap, 1), lbm_steps=lbm_steps,
                             num_layers=PREFLIGHT_BLOCKS)
    except FakeRunError as e:
        raise ValueError(f"preflight (one edit on a fake CUDA device, before loading {preset.name}): {e}; "
                         "pass --no_preflight to skip the check") from None
    log.info("preflight: one edit of %s (full width, %d blocks) on a fake CUDA device passed in %.1f s", preset.name,
             PREFLIGHT_BLOCKS, report.seconds)
    return report
