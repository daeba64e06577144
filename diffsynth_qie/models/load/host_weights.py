"""Host loads without a private copy of the weights: views of the safetensors files' memory maps.

DiffSynth's own reader (``DiskMap``) clones every CPU tensor it reads, so a load on the host held the whole
model in the process's private memory: the bf16 DiT's 41 GB in every process on a node (``--fp8_base`` and
``--blocks_to_swap`` load the DiT on the host, to quantise or pin it block by block). Handing DiffSynth the
weights as mapped views instead (its ``ModelConfig.state_dict``) changes where the bytes live, not what the
model computes:

- a view costs nothing until it is read; the pages it reads are the file's page cache, shared by every
  process on the node that reads the same file, and the kernel drops them under memory pressure;
- the mapping is private: a write (merging a LoRA into a base weight) copies only the page written and the
  file never changes;
- a tensor stored in another dtype than the run's is converted, one tensor at a time (into private memory:
  the Qwen-Image weights are stored in bf16, the dtype of a GPU run, so a real run converts nothing).

Only loads that stage weights for a GPU use it (``load_pipeline(map_weights=True)``): a view starts where
the file puts it, not on a 64-byte boundary, and CPU kernels then take other vectorised paths, so a model
that computes on the CPU keeps DiffSynth's aligned copies (and bit-identical results however it is placed).
"""
from __future__ import annotations

from typing import Sequence

import torch


def mapped_tensors(paths: Sequence[str], torch_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of ``paths`` (safetensors files) as a view of its memory map, converted to
    ``torch_dtype`` only where a floating-point tensor is stored in another dtype."""
    from safetensors import safe_open

    views = {}
    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                convert = tensor.is_floating_point() and tensor.dtype != torch_dtype
                views[key] = tensor.to(torch_dtype) if convert else tensor
    return views


def map_host_weights(model_configs: Sequence, torch_dtype: torch.dtype) -> None:
    """Give each DiffSynth ``ModelConfig`` whose weights are safetensors files its mapped tensors as
    ``state_dict`` (configs that already have one, from the caller, are left alone)."""
    for config in model_configs:
        if getattr(config, "state_dict", None) is not None:
            continue
        config.download_if_necessary()  # what DiffSynth does first; a no-op for local files
        paths = config.path if isinstance(config.path, list) else [config.path]
        if paths and all(str(p).endswith(".safetensors") for p in paths):
            config.state_dict = mapped_tensors(paths, torch_dtype)
