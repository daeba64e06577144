"""Seconds on a GPU from a fake-device run's counted kernels (:mod:`.costs`), by a per-GPU table.

Each kernel class has its own rate (``docs/SPEED.md``):

- ``gemm``: ``max(FLOPs / (rate[dtype] * efficiency(FLOPs)), bytes / HBM bandwidth)``: the dtype's tensor-core
  rate, lower for small GEMMs (``gemm_size_efficiency``: ``[[min FLOPs, efficiency], ...]``);
- ``gemm_thin`` (a LoRA's A or B, a modulation vector): the same with its own bandwidth (``thin_gemm_tbps``):
  these GEMMs read a whole weight or activation to do little arithmetic;
- ``conv`` (the VAE): ``max(FLOPs / conv_tflops, bytes / HBM bandwidth)``;
- ``attention`` / ``attention_bwd``: FLOPs at the backend's forward / backward rate (``attention_tflops``);
- ``elementwise``: bytes at the effective elementwise bandwidth (``elementwise_tbps``);
- every kernel adds ``launch_us`` (the launch floor);
- ``h2d``: bytes over the host link (``h2d_gbps``), on a copy stream beside the compute: only what exceeds the
  compute shows.

A table is data (``fakegpu/gpus/*.json``): ``source`` says whether it was fitted on measured rows or taken
from datasheet ratios, and ``accuracy`` how far to trust it. MFU is the model FLOPs of the step (2 x the
forward's GEMMs and attention, no recompute, no LoRA) over the seconds times ``matmul_tflops``, the bf16 matmul
rate measured on that GPU: the same definition as ``benchmarks/flops.py``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .costs import Profile

TABLES = Path(__file__).with_name("gpus")
KINDS = ("gemm", "attention", "elementwise", "launch")


@dataclass(frozen=True)
class GpuTable:
    """One GPU's rates (``fakegpu/gpus/NAME.json``)."""

    name: str
    key: str
    source: str
    accuracy: str
    memory_gib: float
    matmul_tflops: float                 # measured bf16 matmul rate (the MFU denominator)
    gemm_tflops: dict                    # dtype -> dense tensor-core rate
    gemm_size_efficiency: tuple          # ((min FLOPs, efficiency), ...), ascending
    conv_tflops: float                   # convolutions (cuDNN, the VAE's shapes)
    hbm_tbps: float
    thin_gemm_tbps: float
    elementwise_tbps: float
    attention_tflops: dict               # backend -> (forward, backward)
    default_backend: str
    launch_us: float
    h2d_gbps: float
    aliases: tuple = ()

    def gemm_rate(self, dtype: str, flops: float) -> float:
        rate = self.gemm_tflops.get(dtype, self.gemm_tflops["bfloat16"]) * 1e12
        eff = 1.0
        for threshold, e in self.gemm_size_efficiency:
            if flops >= threshold:
                eff = e
        return rate * eff

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d.pop("key")
        d["gemm_size_efficiency"] = [list(x) for x in self.gemm_size_efficiency]
        d["attention_tflops"] = {k: list(v) for k, v in self.attention_tflops.items()}
        d["aliases"] = list(self.aliases)
        return d


def load_table(path: Path) -> GpuTable:
    data = json.loads(Path(path).read_text())
    return GpuTable(key=Path(path).stem, gemm_size_efficiency=tuple(tuple(x) for x in data.pop("gemm_size_efficiency")),
                    attention_tflops={k: tuple(v) for k, v in data.pop("attention_tflops").items()},
                    aliases=tuple(data.pop("aliases", ())), **data)


def tables() -> dict[str, GpuTable]:
    return {p.stem: load_table(p) for p in sorted(TABLES.glob("*.json"))}


def gpu_table(name: Optional[str] = None) -> GpuTable:
    """The table of ``name`` (a table's key or alias, any case; None: the visible GPU, else the H100)."""
    known = tables()
    if name is None:
        name = visible_gpu_name() or "h100"
    wanted = name.lower().replace(" ", "").replace("-", "")
    for table in known.values():
        names = [table.key, *table.aliases]
        if any(wanted == n.lower().replace(" ", "").replace("-", "") for n in names):
            return table
    for table in known.values():  # a visible GPU's long name ("NVIDIA H200") contains an alias
        if any(a.lower().replace(" ", "") in wanted for a in table.aliases if len(a) > 3):
            return table
    raise ValueError(f"--gpu {name!r}: no time table for it; choose one of {', '.join(known)} "
                     f"(or measure one: python -m benchmarks.calibrate_gpu, docs/SPEED.md)")


def visible_gpu_name() -> Optional[str]:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


@dataclass
class Estimate:
    """A predicted time: ``seconds`` and its split by kernel class, the model FLOPs and MFU."""

    seconds: float
    split: dict = field(default_factory=dict)   # gemm / attention / elementwise / launch seconds
    transfer: float = 0.0                       # host-to-device copies (beside the compute)
    kernels: float = 0.0
    model_flops: float = 0.0
    mfu: float = 0.0
    gpu: str = ""

    def describe(self) -> str:
        parts = ", ".join(f"{k} {self.split.get(k, 0.0):.3f} s ({100 * self.split.get(k, 0.0) / self.seconds:.0f} %)"
                          for k in KINDS) if self.seconds else ""
        copy = f"; host copies {self.transfer:.3f} s beside it" if self.transfer else ""
        return f"{self.seconds:.3f} s on {self.gpu} ({parts}; {self.kernels:,.0f} kernels{copy})"


def predict(profile: Profile, table: GpuTable, backend: Optional[str] = None, sections=None,
            model_sections=None) -> Estimate:
    """Seconds of the kernels of ``profile`` in ``sections`` (None: all) on ``table``'s GPU; MFU from the
    model FLOPs of ``model_sections`` (the forward: twice its GEMMs and attention; None: no MFU)."""
    backend = backend if backend not in (None, "auto") else table.default_backend
    fwd_rate, bwd_rate = table.attention_tflops[backend]
    split = dict.fromkeys(KINDS, 0.0)
    transfer = kernels = 0.0
    for (section, kind, key), g in profile.groups.items():
        if sections is not None and section not in sections:
            continue
        if kind == "h2d":
            transfer += g.bytes / (table.h2d_gbps * 1e9)
            continue
        if kind in ("gemm", "gemm_thin"):
            if g.count <= 0:
                continue
            bw = table.hbm_tbps if kind == "gemm" else table.thin_gemm_tbps
            flops, moved = g.flops / g.count, g.bytes / g.count  # one kernel of this shape
            split["gemm"] += g.count * max(flops / table.gemm_rate(key[0], flops), moved / (bw * 1e12))
        elif kind == "conv":
            split["gemm"] += max(g.flops / (table.conv_tflops * 1e12), g.bytes / (table.hbm_tbps * 1e12))
        elif kind in ("attention", "attention_bwd"):
            split["attention"] += g.flops / ((fwd_rate if kind == "attention" else bwd_rate) * 1e12)
        else:
            split["elementwise"] += g.bytes / (table.elementwise_tbps * 1e12)
        kernels += g.count
    split["launch"] = kernels * table.launch_us * 1e-6
    compute = sum(split.values())
    seconds = max(compute, transfer)
    model_flops = 0.0
    if model_sections is not None:
        model_flops = 2 * profile.total(("gemm", "attention"), model_sections, what="flops")
    mfu = model_flops / (seconds * table.matmul_tflops * 1e12) if seconds and model_flops else 0.0
    return Estimate(seconds, split, transfer, kernels, model_flops, mfu, table.name)
