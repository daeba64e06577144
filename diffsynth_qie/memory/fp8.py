"""FP8 base weights: frozen linears stored as float8 e4m3 with one scale per output channel.

``quantize_linears(dit)`` replaces every frozen ``nn.Linear`` under ``transformer_blocks``
(≈99.6 % of the real DiT's 20 B parameters) by :class:`Fp8Linear`. The weight is kept as
``float8_e4m3fn`` bits, ``w ≈ q · s`` with one scale per output channel, ``s`` the power of two with
``max|w_row| / s`` in [224, 448). A power of two makes the dequantised weight ``q · s`` exact in bf16 (``q`` has
4 significant bits), so ``forward`` scales the weight, not the output: one cast and one multiply of the weight
(3 + 4 bytes per weight), then one bf16 GEMM with the bias fused, for ``--fp8_base`` (weight-only
quantisation: half the memory of a bf16 base, no faster matmuls). Scaling the output instead costs three fp32
passes over it, 20 bytes per output element, and the output is 2.8x the weight at 8.5 k tokens. The backward
pass saves the FP8 weight, not a dequantised copy, and dequantises it again for ``dX = dY @ W``; a step holds
one layer's full-precision weight at a time. ``--fp8_compute`` multiplies the FP8 bits themselves
(``memory/fp8_compute.py``).

What stays in full precision: LoRA adapters (PEFT's ``lora_A``/``lora_B``; for a PEFT-wrapped
linear only its ``base_layer`` is quantised), every linear with a trainable parameter (fully
fine-tuned modules), the embeddings, norms and the output projection outside the blocks.

Storage details that keep the FP8 bits intact: the bits are a ``uint8`` parameter
(``weight_bits``) and the scale an ``int32`` view of fp32 values (``scale_bits``), both frozen
parameters. ``module.to(torch.bfloat16)`` (DeepSpeed and accelerate cast whole models) and
DDP's one-time broadcast of parameters then move them between devices without converting
them, and ``compute dtype = first frozen floating-point parameter`` rules keep working.
``weight`` (read-only) returns the ``float8_e4m3fn`` view; it cannot be merged into.

Error bound (round-to-nearest into e4m3's 3 mantissa bits): for every element,
``|w - q·s| <= 2^-4·|w| + 2^-10·s`` (relative 2^-4 for normal numbers, half the subnormal
step below), hence per channel ``max|w - q·s| <= max|w| / 16`` (the row's maximum lands in [224, 448); a
scale of exactly ``max|w| / 448`` bounded it by ``max|w| / 28`` but is not a power of two, and its product with
``q`` rounds in bf16: a per-channel gain error of up to 2^-9 on the weight side).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
DEFAULT_SCOPE = "transformer_blocks"


def power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power of two ``s`` with ``amax / s`` in [224, 448) (fp32): ``amax / 448 = m·2^e``, ``m`` in [0.5, 1),
    gives ``s = 2^e``."""
    _, exponent = torch.frexp(amax.float().clamp(min=1e-12) / FP8_MAX)
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), exponent)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` float8_e4m3fn of ``weight``'s shape, ``scale`` fp32 powers of two of shape ``[out]``."""
    w = weight.detach().float()
    scale = power_of_two_scale(w.abs().amax(dim=1))
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q · s`` in ``dtype``, exact in bf16 and fp32 (a power of two times 4 significant bits): one cast, one
    multiply by the scale (in ``dtype``: a power of two converts exactly)."""
    return q.to(dtype) * scale.to(dtype)[:, None]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _Fp8LinearFn(torch.autograd.Function):
    """``x @ (q·s)ᵀ + b`` that saves the FP8 weight (not a dequantised copy) for backward.

    It saves the stored parameters themselves (``weight_bits``, ``scale_bits``), not float8 views of them:
    block swapping (``memory/block_swap.py``) frees a swapped-out block by re-pointing each parameter's
    ``.data``, which a saved view would keep alive until backward."""

    @staticmethod
    def forward(ctx, x, bits, scale_bits, bias, dtype):
        ctx.save_for_backward(bits, scale_bits)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        ctx.bias_grad = bias is not None and bias.requires_grad
        weight = dequantize_weight(bits.view(FP8_DTYPE), scale_bits.view(torch.float32), dtype)
        return torch.nn.functional.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad_out):
        return linear_input_grad(ctx, grad_out)


def linear_input_grad(ctx, grad_out):
    """The backward of a frozen FP8 linear (``_Fp8LinearFn``, ``fp8_compute._Fp8MatmulFn``): ``dX = dY @ (q·s)``
    with the weight dequantised again in the compute dtype, and the bias's gradient where it trains."""
    bits, scale_bits = ctx.saved_tensors
    g = grad_out.to(ctx.dtype)
    grad_x = None
    if ctx.needs_input_grad[0]:
        weight = dequantize_weight(bits.view(FP8_DTYPE), scale_bits.view(torch.float32), ctx.dtype)
        grad_x = (g @ weight).to(ctx.x_dtype)
    grad_b = g.reshape(-1, g.shape[-1]).sum(0) if ctx.bias_grad else None
    return grad_x, None, None, grad_b, None


class Fp8Linear(torch.nn.Module):
    """A frozen linear layer with float8 e4m3 weights and per-output-channel fp32 scales."""

    def __init__(self, in_features: int, out_features: int, bias: Optional[torch.nn.Parameter],
                 q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_bits = torch.nn.Parameter(q.view(torch.uint8), requires_grad=False)
        self.scale_bits = torch.nn.Parameter(scale.float().view(torch.int32), requires_grad=False)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, device: Optional[torch.device | str] = None) -> "Fp8Linear":
        """Quantise ``linear`` (its weight moved to ``device`` first, default: where it is)."""
        weight = linear.weight.detach()
        if device is not None:
            weight = weight.to(device)
        q, scale = quantize_weight(weight)
        bias = linear.bias
        if bias is not None:
            bias = torch.nn.Parameter(bias.detach().to(weight.device), requires_grad=bias.requires_grad)
        return cls(linear.in_features, linear.out_features, bias, q, scale)

    @property
    def weight(self) -> torch.Tensor:
        """The stored ``float8_e4m3fn`` weight (a view; multiply by :attr:`scale` row-wise)."""
        return self.weight_bits.view(FP8_DTYPE)

    @property
    def scale(self) -> torch.Tensor:
        return self.scale_bits.view(torch.float32)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.weight, self.scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fp8LinearFn.apply(x, self.weight_bits, self.scale_bits, self.bias, compute_dtype(x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, weight=float8_e4m3fn, scale=per-output-channel"


@dataclass
class Fp8Report:
    """What :func:`quantize_linears` did; bytes count the layers' weights (and scales)."""

    layers: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)   # frozen-ness or ``skip`` kept them in full precision
    params: int = 0
    bytes_before: int = 0
    bytes_after: int = 0

    def summary(self) -> str:
        return (f"FP8 base weights: {len(self.layers)} linear layers, {self.params / 1e6:.1f} M weights, "
                f"{self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB; "
                f"{len(self.skipped)} trainable or skipped layer(s) kept in full precision")


def _is_trainable(module: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def quantize_linears(model: torch.nn.Module, skip: Iterable[str] = (), scope: Optional[str] = DEFAULT_SCOPE,
                     device: Optional[torch.device | str] = None, host: Iterable[str] = (),
                     host_device: torch.device | str = "cpu") -> Fp8Report:
    """Replace every frozen ``nn.Linear`` under ``scope`` of ``model`` by :class:`Fp8Linear`, in place.

    ``skip``: module-path prefixes (relative to ``model``; PEFT's ``.base_layer`` ignored) kept
    in full precision. Linears with a trainable parameter and PEFT adapters (``lora_A``,
    ``lora_B``, ...) are always kept. ``scope`` ``None`` = the whole model. ``device``: where
    the FP8 weights are made (quantise a CPU-loaded model straight onto the GPU, one layer at
    a time). ``host``: module-path prefixes (block swapping's swapped blocks) whose layers are quantised on
    ``device`` too, then moved to ``host_device``, one layer at a time (the GPU never holds them all; quantising
    on the CPU took 1.3 s per 18432x3072 layer on 2 threads). Already quantised layers are left alone, so
    calling it twice is harmless.
    """
    skip = [s.rstrip(".") for s in skip]
    host = [h.rstrip(".") for h in host]
    root = model.get_submodule(scope) if scope else model
    prefix = f"{scope}." if scope else ""
    report = Fp8Report()
    todo = []
    for name, module in root.named_modules():
        if type(module) is not torch.nn.Linear:
            continue
        full = prefix + name
        plain = full.replace(".base_layer", "")
        if ".lora_" in f".{full}" or _is_trainable(module) \
                or any(plain == s or plain.startswith(s + ".") for s in skip):
            if ".lora_" not in f".{full}":
                report.skipped.append(full)
            continue
        todo.append((name, full, module))
    for name, full, module in todo:
        new = Fp8Linear.from_linear(module, device)
        if any(full == h or full.startswith(h + ".") for h in host):
            new.to(host_device)
        parent_name, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, child, new)
        report.layers.append(full)
        report.params += module.weight.numel()
        report.bytes_before += module.weight.numel() * module.weight.element_size()
        report.bytes_after += new.weight_bits.numel() + new.scale_bits.numel() * 4
    log.info(report.summary())
    return report


def fp8_layers(model: torch.nn.Module) -> list[str]:
    """Names of the :class:`Fp8Linear` modules in ``model``."""
    return [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
