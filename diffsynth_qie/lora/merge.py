"""Merging LoRAs into the DiT's weight files, one shard at a time (``qie merge-lora``).

The output keeps the input's layout: the same shard files with the same key names and
shapes, and the same ``diffusion_pytorch_model.safetensors.index.json``, so DiffSynth (which
recognises a model by its keys and shapes), diffusers and ComfyUI load it as a base model.
Each input shard is read, patched (``W += scale * alpha/rank * B @ A`` in fp32, or a full
weight copied), cast and written atomically before the next is read: host memory stays
near one shard.

Output dtypes: ``bf16`` (the released models' dtype), ``fp32``, ``same`` (each tensor keeps
its input dtype) and ``fp8``: 2-D ``.weight`` tensors cast to ``float8_e4m3fn`` (clamped to its
±448 range, no scale tensors, so keys and shapes stay those of the input and every loader
that understands e4m3 weights reads it), everything else bf16.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..utils.atomic import atomic_save, atomic_write_json, finished_files
from ..models.load.dit_files import DIT_STEM, DIT_SUBDIR, INDEX_NAME, DitFiles, resolve_dit
from .apply import _check_delta
from .formats import load_lora_state
from .state import LoraModule, LoraState, problems

log = logging.getLogger(__name__)

MERGE_DTYPES = ("bf16", "fp8", "fp32", "same")
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
INFO_NAME = "merge_info.json"


def parse_lora_spec(spec: str) -> tuple[str, float]:
    """``PATH`` or ``PATH:SCALE`` -> (path, scale); a path may itself contain ':'."""
    path, sep, tail = str(spec).rpartition(":")
    if sep and path:
        try:
            return path, float(tail)
        except ValueError:
            pass
    return str(spec), 1.0


@dataclass
class MergeReport:
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    merged_modules: int = 0
    full_weights: int = 0
    largest_shard_bytes: int = 0


def _module_names(dit: DitFiles) -> list[str]:
    return [k[: -len(".weight")] for k in dit.shapes if k.endswith(".weight")]


def _matched(state: LoraState, dit: DitFiles) -> LoraState:
    """Resolve kohya names and check every LoRA tensor fits the DiT's keys and shapes."""
    state = state.resolve(_module_names(dit))
    missing, mismatched = [], []
    for name, mod in state.modules.items():
        shape = dit.shapes.get(f"{name}.weight")
        if shape is None:
            missing.append(name)
        elif shape != (mod.B.shape[0], mod.A.shape[1]):
            mismatched.append(f"{name} (LoRA {mod.B.shape[0]}x{mod.A.shape[1]} vs weight {shape})")
    for name, tensor in state.full.items():
        shape = dit.shapes.get(name)
        if shape is None:
            missing.append(name)
        elif shape != tuple(tensor.shape):
            mismatched.append(f"{name} ({tuple(tensor.shape)} vs {shape})")
    if missing or mismatched:
        raise ValueError(f"LoRA {state.source} does not match the DiT in {dit.folder}: "
                         + problems(("key(s) not in the DiT", missing), ("shape mismatch(es)", mismatched))
                         + ". Check that the LoRA was trained for this model.")
    return state


def _cast(key: str, tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    if not tensor.is_floating_point() or dtype == "same":
        return tensor
    if dtype == "fp32":
        return tensor.to(torch.float32)
    if dtype == "fp8" and tensor.ndim == 2 and key.endswith(".weight"):
        return tensor.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return tensor.to(torch.bfloat16)


def _patches(states: Sequence[tuple[LoraState, float]]) -> dict[str, list]:
    """DiT key -> [(scale, LoraModule | full tensor, source), ...] in the order given."""
    out: dict[str, list] = {}
    for state, scale in states:
        for name, mod in state.modules.items():
            out.setdefault(f"{name}.weight", []).append((scale, mod, state.source))
        for name, tensor in state.full.items():
            out.setdefault(name, []).append((scale, tensor, state.source))
    return out


@torch.no_grad()
def _patched(key: str, weight: torch.Tensor, patches: list) -> torch.Tensor:
    w = weight.float()
    for scale, patch, source in patches:
        if isinstance(patch, LoraModule):
            _check_delta(key[: -len(".weight")], patch, w, source)
            w.add_(patch.delta(), alpha=scale)
        elif scale == 1.0:
            w = patch.float().clone()
        else:  # a fully trained weight at scale s: interpolate from the current one
            w.lerp_(patch.float(), scale)
    return w


def _link_components(base: Path, out_dir: Path) -> list[str]:
    """Point ``out_dir``'s other components (text encoder, VAE, tokenizer, ...) at ``base``'s."""
    linked = []
    for entry in finished_files(base):
        if entry.name in (DIT_SUBDIR, INFO_NAME) or entry.name.startswith("."):
            continue
        target = out_dir / entry.name
        if not target.exists():
            target.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
            linked.append(entry.name)
    return linked


PROGRESS_NAME = ".qie-merge-progress.json"  # what an unfinished merge into this directory was asked to do


def _resumable(out_dir: Path, out_folder: Path, request: dict) -> set[str]:
    """Names of the shard files an interrupted identical merge into ``out_dir`` finished (empty for a fresh
    directory). A finished merge, or another merge's unfinished weights, are refused by name."""
    existing = {p.name for p in finished_files(out_folder, f"{DIT_STEM}*")}
    if not existing:
        return set()
    progress = out_dir / PROGRESS_NAME
    if (out_dir / INFO_NAME).is_file() or not progress.is_file():
        raise ValueError(f"--out {out_dir} already holds DiT weights in {out_folder}; choose an empty directory "
                         "or remove them")
    try:
        started = json.loads(progress.read_text())
    except (OSError, ValueError):
        started = None
    if started != request:
        raise ValueError(f"--out {out_dir} holds an unfinished merge of other inputs ({progress}); rerun it with "
                         "the same --base, --lora and --dtype to finish it, or choose an empty directory")
    keep = existing & set(request["files"])
    log.info("finishing the interrupted merge into %s: %d of %d shard file(s) are already written", out_dir,
             len(keep), len(request["files"]))
    return keep


def merge_loras(base: str | os.PathLike, loras: Sequence[tuple[str | os.PathLike, float]],
                out_dir: str | os.PathLike, dtype: str = "bf16", link_components: bool = True) -> MergeReport:
    """Merge ``loras`` [(path, scale), ...] into the DiT of ``base`` and write it to ``out_dir``.

    ``base`` is a model directory (repository layout), its ``transformer/`` folder, or a
    downloaded preset's name. Every LoRA is read and checked against the DiT's headers
    before anything is written. With ``link_components`` and a model directory, the
    other components are symlinked so ``out_dir`` loads as a whole model.
    """
    if dtype not in MERGE_DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(MERGE_DTYPES)}")
    if not loras:
        raise ValueError("give at least one --lora FILE[:SCALE] to merge")
    dit = resolve_dit(base)
    out_dir = Path(out_dir)
    out_folder = out_dir / DIT_SUBDIR
    if out_folder.resolve() == dit.folder.resolve() or out_dir.resolve() == dit.folder.resolve():
        raise ValueError(f"--out {out_dir} is the base model's own directory; write the merged model elsewhere")
    request = {"base": str(dit.folder.resolve()), "dtype": dtype, "files": [p.name for p in dit.files],
               "loras": [{"path": str(Path(p).resolve()), "scale": float(s)} for p, s in loras]}
    done = _resumable(out_dir, out_folder, request)
    states = [(_matched(load_lora_state(path), dit), float(scale)) for path, scale in loras]
    patches = _patches(states)
    report = MergeReport(out_dir=out_dir, merged_modules=sum(len(s.modules) for s, _ in states),
                         full_weights=sum(len(s.full) for s, _ in states))
    from safetensors import safe_open
    from safetensors.torch import save_file

    atomic_write_json(out_dir / PROGRESS_NAME, request)  # a killed merge reruns into the same --out
    weight_map, total = {}, 0
    for path in dit.files:
        if path.name in done:  # written whole by the killed run (files are written whole or not at all)
            with safe_open(str(out_folder / path.name), framework="pt", device="cpu") as f:
                weight_map.update({k: path.name for k in f.keys()})
            total += (out_folder / path.name).stat().st_size
            report.files.append(out_folder / path.name)
            log.info("kept %s from the interrupted run", out_folder / path.name)
            continue
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {"format": "pt"})
            for key in f.keys():
                tensor = f.get_tensor(key)
                if key in patches:
                    tensor = _patched(key, tensor, patches[key])
                tensors[key] = _cast(key, tensor, dtype).contiguous()
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        report.largest_shard_bytes = max(report.largest_shard_bytes, size)
        total += size
        target = out_folder / path.name
        atomic_save(target, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
        weight_map.update({k: path.name for k in tensors})
        report.files.append(target)
        log.info("wrote %s (%d tensors, %.1f MB)", target, len(tensors), size / 2**20)
        del tensors
    if dit.indexed:
        atomic_write_json(out_folder / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    linked = []
    if link_components and dit.folder.name == DIT_SUBDIR:
        linked = _link_components(dit.folder.parent, out_dir)
    atomic_write_json(out_dir / INFO_NAME, {"base": str(base), "dtype": dtype, "linked_components": linked,
                                            "loras": [{"path": str(p), "scale": float(s)} for p, s in loras]})
    (out_dir / PROGRESS_NAME).unlink(missing_ok=True)
    log.info("merged %d LoRA(s) (%d module deltas, %d full weights) into %s (%s)%s", len(loras),
             report.merged_modules, report.full_weights, out_folder, dtype,
             f"; linked {', '.join(linked)} from the base" if linked else "")
    return report
