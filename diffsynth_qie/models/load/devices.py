"""Which device a command may run on: a real preset is not trained on the CPU by accident, and ``--device``
names a device this machine has."""
from __future__ import annotations

from typing import Mapping, Optional

from ..presets import Preset


def check_device_for(preset: Preset, device, explicit_cpu: bool, flag: str = "--device cpu") -> None:
    """A real preset on the CPU is a mistake unless asked for: the 20 B DiT in fp32 needs 82 GB of host RAM
    and days per epoch. The usual cause is a CUDA build of torch the driver is too old for (torch then sees
    no GPU); say so, and how to fix it."""
    import torch

    if preset.is_tiny or explicit_cpu or str(device).split(":")[0] != "cpu":
        return
    version = torch.version.cuda
    hint = (f"torch {torch.__version__} was built for CUDA {version}; if nvidia-smi lists GPUs, the driver is too "
            "old for it: install a build for your driver, e.g. QIE_TORCH_SPEC='torch==2.14.1 torchvision==0.29.1 "
            "--index-url https://download.pytorch.org/whl/cu128' bash scripts/setup.sh") if version else \
        f"torch {torch.__version__} is a CPU-only build; install a CUDA build"
    raise ValueError(f"{preset.name} would run on the CPU: torch sees no GPU ({hint}); pass {flag} to run on "
                     "the CPU anyway (the real model needs about 82 GB of RAM in fp32 and is very slow there)")


def available_devices() -> list[str]:
    """The device names a device flag accepts on this machine: ``cpu``, and ``cuda`` / ``cuda:N`` per GPU."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu"] + (["cuda"] + [f"cuda:{i}" for i in range(gpus)] if gpus else [])


def check_device_name(device: str | None, flag: str = "--device") -> None:
    """A device flag's value (``flag``): ``cpu``, ``cuda`` or ``cuda:N`` of a GPU this machine has (None: the
    default). Checked before anything loads: torch's own error would come after the model has loaded."""
    if device is None:
        return
    valid = available_devices()
    if str(device) not in valid:
        raise ValueError(f"{flag} {device} is not a device of this machine; choose one of {', '.join(valid)}"
                         + ("" if len(valid) > 1 else " (torch sees no GPU)"))


def check_device_flags(values: Mapping[str, Optional[str]]) -> None:
    """Every device flag of a command (flag -> value), each as :func:`check_device_name`."""
    for flag, value in values.items():
        check_device_name(value, flag)
