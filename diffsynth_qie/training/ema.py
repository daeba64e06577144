"""``--ema_decay D``: an exponential moving average of the trainable weights, in fp32.

After every optimizer step ``ema ← D·ema + (1 − D)·w`` for each trainable tensor (the weights the optimizer
updates; with a schedule-free optimizer that is its training point y). The average lives beside the weights on
their device and is sharded as they are: with DDP and ZeRO-2 every process holds the whole LoRA, so each keeps
the whole average (the copies agree); under ZeRO-3 each process averages only its own partition of every
tensor (``param.ds_tensor``, flat and padded), and the whole average is assembled only to save it.

It is registered with accelerate's checkpointing, so each checkpoint holds it (whole, so a resume on another
number of processes re-partitions it) and ``--resume`` continues it exactly; the final average is written as
``lora_ema.safetensors`` beside ``lora.safetensors``, in the same format (a run without an EMA removes an earlier
run's, which would otherwise sit beside the newer LoRA). :meth:`LoraEMA.applied` swaps it into
the module for validation (``--validate_with ema|both``); under ZeRO-3 through DeepSpeed's
``GatheredParameters``, the supported way to modify partitioned weights.
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
    """Collective under ZeRO-3: every process calls :meth:`state_dict`, :meth:`applied` and :meth:`save`."""

    def __init__(self, module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"--ema_decay {decay}: give a decay in (0, 1), e.g. 0.999, or 0 for no EMA")
        self.decay = float(decay)
        self.params = dict(module.trainable_named_parameters())
        self.partitioned = any(hasattr(p, "ds_tensor") for p in self.params.values())  # ZeRO-3
        self.shadow = {n: self._local(p).float().clone() for n, p in self.params.items()}

    def _local(self, p: torch.nn.Parameter) -> torch.Tensor:
        """This process's share of a weight: its ZeRO-3 partition, else the whole tensor."""
        return p.ds_tensor.detach() if self.partitioned else p.detach()

    @torch.no_grad()
    def update(self) -> None:
        """One optimizer step's update of every tensor's average."""
        for name, p in self.params.items():
            self.shadow[name].mul_(self.decay).add_(self._local(p).float(), alpha=1.0 - self.decay)

    def full(self) -> dict[str, torch.Tensor]:
        """The whole average of every tensor, in fp32 (under ZeRO-3 gathered from every partition)."""
        if not self.partitioned:
            return self.shadow
        import torch.distributed as dist

        out = {}
        for name, part in self.shadow.items():
            p = self.params[name]
            group = p.ds_process_group
            # NCCL gathers device tensors; the partition may be offloaded to the host (zero3_offload.json)
            device = torch.device("cuda", torch.cuda.current_device()) \
                if dist.get_backend(group) == "nccl" else part.device
            pieces = [torch.empty_like(part, device=device) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, part.to(device), group=group)
            out[name] = torch.cat(pieces)[: p.ds_numel].view(p.ds_shape).to(part.device)
        return out

    def _partition(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This process's partition of a whole tensor, laid out as DeepSpeed partitions ``name``."""
        import torch.distributed as dist

        p = self.params[name]
        size = p.ds_tensor.numel()  # DeepSpeed pads each tensor to world × size, then rank r holds [r·size, …)
        flat = whole.reshape(-1).float()
        world, rank = dist.get_world_size(p.ds_process_group), dist.get_rank(p.ds_process_group)
        flat = torch.nn.functional.pad(flat, (0, size * world - flat.numel()))
        return flat[rank * size:(rank + 1) * size]

    # accelerate's checkpointing protocol (accelerator.register_for_checkpointing)
    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": {n: t.cpu() for n, t in self.full().items()}}

    def load_state_dict(self, state: dict) -> None:
        if set(state["shadow"]) != set(self.shadow):
            raise ValueError("the checkpoint's EMA holds other tensors than this run trains; resume with the "
                             "checkpoint's LoRA settings")
        if float(state.get("decay", self.decay)) != self.decay:  # this run's decay, from the restored average on
            log.info("resuming with --ema_decay %g (the checkpoint had %g): applied from this step on", self.decay,
                     float(state["decay"]))
        for name, t in state["shadow"].items():
            self.shadow[name].copy_(self._partition(name, t) if self.partitioned else t)

    def _write(self, values: dict[str, torch.Tensor]) -> None:
        """Set the module's trainable weights to whole tensors ``values``."""
        params = list(self.params.values())
        gathered = contextlib.nullcontext()
        if self.partitioned:
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=0)  # re-partitioned on exit
        with torch.no_grad(), gathered:
            for name, p in self.params.items():
                p.data.copy_(values[name].to(p.device, p.dtype).view(p.shape))

    def _read(self) -> dict[str, torch.Tensor]:
        params = list(self.params.values())
        gathered = contextlib.nullcontext()
        if self.partitioned:
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        with gathered:
            return {n: p.detach().clone() for n, p in self.params.items()}

    @contextlib.contextmanager
    def applied(self, module) -> Iterator[None]:
        """Inside: the module's trainable weights are the average (restored on exit)."""
        saved = self._read()
        self._write(self.full())
        try:
            yield
        finally:
            self._write(saved)

    def save(self, accelerator, module, output_dir: str | Path, metadata: Optional[dict] = None) -> Optional[Path]:
        """``lora_ema.safetensors`` (main process), in the format of ``lora.safetensors``."""
        from .checkpoint import save_lora_file

        path = Path(output_dir) / EMA_LORA_NAME
        full = self.full()
        if accelerator.is_main_process:
            state = {n: t.detach().cpu() for n, t in full.items()}
            save_lora_file(path, module, state, {**(metadata or {}), "weights": f"EMA (decay {self.decay:g})"})
            log.info("saved the EMA LoRA to %s (decay %g)", path, self.decay)
        accelerator.wait_for_everyone()
        return path


def remove_stale_ema(output_dir: str | Path) -> None:
    """After a run without an EMA (one that dropped the checkpoint's included): an earlier run's
    ``lora_ema.safetensors`` would sit beside the newer ``lora.safetensors`` as if it were its average; removed,
    with a log line."""
    path = Path(output_dir) / EMA_LORA_NAME
    if path.is_file():
        path.unlink()
        log.info("removed %s: it was an earlier run's average, older than lora.safetensors (this run keeps no EMA)",
                 path)


class _DroppedEMA:
    """Stands in for a checkpoint's EMA while a run without ``--ema_decay`` loads it (accelerate loads one
    registered object per saved one); what it receives is dropped."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class EMAResume:
    """``--ema_decay`` and ``--resume``: the checkpoint's EMA continued (a changed decay applied, logged), added
    (it starts from the resumed weights) or dropped, each with a log line. :attr:`ema` is the run's EMA (None
    without ``--ema_decay``); call :meth:`after_load` once the checkpoint is loaded (or when there is none)."""

    def __init__(self, cfg, module, accelerator, saved_config: Optional[dict]):
        self.module, self.accelerator, self.decay = module, accelerator, cfg.train.ema_decay
        saved = ((saved_config or {}).get("train") or {}).get("ema_decay") or 0.0
        self.added = saved_config is not None and not saved and bool(self.decay)
        self.ema, self._stand_in = None, None
        if saved_config is not None and saved and not self.decay:
            self._stand_in = _DroppedEMA()
            accelerator.register_for_checkpointing(self._stand_in)
            log.info("resuming without --ema_decay: the checkpoint's EMA (decay %g) is dropped", saved)
        elif self.decay and not self.added:
            self.ema = LoraEMA(module, self.decay)
            accelerator.register_for_checkpointing(self.ema)  # before a resume loads the state

    def after_load(self) -> Optional[LoraEMA]:
        if self._stand_in is not None:
            self.accelerator._custom_objects.remove(self._stand_in)  # (later checkpoints hold no EMA)
        if self.added:  # from the resumed weights on
            self.ema = LoraEMA(self.module, self.decay)
            self.accelerator.register_for_checkpointing(self.ema)
            log.info("resuming with --ema_decay %g: the checkpoint has no EMA, so it starts from the resumed "
                     "weights", self.decay)
        return self.ema


def build_ema(cfg, module, accelerator, saved_config: Optional[dict] = None) -> Optional[LoraEMA]:
    """The run's EMA (None without ``--ema_decay``) for a run that does not resume."""
    return EMAResume(cfg, module, accelerator, saved_config).after_load()
