"""The user's LoRA files as the preflights attach them, and where their branches must sit.

``qie edit`` and the UI read each ``--lora`` file on the host and attach it through ``LoraManager`` to a DiT that
is already on the GPU; ``qie train --frozen_lora`` attaches its file through the training module the same way.
The preflights take that very path on the fake device, on a DiT of a few blocks, so the file they attach is the
user's own cut to those blocks (:func:`first_blocks_file`): its keys, dtypes, ranks and metadata, the first blocks
it adapts renumbered to the blocks built. Tests and checks without a file write one shaped like a real LoRA of the
preset (:func:`standin_lora_file`).

``lora.branch.misplaced_branch`` finds an unmerged branch that does not sit where its layer's weight is (a branch
left on the host while the weight is on the GPU: the branch's forward then copies it to the GPU at every call, or
fails on a device mismatch where nothing moves it); :func:`check_branches` makes it the preflights' error, and the
UI checks it after each LoRA switch on the real model.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

import torch

BLOCK_KEY = re.compile(r"(transformer_blocks[._])(\d+)([._])")  # every key format names the block so


def first_blocks_file(path: str | Path, blocks: int, out_dir: str | Path) -> Path:
    """A copy of the LoRA file ``path`` in ``out_dir`` for a DiT of ``blocks`` blocks: what adapts the first
    ``blocks`` blocks the file adapts, renumbered ``0 .. blocks-1`` (a LoRA of later blocks only still puts its
    branches on the blocks built), and every tensor outside the blocks; keys, dtypes, ranks and metadata as in
    the file. A safetensors file is read for those tensors only; a torch state dict is read whole (and written
    as safetensors). The copy keeps the file's name (a schedule or a family can be read from it)."""
    path = Path(path)
    tensors, metadata = _read(path, blocks)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    out = Path(out_dir) / (path.name if path.suffix == ".safetensors" else f"{path.stem}.safetensors")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), metadata=metadata)
    return out


def _read(path: Path, blocks: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys, metadata = list(f.keys()), dict(f.metadata() or {})
            renamed = _renumbered(keys, blocks)
            return {new: f.get_tensor(key) for key, new in renamed.items()}, metadata
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and len(state) == 1 and next(iter(state)) in ("state_dict", "module", "model_state"):
        state = next(iter(state.values()))
    return {new: state[key] for key, new in _renumbered(list(state), blocks).items()}, {}


def _renumbered(keys: Sequence[str], blocks: int) -> dict[str, str]:
    """{kept key: its name in the copy}: the first ``blocks`` block indices the keys name, renumbered in order."""
    found = sorted({int(m.group(2)) for k in keys if (m := BLOCK_KEY.search(k))})
    new_index = {old: new for new, old in enumerate(found[:blocks])}
    out = {}
    for key in keys:
        m = BLOCK_KEY.search(key)
        if m is None:
            out[key] = key
        elif int(m.group(2)) in new_index:
            out[key] = key[:m.start(2)] + str(new_index[int(m.group(2))]) + key[m.end(2):]
    return out


def standin_lora_file(preset, path: str | Path, rank: int = 32, blocks: int = 2, dtype: torch.dtype = torch.bfloat16,
                      targets: Optional[Sequence[str]] = None, metadata: Optional[dict] = None) -> Path:
    """A LoRA file shaped as a real one of ``preset`` (zeros): ``lora_A`` ``[rank, in]`` and ``lora_B``
    ``[out, rank]`` in ``dtype`` for every target (default: the preset's) of its first ``blocks`` blocks at full
    width, in our key format. A few MB at full width for two blocks."""
    from safetensors.torch import save_file

    from ..lora.branch import matches_target
    from ..memory.census import build_dit

    with torch.device("meta"):
        dit = build_dit(preset, blocks)
    targets = list(targets or preset.lora_target_modules)
    tensors = {}
    for name, module in dit.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.ndim == 2 and matches_target(name, targets):
            out_dim, in_dim = weight.shape
            tensors[f"{name}.lora_A.weight"] = torch.zeros(rank, in_dim, dtype=dtype)
            tensors[f"{name}.lora_B.weight"] = torch.zeros(out_dim, rank, dtype=dtype)
    save_file(tensors, str(path), metadata={"preset": preset.name, **(metadata or {})})
    return Path(path)


def check_branches(model: torch.nn.Module, what: str) -> None:
    """``lora.branch.misplaced_branch`` as a :class:`~..fakegpu.device.FakeRunError` (the preflights' report)."""
    from ..fakegpu.device import FakeRunError
    from ..lora.branch import misplaced_branch

    line = misplaced_branch(model, what)
    if line is not None:
        raise FakeRunError(line)
