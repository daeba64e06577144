"""``--ema_decay D``: an exponential moving average of the trainable weights, in fp32.

After every optimizer step ``ema ← D·ema + (1 − D)·w`` for each trainable tensor (the weights the optimizer
updates; with a schedule-free optimizer that is its training point y). The average lives beside the weights on
their device, one copy per process: with DDP and ZeRO-2 every process holds the whole LoRA, so the copies
agree. ZeRO-3 is refused (the weights are partitioned; an average of a partition is not implemented).

It is registered with accelerate's checkpointing, so each checkpoint holds it and ``--resume`` continues it
exactly; the final average is written as ``lora_ema.safetensors`` beside ``lora.safetensors``, in the same
format. :meth:`LoraEMA.applied` swaps it into the module for validation (``--validate_with ema|both``).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator, Optional

import torch

log = logging.getLogger(__name__)

EMA_LORA_NAME = "lora_ema.safetensors"


class LoraEMA:
    def __init__(self, module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"--ema_decay {decay}: give a decay in (0, 1), e.g. 0.999, or 0 for no EMA")
        self.decay = float(decay)
        self.params = dict(module.trainable_named_parameters())
        self.shadow = {n: p.detach().float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        """One optimizer step's update of every tensor's average."""
        for name, p in self.params.items():
            self.shadow[name].mul_(self.decay).add_(p.detach().float(), alpha=1.0 - self.decay)

    # accelerate's checkpointing protocol (accelerator.register_for_checkpointing)
    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": {n: t.cpu() for n, t in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        if set(state["shadow"]) != set(self.shadow):
            raise ValueError("the checkpoint's EMA holds other tensors than this run trains; resume with the "
                             "checkpoint's LoRA settings")
        for name, t in state["shadow"].items():
            self.shadow[name].copy_(t)

    @contextlib.contextmanager
    def applied(self, module) -> Iterator[None]:
        """Inside: the module's trainable weights are the average (restored on exit)."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(self.shadow[name].to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(saved[name])

    def save(self, accelerator, module, output_dir: str | Path, metadata: Optional[dict] = None) -> Optional[Path]:
        """``lora_ema.safetensors`` (main process), in the format of ``lora.safetensors``."""
        from .checkpoint import save_lora_file

        path = Path(output_dir) / EMA_LORA_NAME
        if accelerator.is_main_process:
            state = {n: t.detach().cpu() for n, t in self.shadow.items()}
            save_lora_file(path, module, state, {**(metadata or {}), "weights": f"EMA (decay {self.decay:g})"})
            log.info("saved the EMA LoRA to %s (decay %g)", path, self.decay)
        accelerator.wait_for_everyone()
        return path


def build_ema(cfg, module, accelerator, ds_config: Optional[dict]) -> Optional[LoraEMA]:
    """The run's EMA (None without ``--ema_decay``), registered for checkpointing before any resume loads."""
    decay = cfg.train.ema_decay
    if not decay:
        return None
    if ds_config and ds_config.get("zero_optimization", {}).get("stage") == 3:
        raise ValueError("--ema_decay is refused under DeepSpeed ZeRO-3 (the weights are partitioned); use ZeRO-2 "
                         "or DDP")
    ema = LoraEMA(module, decay)
    accelerator.register_for_checkpointing(ema)
    return ema
