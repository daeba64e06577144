"""``qie edit``'s preflight: the user's whole edit on a fake CUDA device before a real preset loads, and its
memory verdict.

The edit runs as ``qie edit`` would run it (``edit_step.verify_edit`` with the user's :class:`EditRequest` and
:class:`~.edit_step.EditLoad`: references and mask at their real sizes, strength, schedule, CFG, LBM, FP8, block
swapping, ``--compile``, and every ``--lora`` file read on the host and attached by the LoRA manager) on a DiT of
:data:`PREFLIGHT_BLOCKS` full-width blocks, then again as the UI's loop runs it: the LoRAs switched to other files
and a second edit with the next seed (``edit_again.py``). A device or dtype mismatch, a host read inside the
sampling loop, a LoRA branch off its layer's device, or device memory still held after the second edit beyond
the first's, raises ``ValueError`` naming our file:line in seconds instead of after the load. Every block runs
the same code and holds the same, so the peak of the whole DiT is the run's
peak plus the resident blocks it did not build (their weights and LoRA branches, and their share of a prefix KV
cache); the verdict (``fakegpu/verdict.py``) judges that scaled peak against the GPU and says it was scaled.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

from PIL import Image

from ..fakegpu.verdict import MemoryVerdict, check_memory, gpu_bytes_of
from ..inference.editor import EditRequest
from .edit_step import EditLoad, EditVerifyReport, verify_edit

log = logging.getLogger(__name__)

PREFLIGHT_BLOCKS = 2
CHARS_PER_TOKEN = 3  # a prompt's tokens, estimated without the tokenizer (Qwen's BPE: about 4 for English)


def estimated_tokens(request: EditRequest) -> int:
    """The longer prompt's tokens, estimated from its UTF-8 length, within ``max_prompt_tokens``."""
    longest = max(len(request.prompt.encode()), len(request.negative_prompt.encode()))
    tokens = max(1, math.ceil(longest / CHARS_PER_TOKEN))
    return tokens if request.max_prompt_tokens is None else min(tokens, request.max_prompt_tokens)


def preflight(model: str, request: Optional[EditRequest] = None, load: Optional[EditLoad] = None,
              gpu_memory_gb: Optional[float] = None) -> EditVerifyReport:
    """Run ``request`` with ``load`` on a :data:`PREFLIGHT_BLOCKS`-block DiT on the fake device and judge its peak,
    scaled to the whole DiT, against ``gpu_memory_gb`` (None: the visible GPU; not judged without one). Raises
    ``ValueError`` (one line) on a fake-run error or a peak that does not fit."""
    from ..fakegpu.device import FakeRunError
    from ..models.presets import get_preset

    preset = get_preset(model)
    load = load or EditLoad()
    gpu_bytes = gpu_bytes_of(gpu_memory_gb) if load.one_gpu else None  # (outside the fake device)
    if request is None:
        image = Image.new("RGB", (512, 512), (128, 128, 128))
        request = EditRequest(images=[image], prompt="edit", steps=1, height=512, width=512)
    swapped = min(load.blocks_to_swap, PREFLIGHT_BLOCKS - 1)  # the real swapper on one of the blocks run
    run_preset, steps = _steps_run(preset, request)
    try:
        report = verify_edit(run_preset, prompt_tokens=estimated_tokens(request), num_layers=PREFLIGHT_BLOCKS,
                             request=dataclasses.replace(request, steps=steps),
                             load=dataclasses.replace(load, blocks_to_swap=swapped), again=True)
    except FakeRunError as e:
        raise ValueError(f"preflight (two edits on a fake CUDA device, before loading {preset.name}): {e}; "
                         "pass --no_preflight to skip the check") from None
    line = check_memory(edit_verdict(report, full_blocks(preset), load.blocks_to_swap, swapped, gpu_bytes))
    log.info("preflight: %s of %s (full width, %d blocks) on a fake CUDA device passed in %.1f s; %s%s",
             "two edits (a LoRA switch between them)" if load.lora_paths else "two edits", preset.name,
             PREFLIGHT_BLOCKS, report.seconds, line,
             "" if load.one_gpu else " (memory not judged: the components are placed on several devices)")
    return report


def _steps_run(preset, request: EditRequest):
    """(preset, steps) to run: every step runs the same code, and two show what the second reuses (a prefix KV
    cache). A fixed grid (``Preset.sigmas``) runs its first two sigmas (a step count it refuses stays refused);
    the Lightning schedule keeps its 4 or 8 steps."""
    steps = request.steps
    if steps is None or steps <= 2 or request.scheduler == "lightning":
        return preset, steps
    if preset.sigmas:
        if steps != len(preset.sigmas):
            return preset, steps
        return dataclasses.replace(preset, sigmas=tuple(preset.sigmas[:2])), 2
    return preset, 2


def full_blocks(preset) -> int:
    """The preset's DiT depth (counted on the meta device)."""
    from ..memory.census import preset_census

    return preset_census(preset.name, with_encoders=False).num_layers


def edit_verdict(report: EditVerifyReport, blocks: int, blocks_to_swap: int, swapped_run: int,
                 gpu_bytes: Optional[int]) -> MemoryVerdict:
    """The memory verdict of a ``report.blocks``-block edit scaled to a ``blocks``-block DiT with
    ``blocks_to_swap`` blocks in host memory (``swapped_run`` of the run's were)."""
    missing = max(0, (blocks - blocks_to_swap) - (report.blocks - swapped_run))  # resident blocks not built
    kv_per_block = report.kv_cache // max(1, report.blocks)
    extra = {"encode": missing * report.block_bytes,
             "denoise": missing * report.block_bytes + (blocks - report.blocks) * kv_per_block,
             "decode": missing * report.block_bytes + (blocks - report.blocks) * kv_per_block}
    scaled = {phase: peak + extra[phase] for phase, peak in report.phases().items()}
    phase = max(scaled, key=scaled.get)
    dit = (blocks - blocks_to_swap) * report.block_bytes
    kv = blocks * kv_per_block
    holders = sorted([("DiT blocks (resident)", dit), ("prefix KV cache", kv),
                      ("text encoder, VAE and the DiT's other weights",
                       report.weights - (report.blocks - swapped_run) * report.block_bytes),
                      ("working set", scaled[phase] - dit - kv - report.weights
                       + (report.blocks - swapped_run) * report.block_bytes)],
                     key=lambda h: -h[1])
    return MemoryVerdict(phase=f"edit ({phase})", peak_bytes=scaled[phase], gpu_bytes=gpu_bytes,
                         holders=[h for h in holders if h[1] > 0],
                         scaled=f"{report.blocks} of {blocks} blocks run, scaled to {blocks}")
