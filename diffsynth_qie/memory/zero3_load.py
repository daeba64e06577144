"""Loading the DiT under DeepSpeed ZeRO-3 without any process holding its whole state dict.

DiffSynth's loader reads the complete state dict on every rank and then copies it into the
partitioned model (about 41 GB of host memory per rank for the real bf16 DiT, times the
number of ranks on one machine). Here DiffSynth still picks the model class from the weights'
key hash and builds it under ``deepspeed.zero.Init`` (each rank allocates only its partition),
but it is handed an empty state dict; the weights are then streamed in from the safetensors
memory map one tensor at a time: for each parameter, every rank gathers it
(``deepspeed.zero.GatheredParameters(..., modifier_rank=0)``), rank 0 alone reads that one
tensor from disk and copies it in, and leaving the context broadcasts it and keeps each rank's
partition. The host memory a rank needs for loading is therefore one tensor (the largest DiT
tensor is about 113 MB in bf16) plus at most ``reopen_bytes`` of file pages the kernel keeps mapped, which the reader
releases by reopening the files every ``reopen_bytes``.

Key names go through the same state-dict converter DiffSynth registers for the weights (for the
Qwen-Image DiT there is none: the file's keys are the model's).
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

from ..models.load import loading

log = logging.getLogger(__name__)

DIT_MODEL_NAME = "qwen_image_dit"
REOPEN_BYTES = 256 << 20  # release the memory map's resident pages after every 256 MiB read


def zero3_enabled() -> bool:
    """True while a DeepSpeed ZeRO-3 config is active (accelerate sets it up before models are built)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def _converter_for(paths: Sequence[str], model_name: str):
    """DiffSynth's state-dict converter registered for these weights (None: keys are used as they are)."""
    import importlib

    from diffsynth.configs import MODEL_CONFIGS
    from diffsynth.core.loader import hash_model_file

    digest = hash_model_file(list(paths) if len(paths) > 1 else paths[0])
    for entry in MODEL_CONFIGS:
        if entry["model_hash"] == digest and entry["model_name"] == model_name:
            dotted = entry.get("state_dict_converter")
            if dotted is None:
                return None
            module, _, name = dotted.rpartition(".")
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"{list(paths)} are not {model_name} weights DiffSynth knows (key hash {digest}); "
                     "check --model/--model_dir")


class SafetensorsStream:
    """Tensors of one or more safetensors files, read one at a time from the memory map.

    ``read(key)`` returns a tensor backed by the memory map (converted to ``dtype`` if asked); the
    file pages it touches count towards the process's resident memory until the mapping is closed,
    so every ``reopen_bytes`` read the files are reopened (a tensor still held keeps its own
    mapping alive, so this is safe; it only frees memory once the caller has dropped it). ``converter`` is a DiffSynth state-dict converter that
    only renames keys (the same assumption DiffSynth's ``DiskMap`` makes)."""

    def __init__(self, paths: str | Sequence[str], converter=None, reopen_bytes: int = REOPEN_BYTES):
        self.paths = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
        self.reopen_bytes = reopen_bytes
        self.bytes_read = 0
        self._since_reopen = 0
        self._files: list = []
        self._open()
        self._file_of = {k: i for i, f in enumerate(self._files) for k in f.keys()}
        self._rename = {k: k for k in self._file_of}
        if converter is not None:
            renamed = converter(dict(self._rename))
            bad = [k for k, v in renamed.items() if v not in self._file_of]
            if bad:
                raise ValueError(f"the state-dict converter for {self.paths} does more than rename keys "
                                 f"({bad[:3]}...); it cannot be streamed")
            self._rename = renamed

    def _open(self) -> None:
        from safetensors import safe_open

        self._files = [safe_open(p, framework="pt", device="cpu") for p in self.paths]
        self._since_reopen = 0

    def keys(self) -> list[str]:
        return list(self._rename)

    def shape(self, key: str) -> tuple[int, ...]:
        file_key = self._rename[key]
        return tuple(self._files[self._file_of[file_key]].get_slice(file_key).get_shape())

    def read(self, key: str, dtype=None):
        if self._since_reopen >= self.reopen_bytes:
            self._open()
        file_key = self._rename[key]
        tensor = self._files[self._file_of[file_key]].get_tensor(file_key)
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_read += nbytes
        self._since_reopen += nbytes
        return tensor


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def stream_into(model, reader: SafetensorsStream) -> int:
    """Copy every parameter of ``model`` from ``reader``, one tensor at a time; returns the bytes read.

    ZeRO-3 partitioned parameters are gathered one at a time and only rank 0 reads; plain
    parameters are copied in place. Every rank checks the names and shapes against the files'
    headers first (cheap), so all ranks fail together on a mismatch."""
    import torch

    params = dict(model.named_parameters())
    keys = set(reader.keys())
    missing, unexpected = sorted(set(params) - keys), sorted(keys - set(params))
    if missing or unexpected:
        raise ValueError(f"{reader.paths} do not match {type(model).__name__}: missing {missing[:5]} "
                         f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)}); check --model/--model_dir")
    for name, param in params.items():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if reader.shape(name) != shape:
            raise ValueError(f"{name} in {reader.paths} has shape {reader.shape(name)}, the model expects {shape}")
    rank, start = _rank(), reader.bytes_read
    for name, param in params.items():
        if hasattr(param, "ds_id"):  # partitioned by deepspeed.zero.Init
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        param.data.copy_(reader.read(name, param.dtype))
        else:
            with torch.no_grad():
                param.copy_(reader.read(name, param.dtype))
    return reader.bytes_read - start


def load_dit_pipeline(preset, model_dir=None, device: str | None = None, torch_dtype=None,
                      reopen_bytes: int = REOPEN_BYTES, map_weights: bool = False):
    """``load_pipeline(preset, components=("dit",))`` whose DiT never sits whole in one process's memory
    under ZeRO-3 (see the module docstring); without ZeRO-3 it is exactly ``load_pipeline`` (``map_weights``:
    a host load staging the weights for a GPU, as mapped views: ``models/load/host_weights.py``)."""
    if not zero3_enabled():
        return loading.load_pipeline(preset, model_dir=model_dir, components=("dit",), device=device,
                                     torch_dtype=torch_dtype, map_weights=map_weights)
    # An empty state dict: DiffSynth builds the DiT under zero.Init and loads nothing into it.
    pipe = loading.load_pipeline(preset, model_dir=model_dir, components=("dit",), device=device, torch_dtype=torch_dtype,
                         model_config_kwargs={"dit": {"state_dict": {}}})
    paths = pipe.qie_model_paths["dit"]
    reader = SafetensorsStream(paths, _converter_for(paths, DIT_MODEL_NAME), reopen_bytes=reopen_bytes)
    nbytes = stream_into(pipe.dit, reader)
    log.info("streamed the DiT's weights into its ZeRO-3 partitions (%.1f MB read on this rank)", nbytes / 1e6)
    return pipe
