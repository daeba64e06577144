"""Where the DiT is loaded and placed in training: the host for ``--fp8_base`` and ``--blocks_to_swap``,
ranks on a node in turns, and how block swapping meets accelerate.

With ``--fp8_base`` or ``--blocks_to_swap`` the DiT is loaded on the host, as views of the weight files'
memory maps (``models/load/host_weights.py``: no process holds a private copy of it), and every layer then goes
straight to its final form: quantised on this process's GPU, one layer at a time (a swapped block's FP8
layers then go back to the host), and packed into one pinned buffer per swapped block. The processes on one
machine do this in turns (:func:`in_turns`), so the transient host and GPU memory of loading is one process's.
A turn that fails stops every process at once with its message, and the process group's timeout
(:func:`process_group_timeout`, 60 min, ``$QIE_DIST_TIMEOUT_MIN``) is sized for a turn, not torch's 10 min.

:class:`BlockSwapper` puts everything but the swapped blocks' frozen weights on this process's device, and
accelerate must then not move the model (``device_placement=False``). Under DDP the offloaded tensors are
excluded from DDP's parameter checks and broadcasts: they are frozen and loaded identically on every rank.
DeepSpeed owns the placement (and, with ZeRO-3, the partitioning) of every weight, so it is refused.
"""
from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Callable, Optional, Sequence, TypeVar

import torch

from ..memory.block_swap import BlockSwapper
from .config import RunConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


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


LOAD_TIMEOUT_ENV = "QIE_DIST_TIMEOUT_MIN"
LOAD_TIMEOUT_MIN = 60  # minutes: a turn loads and quantises a whole DiT from (possibly slow, shared) storage


def process_group_timeout() -> timedelta:
    """How long a collective may wait (``InitProcessGroupKwargs(timeout=...)``): ``$QIE_DIST_TIMEOUT_MIN`` minutes,
    default 60. Torch's NCCL default (10 min) is shorter than one turn of a host load on slow storage, and the
    processes loading in turns wait in a collective meanwhile."""
    raw = os.environ.get(LOAD_TIMEOUT_ENV, "").strip()
    if not raw:
        return timedelta(minutes=LOAD_TIMEOUT_MIN)
    try:
        minutes = float(raw)
    except ValueError:
        minutes = -1.0
    if not minutes > 0:
        raise ValueError(f"{LOAD_TIMEOUT_ENV}={raw!r}: give the process-group timeout in minutes, a positive "
                         f"number (default {LOAD_TIMEOUT_MIN})")
    return timedelta(minutes=minutes)


class TurnFailed(RuntimeError):
    """Another process's turn failed (its message is in this one's)."""


def in_turns(fn: Callable[[], T], turn: int, turns: int,
             exchange: Callable[[Optional[tuple[str, str]]], Sequence[Optional[tuple[str, str]]]]) -> T:
    """Run ``fn`` in this process's ``turn`` of ``turns`` (its index among the processes on this machine).

    After each turn every process calls ``exchange`` (a collective, so it is also the barrier: process k starts
    once 0..k-1 have finished) with its failure, ``(error type, message)`` or None, and gets every process's
    back. A process whose ``fn`` raised raises it again; every other process stops at the same turn, naming
    the failed process and its message, instead of waiting for turns that will never end."""
    result = None
    for k in range(turns):
        error: Optional[BaseException] = None
        if k == turn:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - told to every process, then raised here
                error = e
        failures = exchange(None if error is None else (type(error).__name__, str(error)))
        if error is not None:
            raise error
        failed = [(rank, f) for rank, f in enumerate(failures) if f is not None]
        if failed:
            rank, (kind, message) = failed[0]
            text = f"process {rank} failed while loading the DiT in its turn: {kind}: {message}"
            raise (ValueError if kind == "ValueError" else TurnFailed)(text)
    return result


def gathered(failure: Optional[tuple[str, str]]) -> list:
    """Every process's ``failure`` (``torch.distributed.all_gather_object``; one process: ``[failure]``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [failure]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, failure)
    return out


def local_processes() -> int:
    """Processes on this machine (``LOCAL_WORLD_SIZE``, set by torchrun and ``accelerate launch``)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def weight_dtype(accelerator) -> torch.dtype:
    """Load dtype of the frozen DiT: the mixed-precision dtype, fp32 without mixed precision."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(accelerator.mixed_precision), torch.float32)


def device_name(accelerator) -> str:
    """Where to load weights: this process's GPU, or plain "cpu" (multi-process CPU runs get "cpu:<rank>",
    which safetensors rejects)."""
    device = accelerator.device
    return "cpu" if device.type == "cpu" else str(device)


def load_dit(preset, config: RunConfig, accelerator, ds_config: Optional[dict] = None):
    from ..memory.zero3_load import load_dit_pipeline  # under ZeRO-3 no rank holds the whole state dict

    device = load_device(config, device_name(accelerator), ds_config)
    # a host load for a GPU maps the files instead of copying them (models/load/host_weights.py)
    pipe = load_dit_pipeline(preset, model_dir=config.train.model_dir, device=device,
                             torch_dtype=weight_dtype(accelerator),
                             map_weights=device == "cpu" and accelerator.device.type == "cuda")
    return pipe.dit


def training_module(dit, cfg: RunConfig, preset_name: str, device, dtype: torch.dtype,
                    ds_config: Optional[dict] = None):
    """The training module around a loaded DiT, as ``qie train`` builds it: LoRA injected, the FP8 base made on
    ``device`` (``--fp8_base``), then the trainable weights' dtype and ``--compute_precision`` (``precision.py``)
    for a DiT in ``dtype``; under DeepSpeed (``ds_config``) the engine keeps the masters and no autocast runs.
    The benchmarks and the fake-device check build theirs here too."""
    from .module import QIETrainingModule
    from .precision import apply_precision

    t = cfg.train
    module = QIETrainingModule(dit, cfg, preset_name)
    if t.fp8_base:  # quantised on the GPU layer by layer; the swapped blocks' layers go back to the host
        module.quantize_frozen_base(device, t.blocks_to_swap)
        if not t.blocks_to_swap:
            module.to(device)
    if ds_config is None:
        apply_precision(module, dtype, t.compute_precision)
    elif t.compute_precision == "autocast":
        log.warning("--compute_precision autocast does not apply under DeepSpeed: the engine computes in its "
                    "config's dtype over its own fp32 masters")
    return module


def build_module(cfg: RunConfig, preset, accelerator, ds_config: Optional[dict]):
    """The training module on its devices: DiT loaded, LoRA injected, FP8 base, dtypes, block swapping.
    Returns ``(module, swapper)``; host loads run in turns on each machine."""
    t = cfg.train

    def build():
        from accelerate.utils import set_seed

        dit = load_dit(preset, cfg, accelerator, ds_config)
        # The LoRA's initial values come from the seed alone: reseeded here, after the load, because the first
        # model load of a process draws from the global RNG and a later one does not (so a run would otherwise
        # start from another LoRA depending on what loaded before it: the encoders of --on_the_fly, a test's).
        set_seed(t.seed)
        module = training_module(dit, cfg, preset.name, accelerator.device, weight_dtype(accelerator), ds_config)
        return module, install_block_swap(module, cfg, accelerator, ds_config)

    # ZeRO-3 loads collectively (every rank at once), so only the FP8 / swapping host loads take turns
    turns = local_processes() if (t.fp8_base or t.blocks_to_swap) and not params_offloaded(ds_config) else 1
    if turns == 1:
        return build()
    log.info("loading the DiT on the host: the %d processes on this machine take turns (this one: %d)",
             turns, accelerator.local_process_index)
    return in_turns(build, accelerator.local_process_index, turns, gathered)
