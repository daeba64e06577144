"""Where the editor's components run: ``--device_map``, the per-component device flags, the dtype."""
from __future__ import annotations

from typing import Mapping, Optional

import torch

COMPONENTS = ("text_encoder", "dit", "vae")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def parse_device_map(spec: str | Mapping[str, str] | None) -> dict[str, str]:
    """``"text_encoder=cuda:1,dit=cuda:0,vae=cuda:0"`` (or a dict) -> validated dict (partial allowed)."""
    if spec is None or spec == "":
        return {}
    if isinstance(spec, str):
        items = {}
        for part in spec.split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise ValueError(f"device_map entry {part!r} is not component=device "
                                 "(e.g. text_encoder=cuda:1,dit=cuda:0,vae=cuda:0)")
            name, dev = (s.strip() for s in part.split("=", 1))
            items[name] = dev
        spec = items
    out = {}
    for name, dev in spec.items():
        if name not in COMPONENTS:
            raise ValueError(f"device_map names unknown component {name!r}; valid: {', '.join(COMPONENTS)}")
        try:
            device = torch.device(dev)
        except RuntimeError as e:
            raise ValueError(f"device_map[{name!r}] = {dev!r} is not a torch device ({e})") from e
        if device.type == "cuda":
            count = torch.cuda.device_count()
            if (device.index or 0) >= count:
                raise ValueError(f"device_map[{name!r}] = {dev!r} but {count} CUDA device(s) are visible")
        out[name] = str(device)
    return out


def device_map_with(spec: str | Mapping[str, str] | None, **devices: Optional[str]) -> dict[str, str]:
    """``--device_map`` plus the per-component flags (``text_encoder=``, ``vae=``, ``dit=``; None = not given).
    A component named both ways with two different devices is refused, naming both."""
    mapping = parse_device_map(spec)
    for name, device in devices.items():
        if device is None:
            continue
        one = parse_device_map({name: device})[name]
        if name in mapping and mapping[name] != one:
            raise ValueError(f"--{name}_device {device} and --device_map's {name}={mapping[name]} disagree; give one")
        mapping[name] = one
    return mapping


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _module_device(module) -> torch.device | None:
    param = next(iter(module.parameters()), None) if module is not None else None
    return param.device if param is not None else None
