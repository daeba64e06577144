"""``QIETrainingModule``: the DiT with LoRA, as the one ``nn.Module`` accelerate/DeepSpeed wrap.

Extends DiffSynth's ``DiffusionTrainingModule`` (its PEFT injection
``add_lora_to_model`` and ``trainable_modules``/``trainable_param_names``). What we do differently from
DiffSynth's Qwen-Image training module: it holds *only* the DiT (phase 2 never loads the encoders), its
``forward`` takes a real batch and returns ``(loss, metrics)`` from the configured
loss (``losses.registry.LOSSES``), and ``zero_cond_t`` comes from the run's config (resolved
from the preset), never from cached inputs. Its forward owns the autocast of ``--compute_precision autocast``
(``precision.py``), and a batch reaches a GPU through pinned memory (``transfer_data_to_device`` copies pageable
memory, which waits for the stream).

LoRA targets are PEFT name suffixes (``to_q`` matches every ``...attn.to_q``); a
target that matches no module is an error, not a silent no-op. The exported LoRA is
``lora/__init__.py``'s canonical format, which DiffSynth's ``pipe.load_lora`` and our
loader both read.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterable, Optional

import torch

from diffsynth.diffusion.training_module import DiffusionTrainingModule

from .config import RunConfig
from .data import TENSOR_KEYS
from .losses.registry import get_loss

log = logging.getLogger(__name__)

ADAPTER = "default"  # PEFT's adapter name, as DiffSynth uses it


def _is_zero3_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def check_fp8_base(config: RunConfig, ds_config: Optional[dict]) -> None:
    """``--fp8_base`` needs whole weights per rank; ZeRO-3 partitions them."""
    stage = (ds_config or {}).get("zero_optimization", {}).get("stage")
    if config.train.fp8_base and stage == 3:
        raise ValueError("--fp8_base cannot be combined with DeepSpeed ZeRO-3 (its parameters are partitioned "
                         "across ranks); use ZeRO-2 or DDP with --fp8_base, or ZeRO-3 without it")


def canonical_param_name(name: str) -> str:
    """A trainable parameter's name in a LoRA file: no ``dit.`` prefix, no PEFT ``base_layer``."""
    if name.startswith("dit."):
        name = name[len("dit."):]
    return name.replace(".base_layer.", ".")


class QIETrainingModule(DiffusionTrainingModule):
    """The DiT with LoRA injected (and optional fully trained modules), everything else frozen.

    ``config`` must be resolved (``RunConfig.resolved(preset)``): targets, alpha and
    ``zero_cond_t`` filled in.
    """

    def __init__(self, dit: torch.nn.Module, config: RunConfig, preset_name: str = ""):
        super().__init__()
        lo = config.lora
        assert lo.lora_alpha is not None and config.train.zero_cond_t is not None, "pass a resolved RunConfig"
        self.config = config
        self.preset_name = preset_name
        self.loss_fn = get_loss(config.loss.loss)
        self.pixel_critic = None  # LBM's --lbm_pixel_loss (frozen VAE + LPIPS, not part of the module's state)
        self.loss_extras: dict = {}  # what a loss's set-up gives its function by keyword (--loss nft: its state)
        self.autocast_dtype: Optional[torch.dtype] = None  # --compute_precision autocast (precision.py); None: none
        dit.requires_grad_(False)
        self.frozen = None  # --frozen_lora: unmerged branches (buffers: no gradient, not in any saved state)
        if lo.frozen_lora:
            from ..lora.frozen import attach_frozen
            from ..models.presets import PRESETS, family_of

            family = family_of(preset_name).name if preset_name in PRESETS else None
            self.frozen = attach_frozen(dit, lo.frozen_lora, lo.frozen_lora_scale, family)
        if lo.lora_rank > 0:
            targets = list(lo.lora_target_modules or [])
            if not targets:
                raise ValueError("--lora_target_modules is empty; name at least one module (e.g. to_q to_k to_v)")
            # DiffSynth turns a one-element list into a bare string, which PEFT reads as a full-name regex
            # ("to_q" would then match nothing); a repeated entry keeps PEFT's suffix matching.
            peft_targets = targets if len(targets) > 1 else targets * 2
            dit = self.add_lora_to_model(dit, target_modules=peft_targets, lora_rank=lo.lora_rank,
                                         lora_alpha=lo.lora_alpha)
            self._check_targets(dit, targets)
        self.dit = dit
        if lo.full_finetune_modules:
            self._unfreeze(lo.full_finetune_modules)
        if lo.lora_checkpoint:
            self.load_lora_checkpoint(lo.lora_checkpoint)
        names = self.trainable_param_names()
        log.info("trainable: %d tensors, %.3f M parameters (%d LoRA modules, rank %d, alpha %g)",
                 len(names), sum(getattr(p, "ds_numel", p.numel()) for p in self.trainable_modules()) / 1e6,
                 len(self.lora_module_names()), lo.lora_rank, lo.lora_alpha)

    # --- construction helpers ------------------------------------------------------
    @staticmethod
    def _check_targets(dit: torch.nn.Module, targets: Iterable[str]) -> None:
        wrapped = [n for n, m in dit.named_modules() if hasattr(m, "lora_A")]
        unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in wrapped)]
        if unmatched:
            raise ValueError(f"LoRA target module(s) {unmatched} match no module of the DiT; check "
                             f"--lora_target_modules (e.g. to_q, img_mlp.net.2, img_in)")

    def _unfreeze(self, modules: Iterable[str]) -> None:
        params = dict(self.dit.named_parameters())
        wrapped = {n for n, m in self.dit.named_modules() if hasattr(m, "lora_A")}
        for prefix in modules:
            chosen = [n for n in params if "lora_" not in n and (n == prefix or n.startswith(prefix + ".")
                                                                  or canonical_param_name(n).startswith(prefix + "."))]
            if not chosen:
                raise ValueError(f"--full_finetune_modules {prefix!r} matches no DiT parameter "
                                 "(give a module path such as norm_out or transformer_blocks.0.img_mod)")
            both = sorted({n.rsplit(".base_layer.", 1)[0] for n in chosen if ".base_layer." in n} & wrapped)
            if both:
                raise ValueError(f"module(s) {both} are both LoRA targets and in --full_finetune_modules; "
                                 "remove them from one of the two lists")
            for n in chosen:
                params[n].requires_grad_(True)

    def quantize_frozen_base(self, device: Optional[torch.device | str] = None, blocks_to_swap: int = 0):
        """``--fp8_base``: store the frozen block linears as FP8 (``memory/fp8.py``), made on ``device``; the
        layers of the ``blocks_to_swap`` swapped blocks are made there too and then kept on the host.

        Called after the LoRA is injected: only PEFT's ``base_layer`` is quantised; adapters and
        ``--full_finetune_modules`` (trainable) stay in full precision. ``--fp8_compute``: the quantised layers
        then multiply in FP8 (``memory/fp8_compute.py``). Returns the report.
        """
        from ..memory.block_swap import swapped_blocks
        from ..memory.fp8 import quantize_linears

        report = quantize_linears(self.dit, skip=self.config.lora.full_finetune_modules or (), device=device,
                                  host=swapped_blocks(self.dit, blocks_to_swap))
        if self.config.train.fp8_compute:
            from ..memory.fp8_compute import enable_fp8_compute

            enable_fp8_compute(self.dit)
        return report

    def upcast_trainable(self, dtype: torch.dtype = torch.float32) -> None:
        """Keep trainable weights in ``dtype`` (fp32 for AdamW states) while the frozen DiT
        stays in its load dtype. Not used under DeepSpeed, which keeps fp32 masters itself."""
        for p in self.trainable_modules():
            p.data = p.data.to(dtype)

    def disable_lora_input_casting(self) -> int:
        """Under autocast, PEFT's cast of each adapted layer's bf16 input to the fp32 LoRA weight's dtype is
        undone at once by autocast, which runs the LoRA matmul in bf16: a full-size copy per adapted layer for
        nothing, in forward and in the checkpoint recompute. Switch it off for good (the recompute runs after
        any context manager would have ended). Returns the number of layers changed."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.dit.modules() if isinstance(m, BaseTunerLayer)]
        for m in layers:
            m.cast_input_dtype_enabled = False
        return len(layers)

    # --- names ---------------------------------------------------------------------
    def lora_module_names(self) -> list[str]:
        """DiT module paths that hold a LoRA (canonical names)."""
        return sorted(n for n, m in self.dit.named_modules() if hasattr(m, "lora_A"))

    def trainable_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    def compute_device_dtype(self) -> tuple[torch.device, torch.dtype]:
        """Where and in which dtype batches go: those of the frozen DiT weights."""
        frozen = [p for p in self.dit.parameters() if not p.requires_grad and p.is_floating_point()]
        p = (frozen or list(self.dit.parameters()))[0]
        return p.device, p.dtype

    # --- LoRA in/out ---------------------------------------------------------------
    def export_lora_state_dict(self, state: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """Trainable tensors with DiT-relative names (``<module>.lora_A.default.weight``,
        full weights as ``<module>.weight``) for ``lora_io.save_lora``.

        ``state`` is a {module parameter name: tensor} dict of the trainable parameters
        (e.g. gathered under ZeRO-3); default: this process's own parameters.
        """
        if state is None:
            state = {n: p.detach() for n, p in self.trainable_named_parameters()}
        trainable = self.trainable_param_names()
        unknown = set(state) - trainable
        assert not unknown, f"not trainable: {sorted(unknown)[:5]}"
        return {canonical_param_name(n): t for n, t in state.items()}

    @property
    def frozen_schedule(self):
        """The schedule validation samples with when it is not the model's own: the loss's own (``--loss dmd``: the
        student's), else the frozen LoRA's declared one."""
        from ..models.presets import PRESETS, family_of
        from .losses.registry import loss_spec

        spec = loss_spec(self.config.loss.loss)
        if spec.schedule is not None and self.preset_name in PRESETS:
            return spec.schedule(self.config, family_of(self.preset_name).name)
        return None if self.frozen is None else self.frozen.schedule

    @property
    def teacher_cfg(self) -> Optional[float]:
        """The CFG the loss's frozen teacher samples at (``--loss dmd``), or None: a loss without a teacher."""
        from ..models.presets import PRESETS, family_of
        from .losses.registry import loss_spec

        spec = loss_spec(self.config.loss.loss)
        if spec.teacher_cfg is None or self.preset_name not in PRESETS:
            return None
        return spec.teacher_cfg(self.config, family_of(self.preset_name))

    def lora_metadata(self) -> dict:
        lo = self.config.lora
        meta = {"rank": lo.lora_rank, "alpha": lo.lora_alpha, "lora_target_modules": list(lo.lora_target_modules or []),
                "preset": self.preset_name, "zero_cond_t": bool(self.config.train.zero_cond_t),
                "full_finetune_modules": list(lo.full_finetune_modules or []),
                # Which objective trained it: the UI and `qie edit` users need to know whether
                # a LoRA is meant for flow-matching or 1–4-step LBM sampling.
                "loss": self.config.loss.loss}
        if self.frozen is not None:  # what it was trained on, and the schedule it was validated with
            meta.update(self.frozen.metadata())
        schedule = self.declared_schedule()
        return {**meta, **(schedule.to_metadata() if schedule is not None else {})}

    def declared_schedule(self):
        """The schedule this run's LoRA declares (``models/samplers/declared.py``): the loss's own (``--loss dmd``:
        the student's), the frozen LoRA's, or a fixed-grid preset's (2.1-turbo) at CFG 1; None for the model's own
        schedule (nothing to declare)."""
        from ..models.presets import PRESETS
        from ..models.samplers.declared import DeclaredSchedule

        if self.frozen_schedule is not None:
            return self.frozen_schedule
        preset = PRESETS.get(self.preset_name)
        if preset is not None and preset.sigmas:
            return DeclaredSchedule(len(preset.sigmas), 1.0, tuple(preset.sigmas), family=preset.family,
                                    line=f"{preset.name} preset")
        return None

    @torch.no_grad()
    def load_lora_checkpoint(self, path: str) -> None:
        """Start from an existing LoRA (any format ``lora_io`` reads): its delta becomes the
        initial value of this run's LoRA. Keys the run cannot hold, or a rank mismatch, are
        errors; modules this run adapts but the file lacks keep their fresh init (logged)."""
        from ..lora import load_lora_state, peft_state_dict

        lo = self.config.lora
        state = load_lora_state(path).resolve(n for n, _ in self.dit.named_modules())
        ranks = state.ranks
        if state.modules and ranks != {lo.lora_rank}:
            raise ValueError(f"--lora_checkpoint {path} has rank {sorted(ranks)}, but --lora_rank is {lo.lora_rank}; "
                             f"pass --lora_rank {sorted(ranks)[0]}")
        wanted = peft_state_dict(state, peft_scale=lo.lora_alpha / lo.lora_rank if lo.lora_rank else 1.0,
                                 adapter_name=ADAPTER)
        own = {canonical_param_name(n): (n, p) for n, p in self.named_parameters() if p.requires_grad}
        extra = sorted(set(wanted) - set(own))
        if extra:
            raise ValueError(f"--lora_checkpoint {path} has {len(extra)} tensor(s) this run does not train "
                             f"(e.g. {extra[:4]}); add their modules to --lora_target_modules / "
                             "--full_finetune_modules or start without the checkpoint")
        for key, value in wanted.items():
            name, param = own[key]
            if _is_zero3_param(param):
                import deepspeed

                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    self._copy_checked(path, key, param, value)
            else:
                self._copy_checked(path, key, param, value)
        missing = sorted(set(own) - set(wanted))
        log.info("initialised %d tensor(s) from %s%s", len(wanted), path,
                 f"; {len(missing)} trainable tensor(s) not in it keep their init" if missing else "")

    @staticmethod
    def _copy_checked(path: str, key: str, param: torch.Tensor, value: torch.Tensor) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"--lora_checkpoint {path}: {key} has shape {tuple(value.shape)}, "
                             f"the model expects {tuple(param.shape)}")
        param.copy_(value.to(device=param.device, dtype=param.dtype))

    # --- forward -------------------------------------------------------------------
    def to_compute(self, batch: dict) -> dict:
        """Move a collated batch's tensors to the DiT's device and dtype (others untouched). Host tensors bound
        for a GPU go through pinned memory and copy without blocking: no stream sync at the step's start."""
        device, dtype = self.compute_device_dtype()
        out = dict(batch)
        for k in TENSOR_KEYS:
            if k in out:
                out[k] = _to_device(out[k], device, dtype)
        return out

    def compute_context(self):
        """What the forward runs under: ``torch.autocast`` with ``--compute_precision autocast``, else nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.compute_device_dtype()[0].type, dtype=self.autocast_dtype)

    def forward(self, batch: Optional[dict] = None, generator: Optional[torch.Generator] = None, *,
                predict: Optional[dict | Callable] = None):
        """``(loss, metrics)`` of the configured loss on ``batch`` (see ``losses/sft.py``).

        With ``predict`` (keyword arguments of ``models.forward.dit_forward`` minus the
        DiT, or a callable ``predict(dit)``) it returns the DiT's velocity predictions
        instead: validation runs the samplers' DiT calls through the same
        wrapped module, so DDP/DeepSpeed hooks (ZeRO-3 parameter gathering) run.
        """
        with self.compute_context():
            return self._forward(batch, generator, predict)

    def _forward(self, batch, generator, predict):
        if callable(predict):
            return predict(self.dit)
        if predict is not None:
            from ..models.qwen_image_edit.forward import dit_forward

            return dit_forward(self.dit, **predict)
        if not batch["target_latents"]:  # an empty micro-batch (a rank with nothing left): a zero loss that
            # reaches every trainable parameter, so DDP / DeepSpeed reduce the same gradients on every rank
            return sum((p.float() * 0).sum() for p in self.trainable_modules()), {}
        extra = dict(self.loss_extras, **({"pixel_critic": self.pixel_critic} if self.pixel_critic is not None else {}))
        return self.loss_fn(self.dit, self.to_compute(batch), self.config, generator, **extra)


def _to_device(data, device: torch.device, dtype: torch.dtype):
    """DiffSynth's ``transfer_data_to_device`` (tensors in lists, tuples and dicts to ``device``, floating ones to
    ``dtype``), with a host tensor bound for CUDA pinned first and copied ``non_blocking``."""
    if isinstance(data, torch.Tensor):
        if device.type == "cuda" and data.device.type == "cpu":
            data = data.pin_memory().to(device, non_blocking=True)
        else:
            data = data.to(device)
        return data.to(dtype) if data.dtype in (torch.float32, torch.float16, torch.bfloat16) else data
    if isinstance(data, (list, tuple)):
        moved = [_to_device(x, device, dtype) for x in data]
        return moved if isinstance(data, list) else tuple(moved)
    if isinstance(data, dict):
        return {k: _to_device(v, device, dtype) for k, v in data.items()}
    return data
