"""One real training step at full size on a fake CUDA device (``qie plan --verify``, ``qie train``'s preflight).

It runs what ``qie train`` runs for one optimizer step, for any model family, on the preset's real DiT built on
the fake device (``fakegpu/device.py``), with the family's stand-in for host bookkeeping its DiffSynth DiT
does (``Family.fake_standin``; Qwen-Image-2.1: ``fakegpu/standin21.py``): the training module as ``qie train``
builds it (``training/placement.training_module``: the run's LoRA targets, the FP8 base as configured,
``--compute_precision``), the family's forward and the configured loss in bf16 (with ``--mask_loss_weights``, on
masked samples), ``backward``, the optimizer's step (ProdigyPlusScheduleFree
included, ``train_extras.py``), the EMA's update, and with ``--validate_every`` one validation render (the EMA
swapped in as ``--validate_with`` asks). ``--compile`` compiles the blocks with the eager backend. Block swapping
runs with the real :class:`~..memory.block_swap.BlockSwapper`, its hooks and its CUDA transport, on the fake
device's modelled streams and events (a copy used before its event is waited for is an error): the swapped
blocks' pinned host copies take no memory here (they are counted).

What it leaves out, and why: the data loader and accelerate's wrappers (host-side; the DiT sees the same batch
dict) and DeepSpeed (the engine needs a process group; ZeRO-2/3 shard what this counts for one process).
With ``--on_the_fly`` the family's text encoder and VAE are built on the fake device beside the DiT and one
sample is encoded through the real on-the-fly path before the step (``train_onthefly.py``); its transient
counts on top of the step's peak (the encode thread runs beside the step). The batch is
``train_batch.fake_batch``; ``qie train``'s preflight is ``train.py``. With ``steps`` > 1 (the preflight) more steps
follow on other samples, and memory still held after the last beyond the one before is an error
(``train_growth.py``, which also checks where ``--frozen_lora``'s branches sit).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..fakegpu.device import FakeCuda, backward
from .train_batch import DEVICE, SampleShape, batch_shapes, fake_batch, text_dim  # noqa: F401 (public here)
from .train_extras import (build_ema, compiled, library_host_reads, rollout_state, validate_once,
                            validation_entry)
from .train_growth import later_steps

log = logging.getLogger(__name__)


@dataclass
class StepReport:
    """Live device bytes of the fake run: after setup, and the peak of each phase."""

    weights: int = 0            # DiT (+ FP8 scales) + LoRA + buffers (+ the EMA's average, the encoders) after setup
    encoder_weights: int = 0    # --on_the_fly: the text encoder and the VAE encoder on the device (in weights)
    encode_transient: int = 0   # --on_the_fly: one sample's encode above what was live (beside the step on a GPU)
    forward_backward_peak: int = 0
    after_backward: int = 0     # weights + gradients
    optimizer_peak: int = 0
    after_step: int = 0         # weights + gradients freed + optimizer state
    validation_peak: int = 0    # --validate_every: one render (with the EMA's swap), 0 without
    seconds: float = 0.0
    loss_dtype: str = ""
    swap_events: list = dataclasses.field(default_factory=list)  # (what, block) of the block swapper, in order
    notes: list = dataclasses.field(default_factory=list)
    verdict: object = None      # the preflight's fakegpu.verdict.MemoryVerdict, scaled to the whole DiT
    costs: object = None        # with costs=True: the step's counted kernels (fakegpu.costs.Profile)
    prediction: object = None   # the preflight's predicted step time (preflight.timing.TimePrediction)
    steps: int = 1              # optimizer steps run in the session (the preflight: 3, on other samples)

    @property
    def peak(self) -> int:
        """The peak of a step in steady state: from the second step on, the optimizer's state is alive
        through the forward and backward pass too (and through validation)."""
        step = max(self.forward_backward_peak + self.optimizer_state, self.optimizer_peak, self.validation_peak)
        return step + self.encode_transient

    @property
    def activations(self) -> int:
        """The forward/backward peak above the weights (activations, gradients and workspaces at that moment)."""
        return self.forward_backward_peak - self.weights

    @property
    def optimizer_state(self) -> int:
        return self.after_step - self.weights


STEP_SECTIONS = ("forward", "backward", "optimizer step")  # the counted kernels of one step (not validation)


def verify_train_step(cfg, preset, shapes: Sequence[SampleShape], num_layers: Optional[int] = None,
                      dtype: torch.dtype = torch.bfloat16, encode: bool = True, costs: bool = False,
                      steps: int = 1, trace: bool = True) -> StepReport:
    """Run one optimizer step of ``cfg`` (a resolved ``RunConfig``) on ``preset``'s DiT on the fake device.

    Raises :class:`~..fakegpu.device.FakeRunError` where a GPU run would fail (a device or dtype
    mismatch) or stall (a host read of a device tensor). ``num_layers`` builds a shallower DiT (tests);
    ``encode=False`` leaves ``--on_the_fly``'s encoders out (the preflight builds them in one of its two runs).
    ``costs``: count each kernel's cost (``report.costs``: sections :data:`STEP_SECTIONS` and validation).
    ``steps``: optimizer steps to run, each after the first on other samples and not counted; a
    :class:`~..fakegpu.device.FakeRunError` when the last leaves more device memory held than the one before.
    ``trace=False``: with ``--compile``, the blocks run as compiled ones without being traced (a timing run).
    """
    from .lora_files import first_blocks_file

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qie-verify-") as tmp:
        if cfg.lora.frozen_lora and num_layers is not None:  # the shallower DiT attaches its first blocks' part
            cfg = dataclasses.replace(cfg, lora=dataclasses.replace(
                cfg.lora, frozen_lora=str(first_blocks_file(cfg.lora.frozen_lora, num_layers, tmp))))
        return _verify_train_step(cfg, preset, shapes, num_layers, dtype, encode, t0, costs, steps, trace)


def _verify_train_step(cfg, preset, shapes, num_layers, dtype, encode, t0, costs=False, steps=1,
                       trace: bool = True) -> StepReport:
    from ..memory.block_swap import BlockSwapper
    from ..memory.census import build_dit
    from ..models.presets import family_of
    from ..training.losses.registry import loss_spec
    from ..training.optim import build_optimizer
    from ..training.placement import training_module
    from .train_onthefly import on_the_fly

    report = StepReport()
    t, family, spec = cfg.train, family_of(preset), loss_spec(cfg.loss.loss)
    lbm = spec.bridge
    with FakeCuda(costs=costs) as fc, family.fake_device_standin(), library_host_reads(cfg.optim.optimizer):
        torch.manual_seed(t.seed)
        # built on the device (a real load goes through the host first for FP8; the step is what counts);
        # PEFT makes the adapters beside their weights
        with fc.build(dtype, DEVICE):
            dit = build_dit(preset, num_layers)
            module = training_module(dit, dataclasses.replace(cfg, train=dataclasses.replace(t, blocks_to_swap=0)),
                                     preset.name, DEVICE, dtype)  # single process / DDP, as qie train builds it
        fc.register(module)
        if t.blocks_to_swap:  # the swapped blocks' frozen weights leave the device now
            swapper = BlockSwapper(module.dit, t.blocks_to_swap, DEVICE, record_events=True).install()
            report.swap_events = swapper.events
        optimizer = build_optimizer(module.trainable_modules(), cfg.optim)
        if spec.needs_rollouts:  # --loss nft: the VAE and the old policy, as its set-up gives them
            module.loss_extras["nft"] = rollout_state(fc, cfg, preset, family, module, dtype)
        elif spec.setup is not None and spec.setup_loads_nothing:  # --loss dmd: the fake score's adapter
            spec.setup(module, cfg, preset, DEVICE, dtype, None)
            for state in module.loss_extras.values():  # a backward pass of the loss's own (the fake score's step)
                if hasattr(state, "backward"):
                    state.backward = backward
        ema = build_ema(cfg, module)  # (built after the optimizer, as qie train builds it)
        encoders = on_the_fly(fc, cfg, preset, family, shapes[0], report, encode, dtype)  # (kept to the end)
        report.weights = fc.current_bytes
        dim = text_dim(module.dit)
        masks = cfg.loss.mask_loss_weights is not None  # the masked samples' path (every sample has a mask)
        batch = fake_batch(shapes, family, dim, lbm=lbm, masks=masks, dtype=dtype, pairs=spec.preference,
                           negatives=spec.cfg_pass)
        generator = torch.Generator().manual_seed(t.seed)
        with compiled(cfg, module, trace):
            if t.compile and fc.costs is not None:  # inductor fuses the blocks' elementwise work
                fc.costs.fuse(("forward", "backward"))
            with fc.phase("forward + backward"):
                _section(fc, "forward")
                loss, _ = module(batch, generator)  # under autocast with --compute_precision autocast
                report.loss_dtype = str(loss.dtype).replace("torch.", "")
                _section(fc, "backward")
                backward(loss)
            del loss, batch
            report.after_backward = fc.current_bytes
            report.forward_backward_peak = fc.phases[-1].peak_bytes
            with fc.phase("optimizer step"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if ema is not None:
                    ema.update()
            report.after_step = fc.current_bytes
            report.optimizer_peak = fc.phases[-1].peak_bytes
            if t.validate_every > 0:
                entry = validation_entry(shapes[0], family, dim, lbm)
                with fc.phase("validation"):
                    validate_once(cfg, preset, module, optimizer, ema, entry)
                report.validation_peak = fc.phases[-1].peak_bytes
            report.steps = later_steps(fc, steps, module, optimizer, ema, encoders, shapes, family.size_divisor,
                                       functools.partial(fake_batch, family=family, dim=dim, lbm=lbm, masks=masks,
                                                         dtype=dtype, pairs=spec.preference), generator)
        del module, optimizer, dit, ema, encoders
        report.costs = fc.costs.profile if fc.costs is not None else None
    report.seconds = time.perf_counter() - t0
    return report


def _section(fc, name: str) -> None:
    if fc.costs is not None:
        fc.costs.section = name

