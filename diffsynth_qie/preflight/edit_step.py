"""One real edit at full size on a fake CUDA device (``qie plan --task edit --verify``, ``qie edit``'s preflight),
for every model family.

It runs :meth:`Editor.edit` with the preset's real DiT, the family's real text encoder (its language model) and
real VAE, all built on the fake device (``fakegpu/device.py``) through the family seam (``Family`` and
``family_ops``; no family is named here): the VAE encoding of the references at their real size, the denoising
steps with true CFG (one batch, or two passes when the prompts' lengths differ, as on a GPU), the edit strength's
part-way start, the Lightning schedule, the step cache (``--cache``: the fake device answers its decisions with
"reuse" wherever allowed, ``fakegpu/device.py``), the mask's latent and pixel blends, LBM, the unmerged branches
of every LoRA (one set per ``--lora``), the FP8 base, the block swapper, ``--compile`` (``compile_blocks`` with the
eager backend: dynamo compiles the blocks, and the compiled graphs run on the fake device, checked and
counted), Qwen-Image-2.1's prefix KV cache, and the VAE decode. The host-side stand-ins
(prompt token bookkeeping, the finished image's host copy, a family's DiT bookkeeping) are in
``edit_standins.py``; ``qie edit``'s preflight and its memory verdict in ``edit.py``.
"""
from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from PIL import Image

from ..fakegpu.device import FakeCuda
from ..inference.editor import EditRequest
from .edit_again import edit_again, lora_pairs, set_loras
from .edit_standins import DEVICE, FakeEditor, FakeTokenizer, attach_loras, family_standin

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EditLoad:
    """How ``qie edit`` loads the model: every load option the fake run repeats."""

    fp8_base: bool = False
    fp8_compute: bool = False                # the FP8 layers multiply in FP8 (torch._scaled_mm); implies fp8_base
    blocks_to_swap: int = 0
    lora_ranks: Sequence[int] = ()           # one per --lora, in order
    lora_paths: Sequence[str] = ()           # the --lora files themselves: attached as qie edit attaches them
    lora_scales: Sequence[float] = ()        # one per --lora (default 1.0 each)
    lora_merge: bool = False                 # merged LoRAs hold no device memory of their own
    compile: bool = False                    # torch.compile of each block (the eager backend here)
    zero_cond_t: Optional[bool] = None       # None: the preset's
    dtype: Optional[torch.dtype] = None      # None: bf16, as ``--dtype auto`` on a GPU
    one_gpu: bool = True                     # every component on one GPU (else the memory verdict is not judged:
                                             # --cpu_offload, --device_map and --*_device place them elsewhere)


@dataclass
class EditVerifyReport:
    weights: int = 0          # text encoder + DiT + VAE (+ LoRA branches) on the device
    encode_peak: int = 0      # prompt + reference encoding
    denoise_peak: int = 0     # the denoising steps (CFG batch; 2.1: its prefix KV caches)
    decode_peak: int = 0
    seconds: float = 0.0
    blocks: int = 0           # DiT blocks run
    block_bytes: int = 0      # one resident block's weights and LoRA branches (to scale a few blocks up)
    kv_cache: int = 0         # prefix KV caches held after the denoising steps (Qwen-Image-2.1)
    lora_branches: int = 0    # unmerged LoRA branches attached (all LoRAs together)
    edits: int = 0            # edits run in the one session (the preflight: two, a LoRA switch between them)
    compiled_blocks: int = 0  # blocks run through torch.compile
    compile_counts: dict = field(default_factory=dict)  # graphs and recompiles of the compiled blocks
    costs: object = None      # with costs=True: the counted kernels (fakegpu.costs.Profile), by phase
    cache_calls: int = 0      # DiT calls made with a step cache (--cache)
    cache_skipped: int = 0    # of them, calls that reused the cached residual (the fake device reuses wherever allowed)

    @property
    def peak(self) -> int:
        return max(self.encode_peak, self.denoise_peak, self.decode_peak)

    def phases(self) -> dict[str, int]:
        return {"encode": self.encode_peak, "denoise": self.denoise_peak, "decode": self.decode_peak}


def verify_edit(preset, resolution: int = 1024, ref_images: int = 1, prompt_tokens: int = 300, steps: int = 2,
                cfg: float = 4.0, lora_rank: int = 0, fp8_base: bool = False, blocks_to_swap: int = 0,
                lbm_steps: Optional[int] = None, num_layers: Optional[int] = None, *, kv_cache: bool = True,
                cache: str = "off", cache_method: Optional[str] = None, cache_threshold: Optional[float] = None,
                request: Optional[EditRequest] = None, load: Optional[EditLoad] = None,
                costs: bool = False, again: bool = False, prompt_pass: bool = True) -> EditVerifyReport:
    """Run one edit on the fake device; the peak of live device bytes per phase. ``steps`` denoising steps
    (every step has the same peak; 2 shows it), ``num_layers`` a shallower DiT (the preflight, tests).

    ``request`` / ``load``: the user's whole edit and load options (``qie edit``'s preflight); without them, a
    ``resolution``² edit of ``ref_images`` grey references with the other arguments (``qie plan --verify``).
    ``costs``: count each kernel's cost (``report.costs``, sections encode, denoise (the first step),
    denoise_next (the steps after it) and decode). ``again``: the UI's loop, after the edit: the LoRAs switched
    to other files (copies of the same) and a second edit with the next seed, whose device memory still held
    after it must not exceed the first's (``edit_again.py``). ``prompt_pass=False``: the prompt's embedding is
    made without the language model's pass (the time prediction's shallower run: the deeper run counts the
    encode section, which is the same at every depth)."""
    if request is None:
        image = Image.new("RGB", (resolution, resolution), (128, 128, 128))
        request = EditRequest(images=[image] * max(1, ref_images), prompt="edit", steps=steps, cfg=cfg,
                              height=resolution, width=resolution, lbm_steps=lbm_steps, max_pixels=resolution ** 2,
                              ref_max_pixels=resolution ** 2, max_prompt_tokens=None, kv_cache=kv_cache, cache=cache,
                              cache_method=cache_method, cache_threshold=cache_threshold)
    if load is None:
        load = EditLoad(fp8_base=fp8_base, blocks_to_swap=blocks_to_swap, lora_ranks=(lora_rank,) if lora_rank else ())
    with tempfile.TemporaryDirectory(prefix="qie-preflight-") as tmp:
        return _run(preset, dataclasses.replace(request, progress=None), load, prompt_tokens, num_layers, costs,
                    again, Path(tmp), prompt_pass)


def _run(preset, request: EditRequest, load: EditLoad, prompt_tokens: int,
         num_layers: Optional[int], costs: bool, again: bool, tmp: Path, prompt_pass: bool) -> EditVerifyReport:
    from ..memory.census import build_dit
    from ..fakegpu.standin_vl import build_encoders
    from ..models.presets import family_of
    from ..utils.logging import library_warnings_once

    library_warnings_once()
    report = EditVerifyReport()
    t0 = time.perf_counter()
    family, dtype = family_of(preset), load.dtype or torch.bfloat16
    with FakeCuda(costs=costs) as fc, family_standin(family):
        te, vae = build_encoders(fc, family, dtype, DEVICE, preset)
        with fc.build(dtype, DEVICE):  # (a real load goes through the host; the steps after it are what counts)
            dit = build_dit(preset, num_layers).requires_grad_(False)
        pipe = family.pipeline_type()(device=DEVICE, torch_dtype=dtype)
        pipe.text_encoder, pipe.dit, pipe.vae = te, dit, vae
        pipe.tokenizer = FakeTokenizer(prompt_tokens)
        pipe.qie_preset = preset
        if load.fp8_base or load.fp8_compute:
            from ..memory.fp8 import quantize_linears

            quantize_linears(pipe.dit, device=DEVICE)  # (swapped blocks: the swapper evicts them below)
        if load.fp8_compute:
            from ..memory.fp8_compute import enable_fp8_compute

            enable_fp8_compute(pipe.dit)
        fc.register(te), fc.register(vae), fc.register(pipe.dit)  # before the swapper evicts blocks
        editor = FakeEditor(pipe, blocks_to_swap=load.blocks_to_swap, zero_cond_t=load.zero_cond_t,
                            lora_merge=load.lora_merge)
        editor.language_model_runs = prompt_pass
        if load.compile:  # (qie edit compiles the blocks before it attaches the LoRAs)
            from ..models.load.compile import compile_blocks

            report.compiled_blocks = compile_blocks(pipe.dit, backend="eager")
        loras = lora_pairs(load, len(pipe.dit.transformer_blocks), tmp / "first")
        if loras:  # the user's files, read on the host and attached by the LoRA manager, as qie edit does
            report.lora_branches = set_loras(editor, loras)
        elif load.lora_ranks and not load.lora_merge:
            scales = list(load.lora_scales) or [1.0] * len(load.lora_ranks)
            report.lora_branches = attach_loras(pipe.dit, preset.lora_target_modules, load.lora_ranks, scales, dtype)
        report.weights = fc.current_bytes
        report.blocks = len(pipe.dit.transformer_blocks)
        report.block_bytes = _resident_bytes(pipe.dit.transformer_blocks[0])
        marks: dict = {}
        if costs and load.compile:  # inductor fuses the blocks' elementwise work (fakegpu/fusion.py)
            fc.costs.fuse(("denoise", "denoise_next"))
        if costs:  # the first denoising step (a prefix KV cache is filled there) apart from the ones after it
            request = dataclasses.replace(request, progress=lambda step, total: _section(fc, "denoise_next"))
        with fc.phase("edit"):
            _run_phased(editor, request, fc, marks)
        report.edits = 1
        if again:
            report.edits = edit_again(editor, request, loras, fc, tmp / "switched")
        report.encode_peak, report.denoise_peak, report.decode_peak = (marks.get(k, 0) for k in
                                                                       ("encode", "denoise", "decode"))
        report.kv_cache = marks.get("kv_cache", 0)
        report.cache_calls, report.cache_skipped = marks.get("cache", (0, 0))
        report.costs = fc.costs.profile if fc.costs is not None else None
        if load.compile:
            from ..models.load.compile import log_compile_counts

            report.compile_counts = log_compile_counts(pipe.dit, "in the edit on the fake device")
        del editor, pipe, te, vae, dit, marks
        if load.compile:
            torch._dynamo.reset()  # the compiled graphs hold fake tensors
    report.seconds = time.perf_counter() - t0
    return report


def _resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (LoRA branches, FP8 scales included), each storage once."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _run_phased(editor: FakeEditor, request: EditRequest, fc: FakeCuda, marks: dict) -> None:
    """``editor.edit(request)`` with the device peak recorded per phase (encode, denoise, decode) and the prefix
    KV caches the conditioning holds after the denoising steps (families with a prefix cache)."""
    from ..fakegpu.standin21 import kv_cache_bytes

    memory = fc.memory
    originals = {name: getattr(editor, name) for name in ("_encode_prompt", "_encode_images", "_white", "_sample",
                                                          "_decode")}
    phase_of = {"_encode_prompt": "encode", "_encode_images": "encode", "_white": "encode", "_sample": "denoise",
                "_decode": "decode"}

    def wrap(name):
        def run(*args, **kwargs):
            memory.reset_peak()
            _section(fc, phase_of[name])
            try:
                return originals[name](*args, **kwargs)
            finally:
                key = phase_of[name]
                marks[key] = max(marks.get(key, 0), memory.peak)
                if name == "_sample":
                    marks["kv_cache"] = kv_cache_bytes(getattr(args[1], "_caches", {}).values())
        return run

    for name in originals:
        setattr(editor, name, wrap(name))
    stats = editor.edit(request).cache
    if stats is not None:
        marks["cache"] = (stats.calls, stats.skipped)


def _section(fc: FakeCuda, name: str) -> None:
    if fc.costs is not None:
        fc.costs.section = name
