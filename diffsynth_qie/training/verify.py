"""One real training step at full size on a fake CUDA device (``qie plan --verify``, ``qie train``'s preflight).

It runs what ``qie train`` runs for one optimizer step, on the preset's real DiT built on the fake
device (``memory/fake_device.py``): :class:`~.module.QIETrainingModule` with the run's LoRA targets,
the FP8 base as configured, our ``dit_forward`` and the configured loss under bf16
autocast, ``backward`` and the optimizer's step. What it leaves out, and why: the data loader and
accelerate's wrappers (host-side; the DiT sees the same batch dict), DeepSpeed (the engine needs a
process group; ZeRO-2/3 shard what this counts for one process). Block swapping runs with the real
:class:`~..memory.block_swap.BlockSwapper` and its hooks, copying through a stand-in for the CUDA stream
(``memory/fake_device.StandInTransport``): the swapped blocks' host copies take no memory here.

The batch is shaped like a collated cache batch: per sample a target latent ``[16, H/8, W/8]``,
reference latents, a prompt embedding ``[L, 3584]`` (plus the LBM loss's extra latents).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..memory.fake_device import FakeCuda, StandInTransport, backward

log = logging.getLogger(__name__)

DEVICE = "cuda:0"


@dataclass(frozen=True)
class SampleShape:
    """One sample: target size in pixels, the reference images' sizes, prompt tokens."""

    height: int
    width: int
    refs: tuple[tuple[int, int], ...] = ((1024, 1024),)
    prompt_tokens: int = 300

    @property
    def tokens(self) -> int:
        return sum((h // 16) * (w // 16) for h, w in ((self.height, self.width), *self.refs)) + self.prompt_tokens


def batch_shapes(resolution: int, ref_images: int, prompt_tokens: int, batch_size: int,
                 mixed: bool = False) -> tuple[SampleShape, ...]:
    """``batch_size`` samples at ``resolution``²; ``mixed``: every other sample is 4:3 landscape at about
    the same pixel count with a prompt 30 % shorter (a mixed-shape, mixed-length batch)."""
    out = []
    for b in range(batch_size):
        if mixed and b % 2:
            h, w = _snap(resolution * 0.866), _snap(resolution * 1.155)
            out.append(SampleShape(h, w, ((h, w),) * ref_images, max(1, int(prompt_tokens * 0.7))))
        else:
            out.append(SampleShape(resolution, resolution, ((resolution, resolution),) * ref_images, prompt_tokens))
    return tuple(out)


def _snap(x: float, multiple: int = 16) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


@dataclass
class StepReport:
    """Live device bytes of the fake run: after setup, and the peak of each phase."""

    weights: int = 0            # DiT (+ FP8 scales) + LoRA + buffers after setup
    forward_backward_peak: int = 0
    after_backward: int = 0     # weights + gradients
    optimizer_peak: int = 0
    after_step: int = 0         # weights + gradients freed + optimizer state
    seconds: float = 0.0
    loss_dtype: str = ""
    swap_events: list = dataclasses.field(default_factory=list)  # (what, block) of the block swapper, in order
    notes: list = dataclasses.field(default_factory=list)

    @property
    def peak(self) -> int:
        """The peak of a step in steady state: from the second step on, the optimizer's state is alive
        through the forward and backward pass too."""
        return max(self.forward_backward_peak + self.optimizer_state, self.optimizer_peak)

    @property
    def activations(self) -> int:
        """The forward/backward peak above the weights (activations, gradients and workspaces at that moment)."""
        return self.forward_backward_peak - self.weights

    @property
    def optimizer_state(self) -> int:
        return self.after_step - self.weights


def fake_batch(shapes: Sequence[SampleShape], text_dim: int, lbm: bool, dtype: torch.dtype) -> dict:
    """A collated batch on the fake device (values do not exist; only shapes, dtypes and devices)."""
    def lat(h: int, w: int) -> torch.Tensor:
        return torch.empty(16, h // 8, w // 8, device=DEVICE, dtype=dtype)

    batch = {
        "target_latents": [lat(s.height, s.width) for s in shapes],
        "edit_latents": [[lat(h, w) for h, w in s.refs] for s in shapes],
        "prompt_emb": [torch.empty(s.prompt_tokens, text_dim, device=DEVICE, dtype=dtype) for s in shapes],
        "back_mask": [None for _ in shapes],
        "index": list(range(len(shapes))),
    }
    if lbm:
        batch["lbm_source_latents"] = [lat(s.height, s.width) for s in shapes]
        batch["sub_noise"] = [lat(s.height, s.width) for s in shapes]
    return batch


def verify_train_step(cfg, preset, shapes: Sequence[SampleShape], num_layers: Optional[int] = None,
                      dtype: torch.dtype = torch.bfloat16) -> StepReport:
    """Run one optimizer step of ``cfg`` (a resolved ``RunConfig``) on ``preset``'s DiT on the fake device.

    Raises :class:`~..memory.fake_device.FakeRunError` where a GPU run would fail (a device or dtype
    mismatch) or stall (a host read of a device tensor). ``num_layers`` builds a shallower DiT (tests).
    """
    from ..memory.block_swap import BlockSwapper
    from ..memory.census import build_dit
    from .losses.registry import loss_spec
    from .module import QIETrainingModule
    from .optim import build_optimizer

    t0 = time.perf_counter()
    report = StepReport()
    t = cfg.train
    with FakeCuda() as fc:
        torch.manual_seed(t.seed)
        # built on the device (a real load goes through the host first for FP8; the step is what counts);
        # PEFT makes the adapters beside their weights
        with fc.build(dtype, DEVICE):
            dit = build_dit(preset, num_layers)
            module = QIETrainingModule(dit, cfg, preset.name)
        if t.fp8_base:
            module.quantize_frozen_base(DEVICE)
        module.upcast_trainable(torch.float32)  # single process / DDP: fp32 LoRA + optimizer states
        module.disable_lora_input_casting()  # as qie train does under bf16 autocast
        fc.register(module)
        if t.blocks_to_swap:  # the swapped blocks' frozen weights leave the device now
            swapper = BlockSwapper(module.dit, t.blocks_to_swap, DEVICE, transport=StandInTransport(DEVICE, "cpu"),
                                   record_events=True).install()
            report.swap_events = swapper.events
        optimizer = build_optimizer(module.trainable_modules(), cfg.optim)
        report.weights = fc.current_bytes
        text_dim = module.dit.txt_in.in_features
        batch = fake_batch(shapes, text_dim, loss_spec(cfg.loss.loss).bridge, dtype)
        generator = torch.Generator().manual_seed(t.seed)
        with fc.phase("forward + backward"):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = module(batch, generator)
            report.loss_dtype = str(loss.dtype).replace("torch.", "")
            backward(loss)
        del loss, batch
        report.after_backward = fc.current_bytes
        phases = {p.name: p for p in fc.phases}
        report.forward_backward_peak = phases["forward + backward"].peak_bytes
        if cfg.optim.optimizer == "prodigy_sf":
            # ProdigyPlusScheduleFree reads its step-size estimate on the host once per optimizer step (by
            # design, not per micro-batch); a fake device has no value to give it. Its state is counted from
            # its size instead: three fp32 tensors per trainable parameter (memory/plan.py OPTIMIZER_BYTES).
            n = sum(p.numel() for p in module.trainable_modules())
            report.notes.append("prodigy_sf: optimizer step not run on the fake device (host-side d estimate); "
                                "its state is counted as 12 bytes per trainable parameter")
            optimizer.zero_grad(set_to_none=True)
            report.after_step = fc.current_bytes + 12 * n
            report.optimizer_peak = report.after_backward + 12 * n
        else:
            with fc.phase("optimizer step"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            report.after_step = fc.current_bytes
            report.optimizer_peak = fc.phases[-1].peak_bytes
        del module, optimizer, dit
    report.seconds = time.perf_counter() - t0
    return report


PREFLIGHT_BLOCKS = 2  # every block runs the same code: two of them (one to hand over to the next) show it


def preflight(cfg, preset) -> StepReport:
    """``qie train``'s check before a real preset loads: one step of ``cfg`` at full width on a
    :data:`PREFLIGHT_BLOCKS`-block DiT on the fake device. A device/dtype mismatch or a host read of a device
    tensor raises ``ValueError`` naming the operator and our line, in seconds instead of after the load."""
    from ..memory.fake_device import FakeRunError

    t = cfg.train
    shapes = batch_shapes(1024, 1, 300, t.batch_size, mixed=t.batch_size > 1)
    if t.blocks_to_swap:  # the last of the check's blocks is swapped (the first hands over to it)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, blocks_to_swap=1))
    try:
        report = verify_train_step(cfg, preset, shapes, num_layers=PREFLIGHT_BLOCKS)
    except FakeRunError as e:
        raise ValueError(f"preflight (one training step on a fake CUDA device, before loading {preset.name}): {e}; "
                         "pass --no_preflight to skip the check") from None
    log.info("preflight: one training step of %s (full width, %d blocks) on a fake CUDA device passed in %.1f s",
             preset.name, PREFLIGHT_BLOCKS, report.seconds)
    return report
