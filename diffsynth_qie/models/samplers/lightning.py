"""Few-step sampling with the Lightning LoRAs distilled for Qwen-Image(-Edit).

The Lightning LoRAs (ModelTC/Qwen-Image-Lightning; files published as
``lightx2v/Qwen-Image-Lightning`` and ``lightx2v/Qwen-Image-Edit-2511-Lightning``, e.g.
``Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16.safetensors``) were distilled for 4 or 8
steps at CFG 1 with the flow-match Euler schedule their example code sets up:
``base_shift = max_shift = ln 3`` ("shift=3 in distillation"), ``use_dynamic_shifting`` with
``time_shift_type = "exponential"``, ``shift_terminal = None``, 1000 training timesteps. With
``base_shift == max_shift`` the resolution-dependent shift is the constant ``mu = ln 3``, so

    σ_k = 3 t_k / (1 + 2 t_k),  t_k = 1 - k/N  (k = 0..N-1),  timestep_k = 1000 σ_k,

then σ = 0. DiffSynth ships this schedule as ``FlowMatchScheduler("Qwen-Image-Lightning")``;
:func:`lightning_scheduler` sets it up the way the default Qwen-Image one is. Their files
are plain LoRAs (``transformer_blocks.N.<module>.lora_down.weight`` / ``lora_up.weight`` /
``.alpha``, some with a ``diffusion_model.`` prefix), read by ``lora_format``.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Mapping, Optional

log = logging.getLogger(__name__)

SCHEDULERS = ("default", "lightning")
LIGHTNING_STEPS = (4, 8)
DEFAULT_LIGHTNING_STEPS = 8
_STEPS_IN_NAME = re.compile(r"(\d+)[-_ ]?steps?", re.IGNORECASE)


def lightning_scheduler(steps: int, latent_h: int, latent_w: int, strength: float = 1.0):
    """DiffSynth's Lightning scheduler, with the same resolution input as the default one."""
    from diffsynth.diffusion import FlowMatchScheduler

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if steps not in LIGHTNING_STEPS:
        log.warning("the Lightning LoRAs were distilled for %s steps; %d steps is untested",
                    " or ".join(map(str, LIGHTNING_STEPS)), steps)
    scheduler = FlowMatchScheduler("Qwen-Image-Lightning")
    height, width = latent_h * 8, latent_w * 8
    scheduler.set_timesteps(steps, denoising_strength=strength, dynamic_shift_len=(height // 16) * (width // 16))
    return scheduler


def is_lightning_lora(path: str | os.PathLike, metadata: dict | None = None) -> bool:
    """True when the file's name or its safetensors metadata says it is a Lightning LoRA."""
    if "lightning" in Path(path).name.lower():
        return True
    if metadata is None and str(path).endswith(".safetensors") and Path(path).is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                metadata = dict(f.metadata() or {})
        except Exception:  # an unreadable file is reported by the LoRA loader, with its name
            return False
    return any("lightning" in f"{k} {v}".lower() for k, v in (metadata or {}).items())


def lightning_steps(paths, headers: Optional[Mapping[str, Mapping[str, str]]] = None) -> int:
    """The step count a Lightning LoRA's name states (``...-4steps-...``), else 8 (``headers``: the files' metadata
    by path where the caller has read it already)."""
    for path in paths:
        if is_lightning_lora(path, (headers or {}).get(str(path))):
            m = _STEPS_IN_NAME.search(Path(path).name)
            if m and int(m.group(1)) in LIGHTNING_STEPS:
                return int(m.group(1))
    return DEFAULT_LIGHTNING_STEPS


def check_scheduler(name: str) -> str:
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler {name!r} is not one of {', '.join(SCHEDULERS)}")
    return name


def sampling_plan(scheduler: str, steps: int | None, cfg: float | None, lora_paths,
                  default_steps: int = 40, default_cfg: float = 4.0) -> tuple[str, int, float]:
    """(scheduler, steps, cfg) for an edit: ``auto`` picks ``lightning`` when a LoRA's name or
    metadata says Lightning; Lightning defaults to the LoRA's step count and CFG 1."""
    lora_paths = [str(p) for p in lora_paths]
    if scheduler == "auto":
        found = [p for p in lora_paths if is_lightning_lora(p)]
        scheduler = "lightning" if found else "default"
        if found:
            log.info("Lightning LoRA %s: using the Lightning scheduler (--scheduler default to override)", found[0])
    check_scheduler(scheduler)
    if scheduler == "lightning":
        steps = lightning_steps(lora_paths) if steps is None else steps
        if cfg is not None and cfg != 1.0:
            log.info("Lightning LoRAs were distilled for CFG 1: using cfg 1 instead of %g", cfg)
        return scheduler, int(steps), 1.0
    return scheduler, int(default_steps if steps is None else steps), float(default_cfg if cfg is None else cfg)
