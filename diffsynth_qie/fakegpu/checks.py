"""What the CUDA kernels check and the meta kernels do not: operand dtypes, generator devices, host syncs.

Each function returns what is wrong (``None`` when the call is legal); ``ops.py`` raises it as a
:class:`~.fake_ops.FakeRunError` naming the operator, our line and the fix.

- **dtypes.** cuBLAS matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``; ``linear`` and ``matmul`` reach them)
  take one floating dtype for every operand, and no FP8 (only ``_scaled_mm`` does); the fused attention
  kernels take one dtype for q, k and v. ``torch.autocast`` casts before the operator reaches the fake device
  (the matmuls by PyTorch's autocast itself, attention by ``fake_ops.FusedAttention``), so mixed inputs under
  autocast arrive agreeing, as on a GPU.
- **Generators.** A ``generator=`` must live on the device of the tensor it fills ("Expected a 'cuda' device
  type for generator but found 'cpu'").
- **Device to host.** A copy of a device tensor to the host (``.cpu()``, ``.to("cpu")``, ``copy_`` into a
  host tensor, ``torch.tensor([device scalars])``) waits for the device: inside a verified phase (a
  ``FakeCuda.phase``) it is a host sync. A copy into pinned host memory is the deliberate offload path
  (block swapping's host masters) and is not one; reading values (``.item()``, ``.tolist()``, ``.numpy()``,
  ``if tensor:``) is refused everywhere, since the fake device has no values to give.
"""
from __future__ import annotations

from typing import Optional

import torch

aten = torch.ops.aten

MATMULS = {aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm, aten.baddbmm_, aten.matmul, aten.linear,
           aten.addmv, aten.mv, aten.dot}
ATTENTION = {aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
             aten._scaled_dot_product_cudnn_attention, aten._flash_attention_forward,
             aten._efficient_attention_forward}
FP8 = {getattr(torch, name) for name in dir(torch) if name.startswith("float8_")}

DTYPE_HINT = ("cast one operand (an adapter's input: x.to(weight.dtype)), or run under "
              "torch.autocast('cuda', dtype=torch.bfloat16)")


def op_leaves(*trees) -> list:
    """The leaves of an operator's ``(args, kwargs)`` or of its output, in ``tree_flatten``'s order. Operator
    schemas nest only lists and tuples (``Tensor[]``, ``int[]``) in positional arguments and a kwargs dict, so a
    plain walk does what the general pytree flatten does, several times faster: it runs on every operator of the
    fake device, twice."""
    out: list = []
    stack = list(reversed(trees))
    while stack:
        node = stack.pop()
        if type(node) in (list, tuple):
            stack.extend(reversed(node))
        elif type(node) is dict:
            stack.extend(reversed(list(node.values())))
        else:
            out.append(node)
    return out


def _floating(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.dtype in FP8)]


def operand_dtypes(func, args) -> Optional[tuple[str, str]]:
    """Why a matmul's or a fused attention kernel's operands would be refused on a GPU (a message starting
    with what is wrong, the operator next), or None."""
    packet = func.overloadpacket
    if packet in MATMULS:
        tensors = _floating(args)
        fp8 = [t.dtype for t in tensors if t.dtype in FP8]
        if fp8:
            return (f"dtype: an FP8 ({fp8[0]}) operand in {func}", "only torch._scaled_mm multiplies FP8: "
                    "dequantise the weight first (memory/fp8.py's Fp8Linear does)")
        dtypes = [t.dtype for t in tensors]
        if len(set(dtypes)) > 1:
            return (f"dtype mismatch in {func}", f"operands are {', '.join(str(d) for d in dtypes)} (a GPU "
                    f"raises 'expected mat1 and mat2 to have the same dtype'); {DTYPE_HINT}")
    elif packet in ATTENTION:
        q, k, v = args[:3]
        dtypes = [t.dtype for t in (q, k, v)]
        if len(set(dtypes)) > 1 or dtypes[0] in FP8:
            return (f"dtype mismatch in {func}", f"query, key, value are {', '.join(str(d) for d in dtypes)} "
                    f"(a GPU raises 'Expected query, key, and value to have the same dtype'); {DTYPE_HINT}")
    return None


def _output_device(args, kwargs) -> torch.device:
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.get_default_device()


def generator_device(args, kwargs) -> Optional[str]:
    """Why a call's ``generator=`` cannot fill its output on a GPU, or None (checked before the call runs)."""
    gen = kwargs.get("generator")
    if gen is None or not isinstance(gen, torch._C.Generator):
        return None
    out, have = _output_device(args, kwargs).type, gen.device.type
    if out == have:
        return None
    return (f"generator on the wrong device: a {have} torch.Generator draws for a {out} tensor (a GPU raises "
            f"\"Expected a '{out}' device type for generator but found '{have}'\"); draw on the generator's "
            f"device and move the result (torch.randn(..., generator=g).to(device)), or use "
            f"torch.Generator('{out}')")


def host_copy(func, args, kwargs, pinned) -> Optional[str]:
    """What a device-to-host copy looks like in our code (``.cpu()``...), or None when ``func`` is none;
    ``pinned(tensor)`` says whether a destination is pinned host memory."""
    packet = func.overloadpacket
    if packet is aten._to_copy:
        src, device = args[0], kwargs.get("device")
        if isinstance(src, torch.Tensor) and src.device.type == "cuda" and device is not None \
                and torch.device(device).type == "cpu" and not kwargs.get("pin_memory"):
            return ".cpu() / .to('cpu')"
    elif packet is aten.copy_:
        dst, src = args[0], args[1]
        if isinstance(src, torch.Tensor) and src.device.type == "cuda" and dst.device.type == "cpu" \
                and not pinned(dst):
            return "copy_ into a host tensor"
    return None


def holds_device_tensor(data) -> bool:
    """Whether ``torch.tensor(data)``'s nested lists hold a device tensor (each element is read on the host)."""
    if isinstance(data, torch.Tensor):
        return data.device.type != "cpu"
    if isinstance(data, (list, tuple)):
        return any(holds_device_tensor(d) for d in data)
    return False


def stacked(data, dtype=None, device=None) -> torch.Tensor:
    """``torch.tensor(data)`` of device tensors, as a GPU computes it outside a verified phase (no values)."""
    def build(d):
        if isinstance(d, (list, tuple)):
            return torch.stack([build(x) for x in d])
        return d if isinstance(d, torch.Tensor) else torch.tensor(d)

    out = build(data)
    return out.to(device=device or "cpu", dtype=dtype or out.dtype)
