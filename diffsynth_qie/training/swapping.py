"""``--blocks_to_swap`` in training: where the DiT is loaded and how the swapper meets accelerate.

The DiT is loaded on the CPU (a GPU never holds the whole model), :class:`BlockSwapper`
puts everything but the swapped blocks' frozen weights on this process's device, and
accelerate must then not move the model (``device_placement=False``). Under DDP the
offloaded tensors are excluded from DDP's parameter checks and broadcasts: they are
frozen and loaded identically on every rank. DeepSpeed owns the placement (and, with
ZeRO-3, the partitioning) of every weight, so it is refused.
"""
from __future__ import annotations

from typing import Optional

from ..memory.block_swap import BlockSwapper
from .config import RunConfig


def load_device(config: RunConfig, default: str, ds_config: Optional[dict] = None) -> str:
    """Where to load the DiT: the CPU when blocks are swapped or the base is quantised to FP8 (each layer is
    then quantised straight onto the device), or under ZeRO-3 with parameter offload (DiffSynth builds the
    DiT under ``zero.Init(remote_device=<this device>)``, so the frozen partitions land where it says);
    else ``default``."""
    return "cpu" if (config.train.blocks_to_swap or config.train.fp8_base or params_offloaded(ds_config)) else default


def params_offloaded(ds_config: Optional[dict]) -> bool:
    """ZeRO-3 with ``offload_param.device == "cpu"`` (deepspeed_configs/zero3_offload.json)."""
    zero = (ds_config or {}).get("zero_optimization", {})
    return zero.get("stage") == 3 and (zero.get("offload_param") or {}).get("device") == "cpu"


def check_block_swap(config: RunConfig, ds_config: Optional[dict]) -> None:
    """Refuse ``--blocks_to_swap`` under DeepSpeed (called before the DiT is loaded, so it fails at once)."""
    n = config.train.blocks_to_swap
    if n and ds_config is not None:
        raise ValueError(f"--blocks_to_swap {n} does not work under DeepSpeed (the engine places every weight "
                         "itself); train with one process or DDP (accelerate launch without a DeepSpeed config), "
                         "or pass --blocks_to_swap 0")


def install_block_swap(module, config: RunConfig, accelerator, ds_config: Optional[dict]) -> Optional[BlockSwapper]:
    """Install block swapping on ``module.dit`` (before ``accelerator.prepare``); None when off."""
    n = config.train.blocks_to_swap
    if not n:
        return None
    check_block_swap(config, ds_config)
    swapper = BlockSwapper(module.dit, n, accelerator.device, "cpu").install()
    module._ddp_params_and_buffers_to_ignore = [f"dit.{name}" for name in swapper.offloaded_names()]
    return swapper


def device_placement(swapper: Optional[BlockSwapper], count: int) -> list:
    """``accelerator.prepare``'s ``device_placement`` for (module, *others): the swapper placed the module."""
    return [None if swapper is None else False] + [None] * (count - 1)
