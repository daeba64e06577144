"""LPIPS (learned perceptual distance) from torchmetrics, loaded without ever downloading.

torchmetrics ships LPIPS's linear layers; its backbone (AlexNet by default) comes
from torchvision's pretrained weights, which torchvision downloads into the torch hub
cache (``$TORCH_HOME/hub/checkpoints/``, default ``~/.cache/torch``) at first use.
Training machines are often offline, and a download attempt there can hang, so the
backbone is loaded only when its file is already in that cache:

- :func:`load_lpips` returns the network, or ``None`` after logging once why not
  (torchmetrics missing, or the backbone file absent, naming the file and how to get it);
- :func:`require_lpips` raises ``ValueError`` instead, for features the user asked for.

To prepare an offline machine, run once where there is internet:
``python -c "import torchvision; torchvision.models.alexnet(weights='DEFAULT')"``
and copy ``~/.cache/torch/hub/checkpoints/alexnet-owt-7be5be79.pth`` to the same
place (or into ``$TORCH_HOME/hub/checkpoints/``).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import torch

log = logging.getLogger(__name__)

Tensor = torch.Tensor

#: LPIPS backbone -> (torchvision model builder, its weights enum)
BACKBONES = {"alex": ("alexnet", "AlexNet_Weights"), "vgg": ("vgg16", "VGG16_Weights"),
             "squeeze": ("squeezenet1_1", "SqueezeNet1_1_Weights")}
_reported: set[str] = set()


def backbone_weights_path(net: str = "alex") -> Path:
    """Where torchvision keeps (and would download) the backbone's pretrained weights."""
    import torchvision

    if net not in BACKBONES:
        raise ValueError(f"unknown LPIPS network {net!r}; choose one of {sorted(BACKBONES)}")
    weights = getattr(torchvision.models, BACKBONES[net][1]).DEFAULT
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(weights.url).path)


def _unavailable(net: str) -> Optional[str]:
    """Why LPIPS cannot be loaded offline, or None when it can."""
    try:
        import torchmetrics.functional.image.lpips  # noqa: F401
    except ImportError:
        return "LPIPS needs torchmetrics: `pip install torchmetrics` (or the project's [train] extra)"
    path = backbone_weights_path(net)
    if not path.is_file():
        return (f"LPIPS backbone weights not found at {path} (nothing is downloaded here); fetch them once with "
                f"`python -c \"import torchvision; torchvision.models.{BACKBONES[net][0]}"
                f"(weights='DEFAULT')\"` on a machine with internet and copy the file there, or set TORCH_HOME")
    return None


def load_lpips(net: str = "alex") -> Optional[torch.nn.Module]:
    """The LPIPS network (eval mode, frozen), or None with one logged line saying why."""
    reason = _unavailable(net)
    if reason is not None:
        if reason not in _reported:
            _reported.add(reason)
            log.warning("skipping LPIPS: %s", reason)
        return None
    return _build(net)


def require_lpips(net: str = "alex") -> torch.nn.Module:
    """The LPIPS network; ``ValueError`` naming the missing package or file when it cannot be loaded."""
    reason = _unavailable(net)
    if reason is not None:
        raise ValueError(reason)
    return _build(net)


def _build(net: str) -> torch.nn.Module:
    from torchmetrics.functional.image.lpips import _NoTrainLpips

    model = _NoTrainLpips(net=net)  # torchvision reads the backbone from the hub cache checked above
    model.requires_grad_(False)
    return model.eval()


def lpips_distance(model: torch.nn.Module, a: Tensor, b: Tensor) -> Tensor:
    """Per-sample LPIPS ``[B]`` between batches ``[B, 3, H, W]`` in [0, 1]; differentiable in both inputs."""
    if a.shape != b.shape or a.ndim != 4 or a.shape[1] != 3:
        raise ValueError(f"LPIPS needs two [B, 3, H, W] batches of one shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    p = next(model.parameters())
    if p.device != a.device or p.dtype != a.dtype:
        model.to(device=a.device, dtype=a.dtype)
    return model(a, b, normalize=True).flatten(1).mean(1)
