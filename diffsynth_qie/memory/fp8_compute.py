"""FP8 compute (``--fp8_compute``): the frozen FP8 base's matmuls run on the tensor cores in FP8.

:func:`enable_fp8_compute` turns each :class:`~.fp8.Fp8Linear` of ``--fp8_base`` (e4m3 weights, one power-of-two
scale per output channel) into an :class:`Fp8ComputeLinear`, which multiplies the stored bits themselves:

1. the activation's rows are quantised to e4m3 with a dynamic power-of-two scale per row, read off the row
   maximum's exponent bits (the maximum lands in [128, 256)): one reduction, three tiny kernels on the ``[M, 1]``
   scales, one exact division and one cast, with no rounding but e4m3's own; layers fed the very same tensor one
   after another (the attention's q, k and v projections) reuse it (:func:`rows_of`);
2. ``torch._scaled_mm(x_q, q.T, scale_a=[M, 1], scale_b=[1, N], bias, out_dtype=bf16)``: row-wise scaling,
   fp32 accumulation (``use_fast_accum=False``), the bias added in the epilogue. ``q.T`` is the column-major
   operand the kernel wants as stored, without a copy.

GPUs: FP8 tensor cores and row-wise ``_scaled_mm``, compute capability 8.9 or newer (L40S, RTX 4090, H100, H200,
RTX 5090); :func:`check_fp8_gpu` refuses others (an A100) before any weight loads. On the CPU the same
quantisation feeds :func:`emulated_scaled_mm` (the e4m3 values as fp32, an fp32 matmul, the two scales), the
reference the tests hold the numerics to. Under the fake device the real ``_scaled_mm`` dispatches (its meta
function checks dtypes, layouts, divisibility by 16 and the scales' shapes) and is counted as an FP8 GEMM.

The backward pass needs only the input's gradient (the base is frozen): ``dX = dY @ (q·s)`` in bf16 with the weight
dequantised again, as ``--fp8_base`` does (:func:`~.fp8.linear_input_grad`); nothing but the FP8 bits is saved.
LoRA branches (PEFT's, around the base layer) stay bf16 on top. Layers with a side not divisible by 16 keep the
``--fp8_base`` path.
"""
from __future__ import annotations

import logging
import threading
import weakref

import torch

from .fp8 import FP8_DTYPE, Fp8Linear, compute_dtype, linear_input_grad

log = logging.getLogger(__name__)

FP8_CAPABILITY = (8, 9)
FLAG = "--fp8_compute"
EXPONENT_BITS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
                 torch.float32: (torch.int32, 0x7F800000)}


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q, scale)`` of a 2-D ``x`` (bf16, fp16 or fp32): ``x_q`` float8_e4m3fn, ``scale`` fp32 ``[M, 1]``
    powers of two, with ``x ≈ x_q · scale`` row by row. The scale is the row maximum's exponent bits (``2^floor(log2
    max)``) over 128, so the maximum lands in [128, 256); dividing by a power of two is exact: e4m3's rounding is the
    only error."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=1, keepdim=True).clamp_(min=torch.finfo(x.dtype).tiny)
    ints, mask = EXPONENT_BITS[x.dtype]
    scale = (amax.view(ints) & mask).view(x.dtype) * 2.0 ** -7
    return (x / scale).to(FP8_DTYPE), scale.float()


_held = threading.local()


def rows_of(x: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` of ``x2`` (``x``'s rows), reused while the next call brings the very same ``x``
    unchanged (same object, same version counter): DiffSynth's attention feeds one tensor to ``to_q``, ``to_k`` and
    ``to_v``, which then quantise it once, not three times. One entry per thread, dropped when ``x`` is freed;
    not under ``torch.compile`` (its graph fuses and deduplicates the quantisation itself) or for inference tensors
    (no version counter)."""
    if torch.compiler.is_compiling() or x.is_inference():
        return quantize_rows(x2)
    entry = getattr(_held, "entry", None)
    if entry is not None and entry[0]() is x and entry[1] == x._version:
        return entry[2]

    def drop(ref):
        held = getattr(_held, "entry", None)
        if held is not None and held[0] is ref:
            _held.entry = None

    out = quantize_rows(x2)
    _held.entry = (weakref.ref(x, drop), x._version, out)
    return out


def emulated_scaled_mm(x_q, w_t, scale_a, scale_b, bias, out_dtype):
    """``torch._scaled_mm`` with row-wise scales, in fp32 on any device: ``(x_q @ w_t) · scale_a · scale_b + bias``
    rounded once to ``out_dtype`` (the e4m3 operands are exact in fp32)."""
    y = (x_q.float() @ w_t.float()) * scale_a * scale_b
    return (y if bias is None else y + bias.float()).to(out_dtype)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias) -> torch.Tensor:
    """``x @ (q·s)ᵀ + b`` with ``x`` quantised per row and both operands in e4m3; ``torch._scaled_mm`` on CUDA,
    :func:`emulated_scaled_mm` elsewhere. The output has ``x``'s dtype (bf16 on a GPU)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x_q, scale_a = rows_of(x, x2 if x2.is_contiguous() else x2.contiguous())
    scale_b = scale.view(1, -1)
    bias = None if bias is None else bias.to(x.dtype)
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{FLAG}: row-wise FP8 matmuls write bf16, but the DiT computes in {x.dtype}; run it in "
                             "bf16 (--dtype bf16 or auto), or drop --fp8_compute")
        y = torch._scaled_mm(x_q, q.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=x.dtype,
                             use_fast_accum=False)
    else:
        y = emulated_scaled_mm(x_q, q.t(), scale_a, scale_b, bias, x.dtype)
    return y.reshape(*shape[:-1], y.shape[-1])


class _Fp8MatmulFn(torch.autograd.Function):
    """The FP8 GEMM forward; the backward is the input's gradient in bf16 (the base is frozen). Saves the stored
    parameters (see ``fp8._Fp8LinearFn``)."""

    @staticmethod
    def forward(ctx, x, bits, scale_bits, bias, dtype):
        ctx.save_for_backward(bits, scale_bits)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        ctx.bias_grad = bias is not None and bias.requires_grad
        return fp8_linear(x.to(dtype), bits.view(FP8_DTYPE), scale_bits.view(torch.float32), bias)

    @staticmethod
    def backward(ctx, grad_out):
        return linear_input_grad(ctx, grad_out)


class Fp8ComputeLinear(Fp8Linear):
    """An :class:`~.fp8.Fp8Linear` whose forward multiplies its FP8 bits in FP8 (same storage, same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fp8MatmulFn.apply(x, self.weight_bits, self.scale_bits, self.bias, compute_dtype(x))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", compute=fp8 (row-wise scaled_mm)"


def enable_fp8_compute(model: torch.nn.Module) -> int:
    """Turn every :class:`~.fp8.Fp8Linear` of ``model`` whose sides divide by 16 into an :class:`Fp8ComputeLinear`
    (in place; already turned layers count again). Returns how many compute in FP8."""
    turned = kept = 0
    for module in model.modules():
        if not isinstance(module, Fp8Linear):
            continue
        if module.in_features % 16 or module.out_features % 16:
            kept += 1
            continue
        module.__class__ = Fp8ComputeLinear
        turned += 1
    log.info("FP8 compute: %d linear layers multiply in FP8 (row-wise scaled_mm)%s", turned,
             f"; {kept} with a side not divisible by 16 dequantise to bf16" if kept else "")
    return turned


def fp8_refusal(gpu: str, detail: str) -> ValueError:
    """The one-line refusal of ``--fp8_compute`` on a GPU without FP8 tensor cores."""
    return ValueError(f"{FLAG}: the {gpu} has no FP8 tensor cores ({detail}; FP8 matmuls need compute capability "
                      "8.9 or newer: L40S, RTX 4090, H100, H200, RTX 5090); drop --fp8_compute (--fp8_base alone "
                      "keeps the FP8 weights and computes in bf16)")


def check_fp8_gpu(device) -> None:
    """Refuse ``--fp8_compute`` on a CUDA ``device`` below compute capability 8.9; CPU devices run the emulation."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_CAPABILITY:
        raise fp8_refusal(torch.cuda.get_device_name(device), f"compute capability {capability[0]}.{capability[1]}")
