"""Typed configuration of phase-2 training, one small dataclass per area.

``qie train`` turns every field into a flag (``utils/config_cli.py``): the field name *is* the flag name. Values
that depend on other choices (the optimizer's learning rate, the preset's LoRA targets and ``zero_cond_t``)
default to ``None`` and are filled in by :meth:`RunConfig.resolved`; nothing is read back from the cache except
tensors. :attr:`LossConfig.loss` picks a loss from ``losses/registry.py``: its :class:`~.losses.spec.LossSpec`
carries its capabilities and its own config, held by ``RunConfig.<name>`` (``sft``, ``lbm``, ``dpo``, ``nft``, ``dmd``).
The losses import no torch at import time (cheap flags). The flags are checked together, and the defaults that
depend on other choices filled in, by ``config_checks.py``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from ..data.formats import DatasetConfig, FieldNames
from ..data.sampling import SamplingConfig
from ..metrics.judge_config import JudgeConfig
from ..metrics.judge_spec import VAL_JUDGE_HELP, judge_spec_type
from ..models.preset_flags import preset_help, preset_list, preset_type
from ..utils.cli_checks import INT64_MAX
from ..utils.config_cli import cli_help as _help
from .losses.dmd import DMDConfig
from .losses.dpo import DPOConfig
from .losses.lbm import LBMConfig
from .losses.nft import NFTConfig
from .block_setup import checkpoint_blocks_type
from .config_checks import cache_dirs, resolve, validate  # noqa: F401 (cache_dirs, validate: used by callers)
from .losses.registry import loss_help, loss_names
from .losses.sft import SFTConfig
from .onthefly_config import OnTheFlyConfig  # noqa: F401 (part of RunConfig; its own module, as the next)
from .timestep_config import TimestepConfig  # noqa: F401 (part of RunConfig; its own module: timesteps.py reads it)

OptimizerName = Literal["adamw", "prodigy_sf"]
ScheduleName = Literal["constant", "cosine"]
MixedPrecision = Literal["auto", "no", "bf16", "fp16"]

# Per-optimizer defaults applied by OptimConfig.resolved() (None fields only).
OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    # Typical LoRA settings for Qwen-Image (DiffSynth's examples use 1e-4).
    "adamw": {"learning_rate": 1e-4, "weight_decay": 0.01, "betas": (0.9, 0.999), "max_grad_norm": 1.0},
    # ProdigyPlusScheduleFree estimates the step size itself: lr is a multiplier (1.0),
    # no weight decay unless asked, and gradient clipping would defeat its d-estimate.
    "prodigy_sf": {"learning_rate": 1.0, "weight_decay": 0.0, "betas": (0.9, 0.99), "max_grad_norm": 0.0},
}


@dataclass
class LoRAConfig:
    """LoRA on the DiT (PEFT, injected with DiffSynth's add_lora_to_model), optional full fine-tuning."""

    lora_rank: int = field(default=32, metadata=_help(
        "LoRA rank; 0 trains no LoRA (then --full_finetune_modules is required)",
        min=0, max=1 << 16))
    lora_alpha: Optional[float] = field(default=None, metadata=_help(
        "LoRA alpha (scale alpha/rank); default: the rank, i.e. scale 1 as in DiffSynth", min=0))
    lora_target_modules: Optional[list[str]] = field(default=None, metadata=_help(
        "module name suffixes to adapt (PEFT matching); default: the preset's list "
        "(2511 adds img_in, txt_in, proj_out)", metavar="NAME"))
    lora_targets: Optional[Literal["default", "serving"]] = field(default=None, metadata=_help(
        "a named target set instead of --lora_target_modules: serving = only modules every LoRA runtime loads "
        "(ComfyUI, diffusers, musubi, SGLang, vLLM-Omni, Nunchaku; lora/export_targets.py)"))
    export: Optional[str] = field(default=None, metadata=_help(
        "comma-separated `qie export-lora` formats written beside lora.safetensors when training ends "
        "(e.g. comfyui,diffusers), each checked against its runtime's rules when the run starts: a format whose "
        "runtime would not load some trained modules stops the run before step 1 (see --drop_unsupported)",
        metavar="FORMATS"))
    drop_unsupported: bool = field(default=False, metadata=_help(
        "--export: write each format with the modules its runtime loads and leave out the rest (named when the "
        "run starts), as `qie export-lora --drop_unsupported` does"))
    lora_checkpoint: Optional[str] = field(default=None, metadata=_help(
        "start from this LoRA file (any format qie edit --lora reads); its rank must equal --lora_rank",
        metavar="FILE"))
    full_finetune_modules: Optional[list[str]] = field(default=None, metadata=_help(
        "DiT modules trained fully (dotted paths or prefixes, e.g. norm_out time_text_embed); "
        "saved as full weights inside lora.safetensors", metavar="MODULE"))
    frozen_lora: Optional[str] = field(default=None, metadata=_help(
        "train on top of this LoRA (e.g. a turbo or Lightning LoRA), attached unmerged and frozen; validation "
        "samples with its declared schedule, and the trained LoRA records it (qie edit offers to stack them)",
        metavar="FILE"))
    frozen_lora_scale: float = field(default=1.0, metadata=_help("scale of --frozen_lora", min=-100, max=100))


@dataclass
class OptimConfig:
    """Optimizer, learning-rate schedule and gradient clipping."""

    optimizer: Optional[OptimizerName] = field(default=None, metadata=_help(
        "adamw, or prodigy_sf (ProdigyPlusScheduleFree: lr 1.0, no clipping, eval()/train() around saves); "
        "default: prodigy_sf with --loss lbm, else adamw"))
    learning_rate: Optional[float] = field(default=None, metadata=_help(
        "peak learning rate; default 1e-4 for adamw, 1.0 for prodigy_sf", min=0))
    weight_decay: Optional[float] = field(default=None, metadata=_help(
        "default 0.01 for adamw, 0 for prodigy_sf", min=0))
    betas: Optional[tuple[float, float]] = field(default=None, metadata=_help(
        "beta1 beta2; default 0.9 0.999 for adamw, 0.9 0.99 for prodigy_sf", metavar="BETA", unbounded=True))
    warmup_steps: int = field(default=0, metadata=_help("linear warmup over this many optimizer steps", min=0))
    lr_schedule: ScheduleName = field(default="constant", metadata=_help("after warmup: constant or cosine decay"))
    min_lr_ratio: float = field(default=0.0, metadata=_help(
        "cosine: final learning rate as a fraction of the peak", min=0, max=1))
    max_grad_norm: Optional[float] = field(default=None, metadata=_help(
        "clip the gradient norm (0 = off); default 1.0 for adamw, 0 for prodigy_sf (which refuses clipping). "
        "Under DeepSpeed it is written into the config's gradient_clipping (\"auto\" there)", min=0))

    def resolved(self) -> "OptimConfig":
        """A copy with every ``None`` replaced by the optimizer's default."""
        optimizer = self.optimizer or "adamw"  # RunConfig.resolved picks it by loss first
        defaults = OPTIMIZER_DEFAULTS[optimizer]
        values = {k: (getattr(self, k) if getattr(self, k) is not None else v) for k, v in defaults.items()}
        values["optimizer"] = optimizer
        values["betas"] = tuple(values["betas"])
        return dataclasses.replace(self, **values)


@dataclass
class LossConfig:
    """Which loss, and how samples and pixels are weighted."""

    loss: str = field(default="sft", metadata=_help(loss_help(), choices=loss_names))
    loss_weighting: Literal["diffsynth", "none"] = field(default="diffsynth", metadata=_help(
        "per-sample weight of the loss by σ: DiffSynth's bell-shaped training_weight, or none (1)"))
    mask_loss_weights: Optional[tuple[float, float]] = field(default=None, metadata=_help(
        "INSIDE OUTSIDE: weights of the loss inside/outside the row's back_mask (edit region), "
        "normalised per sample so the mask's size does not change the loss scale; rows without a "
        "mask are unweighted", metavar="W", unbounded=True))


@dataclass
class TrainConfig:
    """Run: data, model, batch, precision, schedule of saves/validation/logging."""

    cache_dir: Optional[list[str]] = field(default=None, metadata=_help(
        "phase-1 cache(s) made by `qie cache --cache_dir`. Several directories are concatenated, each its "
        "own dataset (cache each metadata file into its own directory); a dataset's name is the one `qie "
        "cache` recorded (--dataset_name, default: the metadata file's directory name), or give it here as "
        "NAME=DIR. --dataset_weights refers to these names; held-out validation entries come from the "
        "first directory", metavar="[NAME=]DIR"))
    output_dir: Optional[str] = field(default=None, metadata=_help(
        "where checkpoints, lora.safetensors, loss.jsonl and validation images go", metavar="DIR"))
    model: str = field(default="2511", metadata=_help(preset_help(), type=preset_type(), metavar="PRESET"))
    model_dir: Optional[str] = field(default=None, metadata=_help(
        "local model directory (the preset's repo layout); only the DiT is loaded", metavar="DIR"))
    zero_cond_t: Optional[bool] = field(default=None, metadata=_help(
        f"{preset_list(lambda p: p.zero_cond_t)}'s zero-timestep modulation of reference tokens; default: the "
        "preset's value (never the cache's)"))
    batch_size: int = field(default=1, metadata=_help(
        "samples per micro-batch per process (bucketed by image layout, mixed shapes are padded; see "
        "--bucket_policy); with --max_tokens_per_batch a token budget sets the batch sizes instead",
        min=1, max=1 << 16))
    gradient_accumulation_steps: int = field(default=1, metadata=_help(
        "micro-batches per optimizer step", min=1, max=1 << 16))
    max_steps: int = field(default=0, metadata=_help("optimizer steps to train; 0 = use --num_epochs", min=0))
    num_epochs: int = field(default=1, metadata=_help("passes over the cache when --max_steps is 0", min=1))
    mixed_precision: MixedPrecision = field(default="auto", metadata=_help(
        "auto = bf16 on GPU, no (fp32) on CPU; under accelerate launch the launcher's setting wins"))
    compute_precision: Literal["auto", "pure", "autocast"] = field(default="auto", metadata=_help(
        "with mixed precision, how the DiT computes: pure = in bf16 without autocast, as at inference, over fp32 "
        "LoRA weights cast per call (faster); autocast = torch autocast (norms and modulation in fp32, as before); "
        "auto = pure with bf16, autocast with fp16. No effect in fp32 or under DeepSpeed (docs/DIFFSYNTH_NOTES.md)"))
    gradient_checkpointing: bool = field(default=True, metadata=_help("recompute DiT blocks in backward (saves memory)"))
    checkpoint_policy: Literal["full", "selective"] = field(default="full", metadata=_help(
        "with --gradient_checkpointing, what a block recomputes in backward: full = everything (least memory); "
        "selective = keep the large GEMMs' and attention's outputs, recompute the cheap elementwise work and the "
        "LoRA's thin GEMMs (faster, more memory: qie plan counts it). The blocks checkpoint themselves, inside "
        "the compiled region with --compile (docs/SPEED.md). Not with --blocks_to_swap"))
    checkpoint_blocks: Optional[Union[int, Literal["auto"]]] = field(default=None, metadata=_help(
        "with --gradient_checkpointing, how many DiT blocks recompute (the first N; the others keep everything: "
        "faster, more memory); auto = the fewest whose planned peak fits the GPU (--gpu_memory_gb, else the "
        "visible one; all without a GPU); default: all. Not with --blocks_to_swap (docs/MEMORY.md)",
        metavar="N|auto", type=checkpoint_blocks_type))
    fp8_base: bool = field(default=False, metadata=_help(
        "store the frozen DiT block linears as float8 e4m3 with a scale per output channel (half the "
        "memory of a bf16 base; compute stays bf16/fp32; LoRA and --full_finetune_modules stay full "
        "precision). Not with DeepSpeed ZeRO-3"))
    fp8_compute: bool = field(default=False, metadata=_help(
        "multiply the FP8 base's frozen linears in FP8 on the tensor cores (torch._scaled_mm, row-wise scales: the "
        "stored e4m3 weights, the activations quantised per row); implies --fp8_base; LoRA stays bf16 on top, the "
        "backward through the base is bf16. Needs a GPU with FP8 (compute capability 8.9+: L40S, RTX 4090, H100, "
        "H200); the CPU runs an fp32 emulation (docs/SPEED.md)"))
    blocks_to_swap: int = field(default=0, metadata=_help(
        "keep this many DiT blocks (the last ones) in pinned CPU memory and stream each to the GPU just before "
        "it runs, forward and backward; 1..number of blocks (60 for the real DiT, ~0.68 GB bf16 each), "
        "0 = off. Not under DeepSpeed (docs/MEMORY.md)", min=0, max=1 << 10))
    cfg_dropout: float = field(default=0.1, metadata=_help(
        "probability per sample of training with the cached empty-prompt embedding", min=0, max=1))
    save_every: int = field(default=500, metadata=_help(
        "checkpoint every N optimizer steps (0 = only at the end)", min=0))
    keep_last: int = field(default=3, metadata=_help("keep the newest N checkpoints (0 = keep all)", min=0))
    validate_every: int = field(default=0, metadata=_help("render held-out edits every N steps (0 = off)", min=0))
    ema_decay: float = field(default=0.0, metadata=_help(
        "keep an exponential moving average of the trainable weights (e.g. 0.999), saved as lora_ema.safetensors "
        "and in checkpoints; 0 = off", min=0.0, max=0.999999))
    validate_with: Literal["raw", "ema", "both"] = field(default="raw", metadata=_help(
        "render validation with the trained weights, their EMA (--ema_decay), or both"))
    num_validation: int = field(default=2, metadata=_help(
        "cache entries held out of training for validation (only when --validate_every > 0)", min=0))
    validation_steps: int = field(default=8, metadata=_help("sampler steps per validation image", min=1, max=10000))
    validation_cfg_scale: float = field(default=1.0, metadata=_help(
        "classifier-free guidance at validation (1 = off; >1 adds one forward with the empty prompt)", min=0, max=100))
    val_judge: Optional[str] = field(default=None, metadata=_help(VAL_JUDGE_HELP, metavar="SPEC", type=judge_spec_type))
    seed: int = field(default=0, metadata=_help(
        "seed of LoRA init, data order, dropout, noise and σ", min=0, max=INT64_MAX))
    resume: Optional[str] = field(default=None, metadata=_help(
        "continue from a checkpoint directory, or 'latest' in --output_dir", metavar="PATH|latest"))
    log_every: int = field(default=1, metadata=_help("write loss.jsonl / WandB every N optimizer steps", min=1))
    report_to: Literal["none", "wandb"] = field(default="none", metadata=_help(
        "also log to WandB (honours WANDB_PROJECT, WANDB_NAME, WANDB_MODE); loss.jsonl is always written"))
    num_workers: int = field(default=0, metadata=_help(
        "DataLoader worker processes reading the cache", min=0, max=1024))
    device: Optional[Literal["cpu", "cuda"]] = field(default=None, metadata=_help(
        "cpu forces CPU training even with a GPU present (default: accelerate's choice: this rank's GPU, else CPU)"))
    compile: bool = field(default=False, metadata=_help(
        "torch.compile each DiT block (regional: one compile for all blocks, per shape); faster steps on a GPU "
        "after a compile of about a minute"))
    no_preflight: bool = field(default=False, metadata=_help(
        "skip the preflight: before a real preset's weights load, one training step of this configuration "
        "runs on a fake CUDA device (full width, 1 and 2 blocks, no memory; seconds) and fails on any device/"
        "dtype mismatch or host sync, or when its peak memory, scaled to the whole DiT, exceeds the GPU"))
    gpu_memory_gb: Optional[float] = field(default=None, metadata=_help(
        "GPU memory the preflight judges the step's peak against (default: the visible GPU's; none without a "
        "GPU)", min=0))


@dataclass
class RunConfig:
    """Everything `qie train` needs: the area configs side by side."""

    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    timesteps: TimestepConfig = field(default_factory=TimestepConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    # Bucketing / weighted sampling. Its batch_size and seed are always TrainConfig's (copied by resolved()).
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # each registered loss's own config, named after it (losses/registry.py)
    sft: SFTConfig = field(default_factory=SFTConfig)  # used with --loss sft
    lbm: LBMConfig = field(default_factory=LBMConfig)  # used with --loss lbm
    dpo: DPOConfig = field(default_factory=DPOConfig)  # used with --loss dpo
    nft: NFTConfig = field(default_factory=NFTConfig)  # used with --loss nft
    dmd: DMDConfig = field(default_factory=DMDConfig)  # used with --loss dmd
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # how --val_judge and --reward_judge are asked
    onthefly: OnTheFlyConfig = field(default_factory=OnTheFlyConfig)  # --on_the_fly, with the two below
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    fields: FieldNames = field(default_factory=FieldNames)

    def resolved(self, preset=None) -> "RunConfig":
        """Check values and fill the defaults that depend on other choices (``config_checks.resolve``).

        ``preset`` (``models.presets.Preset``) supplies the LoRA targets and
        ``zero_cond_t`` when they are not set explicitly.
        """
        return resolve(self, preset)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
