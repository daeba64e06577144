"""What each kernel of a fake-device run would cost a GPU: FLOPs, bytes read and written, kernel count.

The fake device sees every device operator of the real full-size graph (``ops.HostRealDeviceFake``). With a
:class:`CostCounter` installed (``FakeCuda(costs=True)``), each one is recorded by class:

- ``gemm``: matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``), keyed by their (M, N, K) and
  operand dtype; a GEMM with one side of at most :data:`THIN` (a LoRA's A or B at its rank) is ``gemm_thin``,
  memory-bound on a GPU and costed as its own class;
- ``conv``: convolutions (the VAE's), keyed by dtype and output shape;
- ``attention`` / ``attention_bwd``: the fused SDPA kernels, forward and backward;
- ``elementwise``: every other kernel (casts, norms, modulation, softmax, copies, reductions, the optimizer's
  foreach ops), costed by the bytes it moves;
- ``h2d``: host-to-device copies (a block swap's weights, a batch's upload), costed by the PCIe link.

Views, ``empty`` and other metadata operators launch no kernel and are not counted. FLOPs come from PyTorch's
own formulas (``torch.utils.flop_counter.flop_registry``); bytes are each input's and output's touched
elements (a broadcast input counts its stored elements once) times its element size. The counts are split by
``section`` (forward, backward, optimizer step; an edit's encode, denoise, decode). :mod:`.timemodel` turns a
:class:`Profile` into seconds on a GPU's table.

Under ``--compile`` (:meth:`CostCounter.fuse`) the forward's and backward's elementwise kernels are costed as
inductor fuses them: ``fusion.py``.

With ``frames=True`` each elementwise kernel's bytes are also attributed to the line of our code that asked for
it (slow: a stack walk per kernel; the speed guard in the tests uses it to name what grew).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from .checks import op_leaves

aten = torch.ops.aten
THIN = 128  # a GEMM with M, N or K at most this is a LoRA-style thin GEMM (memory-bound)
GEMM_OPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm}
CONV_OPS = {aten.convolution, aten._convolution, aten.cudnn_convolution, aten.convolution_backward}
ATTENTION_FWD = {aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
                 aten._scaled_dot_product_cudnn_attention, aten._flash_attention_forward,
                 aten._efficient_attention_forward}
ATTENTION_BWD = {aten._scaled_dot_product_flash_attention_backward,
                 aten._scaled_dot_product_efficient_attention_backward,
                 aten._scaled_dot_product_cudnn_attention_backward, aten._flash_attention_backward,
                 aten._efficient_attention_backward}
NO_KERNEL = {aten._unsafe_view, aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.detach,
             aten.lift_fresh, aten.alias, aten._local_scalar_dense, aten.set_, aten.resize_, aten.is_pinned,
             aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.record_stream}


@dataclass
class Group:
    """Kernels of one class, key and section: how many, and their FLOPs and bytes summed (a GEMM key is one
    shape, so each of its kernels costs ``flops / count``)."""

    count: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0

    def scaled(self, weight: float) -> "Group":
        return Group(weight * self.count, weight * self.flops, weight * self.bytes)


@dataclass
class Profile:
    """The counted kernels of a run: ``groups[(section, kind, key)]`` -> :class:`Group` (``key``: a GEMM's
    ``(dtype, M, N, K)``, else the dtype); ``frames``: elementwise bytes per ``(op, our line)`` when asked."""

    groups: dict = field(default_factory=dict)
    frames: Counter = field(default_factory=Counter)

    def total(self, kinds=None, sections=None, what: str = "bytes") -> float:
        return sum(getattr(g, what) for (s, k, _), g in self.groups.items()
                   if (kinds is None or k in kinds) and (sections is None or s in sections))

    def kernels(self, kinds=None, sections=None) -> float:
        return self.total(kinds, sections, what="count")

    def sections(self) -> list:
        return sorted({s for s, _, _ in self.groups})

    def combine(self, other: "Profile", weight: float) -> "Profile":
        """``self + weight * other``, group by group (``weight`` may be negative: a difference of two runs)."""
        out = Profile({k: g.scaled(1.0) for k, g in self.groups.items()}, Counter(self.frames))
        for key, g in other.groups.items():
            mine = out.groups.setdefault(key, Group())
            mine.count += weight * g.count
            mine.flops += weight * g.flops
            mine.bytes += weight * g.bytes
        for key, b in other.frames.items():
            out.frames[key] += weight * b
        return out

    def scaled_to(self, deeper: "Profile", depths: tuple, blocks: int) -> "Profile":
        """The profile of a ``blocks``-block DiT from this run at ``depths[0]`` blocks and ``deeper`` at
        ``depths[1]``: every block runs the same kernels, so their difference is one block's share."""
        per_block = deeper.combine(self, -1.0)
        return self.combine(per_block, (blocks - depths[0]) / (depths[1] - depths[0]))

    def with_sections(self, other: "Profile", sections: tuple) -> "Profile":
        """This profile with the kernels of ``sections`` taken from ``other`` (a run that counted them the same),
        in their place (the groups' order is the order sums over them are made in)."""
        groups: dict = {}
        for key, g in self.groups.items():
            if key[0] not in sections:
                groups[key] = g.scaled(1.0)
            elif not any(k[0] in sections for k in groups):
                groups.update({k: o.scaled(1.0) for k, o in other.groups.items() if k[0] in sections})
        groups.update({k: o.scaled(1.0) for k, o in other.groups.items() if k[0] in sections and k not in groups})
        return Profile(groups, Counter(self.frames))

    def to_json(self) -> dict:
        return {"groups": [[s, k, list(key) if isinstance(key, tuple) else key, g.count, g.flops, g.bytes]
                           for (s, k, key), g in self.groups.items() if g.count]}

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        return cls({(s, k, tuple(key) if isinstance(key, list) else key): Group(c, f, b)
                    for s, k, key, c, f, b in data["groups"]})


def touched_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads or writes of ``t``: its elements along the dimensions it really stores."""
    n = math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) if t.dim() else 1
    return n * t.element_size()


class CostCounter:
    """Installed on the fake device's dispatch mode: :meth:`record` sees every device operator once."""

    def __init__(self, frames: bool = False):
        self.profile = Profile()
        self.section = "setup"
        self.frames = frames
        self.fused_sections: frozenset = frozenset()  # sections costed as compiled (:meth:`fuse`)
        self.fuser = None

    def fuse(self, sections) -> None:
        """Cost the elementwise kernels of ``sections`` as inductor fuses them (``fusion.py``: ``--compile``)."""
        from .fusion import ChainFuser

        self.fused_sections, self.fuser = frozenset(sections), ChainFuser(touched_bytes)

    def record(self, func, args, kwargs, out) -> None:
        packet = func.overloadpacket
        if func.is_view or packet in NO_KERNEL or func.namespace == "prim":  # (prim: metadata, e.g. prim.device)
            return
        flat_in = [a for a in op_leaves(args, kwargs) if isinstance(a, torch.Tensor)]
        flat_out = [o for o in op_leaves(out) if isinstance(o, torch.Tensor)]
        kind, key, flops = self._classify(packet, args, kwargs, out, flat_in)
        seen, moved = set(), 0
        for t in flat_in + flat_out:
            if id(t) not in seen:
                seen.add(id(t))
                moved += touched_bytes(t)
        count = 1.0
        if self.section in self.fused_sections:
            key = "fused" if kind == "elementwise" else key  # (a chain runs across dtypes)
            group = self.profile.groups.setdefault((self.section, kind, key), Group())
            moved, count = self.fuser.record(kind, group, flat_in, flat_out, moved)
        else:
            group = self.profile.groups.setdefault((self.section, kind, key), Group())
        group.count += count
        group.flops += flops
        group.bytes += moved
        if self.frames and kind == "elementwise":
            from .ops import our_frame

            self.profile.frames[(str(packet).replace("aten.", ""), our_frame())] += moved

    def _classify(self, packet, args, kwargs, out, flat_in):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils.flop_counter import flop_registry

        if packet in GEMM_OPS:
            a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            batch = a.shape[0] if a.dim() == 3 else 1
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            kind = "gemm_thin" if min(m, n, k) <= THIN else "gemm"
            return kind, (str(a.dtype).replace("torch.", ""), batch * m, n, k), flops
        if packet in CONV_OPS:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            first = next(o for o in op_leaves(out) if isinstance(o, torch.Tensor))
            return "conv", (str(first.dtype).replace("torch.", ""), *first.shape), flops
        if packet in ATTENTION_FWD or packet in ATTENTION_BWD:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            q = args[0] if packet in ATTENTION_FWD else args[1]
            kind = "attention" if packet in ATTENTION_FWD else "attention_bwd"
            return kind, (str(q.dtype).replace("torch.", ""), q.shape[-2]), flops
        if packet in (aten._to_copy, aten.copy_) and any(not isinstance(t, FakeTensor) for t in flat_in):
            return "h2d", "host", 0
        dtype = next((str(t.dtype).replace("torch.", "") for t in flat_in), "")
        return "elementwise", dtype, 0


def count_flops_of(profile: Profile, sections, kinds=("gemm", "attention")) -> float:
    """FLOPs of ``kinds`` in ``sections`` (the model FLOPs of a forward: its non-thin GEMMs and attention)."""
    return profile.total(kinds, sections, what="flops")


def top_frames(profile: Profile, n: int = 5) -> list:
    """The ``n`` (op, our line) pairs that moved the most elementwise bytes."""
    return Counter({k: v for k, v in profile.frames.items() if v > 0}).most_common(n)

