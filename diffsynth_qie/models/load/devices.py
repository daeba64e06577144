"""Which device a command may run on: a real preset is not trained on the CPU by accident, and ``--device``
names a device this machine has."""
from __future__ import annotations

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


def check_device_name(device: str | None) -> None:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N`` of a GPU this machine has (None: the default)."""
    if device is None:
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    valid = ["cpu"] + (["cuda"] + [f"cuda:{i}" for i in range(gpus)] if gpus else [])
    if str(device) not in valid:
        raise ValueError(f"--device {device} is not a device of this machine; choose one of {', '.join(valid)}"
                         + ("" if gpus else " (torch sees no GPU)"))
