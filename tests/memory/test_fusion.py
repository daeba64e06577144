"""The fusion model of compiled steps (``fakegpu/fusion.py``): a chain of elementwise operators between GEMMs is
one kernel that reads what it did not make and writes only what is read outside it."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffsynth_qie.fakegpu.costs import CostCounter


class Counting(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.counter.record(func, args, kwargs or {}, out)
        return out


def _count(fuse: bool):
    counter = CostCounter()
    counter.section = "forward"
    if fuse:
        counter.fuse(["forward"])
    x, w = torch.randn(256, 512), torch.randn(512, 512)
    with Counting(counter):
        h = torch.nn.functional.gelu(x) * 2.0 + 1.0   # a chain of 3 elementwise kernels
        y = h @ w                                        # reads the chain's last tensor: the chain writes it
        z = torch.tanh(y) - y                            # a second chain (reads y once), nothing reads it later
        del z
    return counter.profile


def test_a_chain_between_gemms_is_one_kernel_reading_its_inputs_and_writing_what_is_read_later():
    eager, fused = _count(False), _count(True)
    act = 256 * 512 * 4  # one activation, fp32
    assert eager.kernels(["elementwise"]) == 5 and fused.kernels(["elementwise"]) == 2
    # eager: gelu, mul, add each read and write one activation; tanh reads and writes, sub reads two, writes one
    assert eager.total(["elementwise"]) == 3 * 2 * act + 2 * act + 3 * act
    # fused: the first chain reads x and writes h (read by the GEMM); the second reads y and writes nothing read
    assert fused.total(["elementwise"]) == 2 * act + act
    assert fused.total(["gemm"]) == eager.total(["gemm"])
