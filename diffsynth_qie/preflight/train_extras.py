"""What a fake-device training step runs besides forward, backward and the optimizer step (``train_step.py``).

- **ProdigyPlusScheduleFree's own host reads.** The library reads values on the host by design: its step-size
  estimate ``d`` once per step and, when it sets up a parameter's state, whether the parameter is all zero
  (``p.any() > 0``). A GPU run pays those syncs; a fake device has no value to give. :func:`library_host_reads`
  answers them with a stand-in value (1) for reads asked from that library's own frames only; a host read
  from our code, or from any other library, is still an error. Its state, its ``eval()``/``train()`` swaps and
  its step then run on the fake device and are counted like AdamW's.
- **The EMA** (``--ema_decay``): the real :class:`~.ema.LoraEMA` built on the fake device, one update after
  the optimizer step, and its swap into the module for validation (``--validate_with ema|both``).
- **Validation** (``--validate_every``): one held-out sample rendered by the real sampler through the
  training module (``validation.sample_jobs``, as ``Validator.render`` calls it), from host tensors as the
  cache gives them, inside the schedule-free ``eval()`` and the EMA swap exactly as ``validate_step`` does.
  Two sampler steps show the loop (every step runs the same code); the VAE decode and the PNG are left out
  (the decoder loads on the main process only, after the DiT's work, and is not part of the step).
- **``--compile``**: ``compile_blocks`` runs on the DiT as ``qie train`` runs it, with the eager backend, and
  dynamo really compiles the blocks: the fake device's dispatch modes ignore compile internals
  (``fakegpu.ops.CheckingMode``), so dynamo traces each block with its own fake tensors (a device or dtype
  mismatch there is reported at our line) and the compiled graph runs on the fake device, checked and counted.
  The compiled blocks' numbers are checked on the tiny model on the CPU (``tests/test_compile.py``).
"""
from __future__ import annotations

import contextlib
import os
import re
import traceback
from typing import Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

from ..fakegpu.ops import FAKE_DEVICE_FILES, CheckingMode, FakeRunError
from .train_batch import SampleShape

VALIDATION_STEPS = 2  # sampler steps of the check's validation render (each step runs the same code)


class LibraryHostReads(CheckingMode):
    """Host reads of fake device tensors asked from ``packages``' own frames get a stand-in value (1)."""

    def __init__(self, packages: Sequence[str]):
        super().__init__()
        self.dirs = tuple(os.sep + p + os.sep for p in packages)
        self.answered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and self._from_library():
            if any(isinstance(a, FakeTensor) for a in tree_flatten((args, kwargs))[0]):
                self.answered += 1
                return True if args[0].dtype == torch.bool else 1
        try:
            return func(*args, **kwargs)
        except FakeRunError as e:  # name the line that asked, not this mode's
            raise FakeRunError(_reattributed(str(e))) from None

    def _from_library(self) -> bool:
        """The innermost frame outside torch and the fake device's modules is the library's."""
        torch_dir = os.path.dirname(torch.__file__)
        for frame in reversed(traceback.extract_stack()):
            if (frame.filename.startswith(torch_dir) or frame.filename == __file__
                    or frame.filename.endswith(FAKE_DEVICE_FILES)):
                continue
            return any(d in frame.filename for d in self.dirs)
        return False


def _reattributed(message: str) -> str:
    """``message`` naming the innermost frame of this package outside this module and the fake device's."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = [f for f in traceback.extract_stack() if f.filename.startswith(package) and f.filename != __file__
            and not f.filename.endswith(FAKE_DEVICE_FILES)]
    if not ours:
        return message
    where = f"{os.path.relpath(ours[-1].filename, os.path.dirname(package))}:{ours[-1].lineno} ({ours[-1].name})"
    here = re.escape(os.path.relpath(__file__, os.path.dirname(package)))
    return re.sub(here + r":\d+ \(\w+\)", lambda _: where, message, count=1)


def library_host_reads(optimizer_name: str):
    """The stand-in of the module docstring for ``--optimizer prodigy_sf``; a no-op for other optimizers."""
    return LibraryHostReads(("prodigyplus",)) if optimizer_name == "prodigy_sf" else contextlib.nullcontext()


def build_ema(cfg, module):
    """``--ema_decay``'s average of the trainable weights, on their (fake) device; None without it."""
    from ..training.ema import LoraEMA

    return LoraEMA(module, cfg.train.ema_decay) if cfg.train.ema_decay else None


def validation_entry(shape: SampleShape, family, dim: int, lbm: bool):
    """A held-out cache entry of ``shape``, on the host as the cache store loads it (values do not matter)."""
    from ..cache.entry import CacheEntry
    from ..fakegpu.standin21 import slot_mask21

    def lat(h: int, w: int) -> torch.Tensor:
        return torch.zeros(family.latent_channels, *family.latent_size(h, w), dtype=torch.bfloat16)

    extras = {}
    if "pad" in family.prompt_tensors:
        extras = {"pad": slot_mask21([family.latent_size(h, w) for h, w in shape.refs], shape.prompt_tokens)}
    length = len(extras["pad"]) if extras else shape.prompt_tokens
    empty = dict(extras)
    target = lat(shape.height, shape.width)
    return CacheEntry(
        entry_id="check", row_id="check", dataset="check", inverse=False,
        prompt_embs=[torch.zeros(length, dim, dtype=torch.bfloat16)], prompt_masks=[torch.ones(length, dtype=torch.bool)],
        empty_prompt_emb=torch.zeros(length, dim, dtype=torch.bfloat16),
        empty_prompt_mask=torch.ones(length, dtype=torch.bool), target_latents=target,
        edit_latents=[lat(h, w) for h, w in shape.refs], sub_noise=lat(shape.height, shape.width),
        lbm_source_latents=lat(shape.height, shape.width) if lbm else None,
        prompt_extras=[extras], empty_prompt_extras=empty)


def validate_once(cfg, preset, module, optimizer, ema, entry) -> None:
    """``validate_step``'s work on one held-out ``entry``: per ``--validate_with`` tag, the schedule-free average
    (and the EMA) swapped in, the sampler run through the module (in its ``--compute_precision``), swapped back."""
    from ..training.losses.dmd_state import active_adapter
    from ..training.losses.registry import loss_spec
    from ..training.optim import schedule_free_eval
    from ..training.validation import flow_match_jobs, lbm_jobs, output_name, sample_jobs

    t = cfg.train
    device, dtype = module.compute_device_dtype()
    lbm = loss_spec(cfg.loss.loss).bridge
    names = [output_name(0, entry.entry_id)]
    jobs = lbm_jobs([entry], names, cfg.lbm.lbm_sub_target) if lbm else flow_match_jobs([entry], names, dtype)
    which = t.validate_with if ema is not None else "raw"

    def sample(cfg_scale: float) -> None:
        sample_jobs(lambda fn: module(predict=fn), [entry], jobs, lbm=lbm, steps=min(t.validation_steps,
                    VALIDATION_STEPS), cfg=cfg_scale, zero_cond_t=bool(t.zero_cond_t),
                    bridge_noise=cfg.lbm.lbm_bridge_noise, device=device, dtype=dtype, preset=preset.name)

    module.eval()
    if module.teacher_cfg is not None:  # the teacher's panel, every trained adapter off (Validator._teacher_renders)
        with active_adapter(module.dit, None):
            sample(module.teacher_cfg)
    for tag in {"raw": ("",), "ema": ("-ema",), "both": ("", "-ema")}[which]:
        with schedule_free_eval(optimizer), (ema.applied(module) if tag else contextlib.nullcontext()):
            sample(t.validation_cfg_scale)
    module.train()


@contextlib.contextmanager
def compiled(cfg, module, trace: bool = True) -> Iterator[None]:
    """``--compile`` / ``--checkpoint_policy``: the DiT's blocks prepared as ``qie train`` prepares them
    (``training/block_setup.py``), compiled with the eager backend; the graph counts are logged after the step.
    ``trace=False``: not compiled, the blocks checkpointing themselves as compiled ones do (a timing run: the eager
    backend runs the same operators, and tracing costs about half a minute of CPU per depth)."""
    from ..training.block_setup import prepare_blocks

    prepare_blocks(module.dit, cfg.train, backend="eager" if trace else None)
    if not cfg.train.compile or not trace:
        yield
        return
    from ..models.load.compile import log_compile_counts

    try:
        yield
        log_compile_counts(module.dit, "on the fake device")
    finally:
        torch._dynamo.reset()  # (the compiled graphs hold fake tensors)


def rollout_state(fc, cfg, preset, family, module, dtype: torch.dtype):
    """``--loss nft`` on the fake device: its VAE built there and the old policy, with a reward that reads nothing.
    A real reward copies the decoded rollouts to the host once per step: the decodes are counted here, the score
    (host arithmetic) is not, and every rollout is rewarded alike."""
    from ..fakegpu.standin_vl import build_vae
    from ..training.losses.nft import NFTState, nft_config_of
    from .train_batch import DEVICE

    class FakeRewardState(NFTState):
        def score(self, samples, batch):
            for group in samples:
                for x in group:
                    self.decode(x)  # the decode's working set, on the device
            return torch.zeros(sum(int(g.shape[0]) for g in samples))

    vae = build_vae(fc, family, dtype, DEVICE, preset)  # the rollouts are decoded, never encoded
    return FakeRewardState(module.dit, vae.requires_grad_(False), None, nft_config_of(cfg).nft_old_decay,
                           module.declared_schedule())
