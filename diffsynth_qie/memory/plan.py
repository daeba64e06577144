"""Predicted peak GPU memory and host RAM of a training step or an edit: the maths of ``qie plan``.

Pure functions of a :class:`~.census.DiTCensus` (counts taken from the real modules on the
``meta`` device) and :class:`PlanOptions`. Every term, in bytes:

- DiT weights: ``params * b`` (``b`` = 2 for bf16). ``fp8_base`` stores each linear weight in one
  byte (e4m3) plus one fp32 scale per output channel; biases and norms stay in bf16.
  ``blocks_to_swap N`` keeps N blocks in host RAM and adds ``min(N, 2)`` blocks of GPU buffers
  (the running block and the prefetched one). ZeRO-3 keeps ``1/num_gpus`` of the weights plus two
  gathered blocks.
- LoRA: ``r * sum(in + out)`` over the targeted linears, at 16 bytes per parameter with AdamW
  (fp32 weight, gradient and two moments; 20 with ``prodigy_sf``'s three states). ZeRO-2 divides
  gradients and optimizer state by ``num_gpus``, ZeRO-3 all of it.
- Activations, per sample of ``T = (H/16)(W/16)(1 + refs) + prompt_tokens`` tokens and model
  width ``d``, in elements of ``b`` bytes:
  without checkpointing ``T * d * (L * (K_BLOCK + n_t * r / d) + K_OUTSIDE)``;
  with checkpointing ``T * d * (L * K_BOUNDARY + K_BLOCK + n_t * r / d + K_OUTSIDE_CKPT)``
  (the saved block inputs plus one block being recomputed), where ``n_t`` is the number of
  LoRA-targeted linears a token passes per block (each keeps its rank-r intermediate).
  The constants are measured, not guessed: see :data:`CALIBRATION`.
- Training with ``--ema_decay``: the EMA shadow, fp32 (4 bytes per trainable parameter, divided by
  ``num_gpus`` under ZeRO-3), and with ``--validate_with ema|both`` the live weights' fp32 copy kept while the
  average is swapped in for validation (whole, also under ZeRO-3).
- Training ``--on_the_fly``: the encoders' weights where they run, and (encoders on the GPU) one image's VAE
  encode working set, the largest encode transient, which the background encode thread runs beside the step.
- Editing with a DiT that caches its prefix (Qwen-Image-2.1): the prefix KV cache, ``num_layers * prefix_tokens
  * 2 (K, V) * width * b`` per prompt, for the positive and (true CFG) the negative prompt; the prefix is the
  prompt's tokens and every reference's latent tokens (0.5 MiB per prefix token and prompt at full size).
- Editing with stacked LoRAs: each one's unmerged branches, ``r_i * sum(in + out) * b``.
- A fixed allowance for the CUDA context and allocator fragmentation.

Host RAM: a process baseline, the swapped blocks (pinned), and about one block while loading (no
process holds the DiT's state dict; the FP8 / swapping host loads map the weight files, whose page cache
is shared by the processes on a machine and shown apart).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from .census import DiTCensus
from .swap_transport import PINNED_EXACT_ABOVE_MB, pinned_allocation_bytes

GiB = 1024 ** 3

from .plan_distill import distill_terms
from .plan_rollouts import rollout_terms
from .plan_terms import (  # noqa: F401 (the constants and per-token terms, public here)
    AUTOCAST_CALIBRATION, CALIBRATION, GPU_CHECKPOINTED_ACTIVATION_SCALE, VAE_BYTES_PER_PIXEL, activation_bytes,
    calibration, checkpointed_label, kv_cache_bytes,
    vae_bytes as _vae_bytes)

OPTIMIZER_BYTES = {"adamw": 16, "prodigy_sf": 20}  # per trainable parameter, weight included
FP8_SCALE_BYTES = 4
CUDA_OVERHEAD = int(1.0 * GiB)  # CUDA context + allocator slack (assumed; not in the tiny runs)
HOST_BASELINE = int(3.0 * GiB)  # Python, torch, CUDA libraries, dataloader (assumed)
DEFAULT_PROMPT_TOKENS = 300


@dataclass(frozen=True)
class PlanOptions:
    task: Literal["train", "edit"] = "train"
    resolution: int = 1024  # side of a square image, pixels
    ref_images: int = 1
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    batch_size: int = 1
    lora_rank: int = 32
    optimizer: Literal["adamw", "prodigy_sf"] = "adamw"
    gradient_checkpointing: bool = False
    checkpoint_policy: Literal["full", "selective"] = "full"  # train: qie train --checkpoint_policy
    checkpoint_blocks: Optional[int] = None  # train: qie train --checkpoint_blocks N (None: every block)
    compile: bool = False  # train: qie train --compile (kernels fused; memory as eager)
    fp8_base: bool = False
    fp8_compute: bool = False  # the FP8 base multiplied in FP8: the same memory as fp8_base (which it implies)
    blocks_to_swap: int = 0
    zero_stage: int = 0
    num_gpus: int = 1
    cfg: bool = True  # edit: true CFG adds a pass with the negative prompt
    on_the_fly: bool = False  # train: the encoders run beside the DiT (qie train --on_the_fly)
    text_encoder_on_gpu: bool = True  # edit / --on_the_fly: False = on the host (--text_encoder_device cpu)
    vae_on_gpu: bool = True
    ema: bool = False  # train: --ema_decay D (an fp32 average of the trainable weights)
    compute_precision: Literal["auto", "pure", "autocast"] = "auto"  # train: qie train --compute_precision
    validate_with: Literal["raw", "ema", "both"] = "raw"  # train: ema/both keep a copy while validating
    loras: tuple[int, ...] = ()  # edit: the ranks of stacked LoRAs (default: one of lora_rank, if any)
    kv_cache: Literal["on", "off"] = "on"  # edit, a DiT with a prefix KV cache: kept on the GPU, or recomputed
    dtype_bytes: int = 2  # bf16 on GPUs; the CPU calibration runs fp32 (4)
    pairs: bool = False  # train, a preference loss (--loss dpo): chosen + rejected per row, and a reference pass
    rollouts: int = 0  # train, --loss nft: K rollouts per source trained on (memory/plan_rollouts.py)
    distill: bool = False  # train, --loss dmd: teacher branches, the fake score and its step (memory/plan_distill.py)
    overhead_bytes: int = CUDA_OVERHEAD

    def __post_init__(self):
        if self.fp8_compute:  # FP8 compute multiplies the FP8 base's weights
            object.__setattr__(self, "fp8_base", True)

    def validate(self, census: DiTCensus) -> None:
        if self.resolution % 16 or self.resolution <= 0:
            raise ValueError(f"--resolution {self.resolution} must be a positive multiple of 16")
        if not 0 <= self.blocks_to_swap <= census.num_layers:
            raise ValueError(f"--blocks_to_swap {self.blocks_to_swap} must be in 0..{census.num_layers}")
        if self.zero_stage not in (0, 2, 3):
            raise ValueError(f"--zero_stage {self.zero_stage}: use 0 (none), 2 or 3")
        if self.num_gpus < 1 or self.batch_size < 1 or self.ref_images < 0 or self.lora_rank < 0:
            raise ValueError("--num_gpus and --batch_size must be >= 1, --ref_images and --lora_rank >= 0")
        # the same combinations `qie train` refuses (training/placement.py, module.check_fp8_base)
        if self.zero_stage and self.blocks_to_swap:
            raise ValueError(f"--blocks_to_swap cannot be combined with --zero_stage {self.zero_stage} (block swapping "
                             "runs without DeepSpeed); use one or the other")
        if self.zero_stage == 3 and self.fp8_base:
            raise ValueError("--fp8_base cannot be combined with --zero_stage 3 (partitioned weights); use one or the other")
        if self.task == "edit" and self.zero_stage:
            raise ValueError("--zero_stage applies to training only; drop it with --task edit")
        if self.validate_with != "raw" and not self.ema:
            raise ValueError(f"--validate_with {self.validate_with} needs --ema_decay (an average to validate)")
        if self.checkpoint_blocks is not None and not 0 <= self.checkpoint_blocks <= census.num_layers:
            raise ValueError(f"--checkpoint_blocks {self.checkpoint_blocks} must be in 0..{census.num_layers}")
        if any(r < 1 for r in self.loras):
            raise ValueError(f"--loras {' '.join(map(str, self.loras))}: every rank must be >= 1")

    @property
    def lora_ranks(self) -> tuple[int, ...]:
        """Edit: the ranks of the LoRAs attached (unmerged)."""
        return self.loras or ((self.lora_rank,) if self.lora_rank else ())

    @property
    def prefix_tokens(self) -> int:
        """A prompt's prefix for a DiT that caches it: the prompt's tokens and every reference's latent tokens."""
        return (self.resolution // 16) ** 2 * self.ref_images + self.prompt_tokens

    @property
    def tokens(self) -> int:
        """Tokens of one sample: target + references + prompt."""
        return (self.resolution // 16) ** 2 * (1 + self.ref_images) + self.prompt_tokens


@dataclass
class Plan:
    options: PlanOptions
    gpu: dict[str, int] = field(default_factory=dict)  # component -> bytes per GPU
    host: dict[str, int] = field(default_factory=dict)  # component -> bytes per process
    shared: dict[str, int] = field(default_factory=dict)  # page cache per machine (shared, reclaimable)

    @property
    def gpu_peak(self) -> int:
        return sum(self.gpu.values())

    @property
    def host_peak(self) -> int:
        return sum(self.host.values())


def dit_weight_bytes(c: DiTCensus, o: PlanOptions) -> tuple[int, int]:
    """(all DiT weights, one block) in bytes, FP8 or not."""
    if not o.fp8_base:
        return c.params * o.dtype_bytes, c.block_params * o.dtype_bytes
    total = ((c.params - c.linear_weight_params) * o.dtype_bytes + c.linear_weight_params
             + c.linear_out_features * FP8_SCALE_BYTES)
    return total, round(c.block_params * total / c.params)


def lora_bytes(c: DiTCensus, o: PlanOptions) -> tuple[int, int]:
    """(trainable weights, gradients + optimizer state) per GPU."""
    n = c.lora_params(o.lora_rank)
    weights = 4 * n
    rest = (OPTIMIZER_BYTES[o.optimizer] - 4) * n
    if o.zero_stage >= 2:
        rest //= o.num_gpus
    if o.zero_stage == 3:
        weights //= o.num_gpus
    return weights, rest


def predict(c: DiTCensus, o: PlanOptions) -> Plan:
    """The predicted per-GPU and per-process memory of ``o`` on the model ``c``."""
    o.validate(c)
    plan = Plan(o)
    weights, block = dit_weight_bytes(c, o)
    if o.zero_stage == 3:
        plan.gpu["DiT weights (1/num_gpus + 2 gathered blocks)"] = weights // o.num_gpus + 2 * block
    else:
        swapped = o.blocks_to_swap * block
        plan.gpu["DiT weights" + (f" ({o.blocks_to_swap} blocks in host RAM)" if swapped else "")] = weights - swapped
        if swapped:
            # inference: the running block and the prefetched one; training also keeps the last block in for
            # the backward pass (memory/block_swap.py)
            plan.gpu["block swap buffers"] = min(o.blocks_to_swap, 3 if o.task == "train" else 2) * block
            # one pinned buffer per block, exact-size while swapping (memory/swap_transport.py)
            plan.host["swapped blocks (pinned)"] = o.blocks_to_swap * pinned_allocation_bytes(
                block, exact_above=PINNED_EXACT_ABOVE_MB << 20)
    if o.task == "train":
        lw, rest = lora_bytes(c, o)
        plan.gpu["LoRA weights"] = lw
        plan.gpu["LoRA gradients + optimizer state"] = rest
        plan.gpu["activations" + checkpointed_label(c, o)] = activation_bytes(c, o)
        if o.pairs:  # the reference (LoRA off, no graph) after the policy's forward: one block's working set
            plan.gpu["reference forward (no graph)"] = round(2 * o.batch_size * o.tokens * c.dim * calibration(o)["K_BLOCK"]
                                                             * o.dtype_bytes)
        if o.rollouts:  # --loss nft
            rollout_terms(plan, c, o)
        if o.distill:  # --loss dmd
            distill_terms(plan, c, o)
        if o.ema:
            plan.gpu["EMA shadow (fp32)"] = 4 * c.lora_params(o.lora_rank) // (o.num_gpus if o.zero_stage == 3 else 1)
            if o.validate_with != "raw":  # LoraEMA.applied: the live weights' copy while the average is in
                plan.gpu["EMA validation copy of the LoRA (fp32)"] = 4 * c.lora_params(o.lora_rank)
        if o.on_the_fly:  # the encoders' weights where they run, and the encode thread's working set
            _place_encoders(plan, c, o, "on the fly: ")
            if o.vae_on_gpu:
                plan.gpu["on the fly: encode working set (one image, VAE)"] = _vae_bytes(o, 1)
    else:
        # true CFG: on a GPU the positive and the (shorter) negative prompt run as two passes of batch_size
        # (models/samplers/sampling.py: split_cfg), so one pass's working set is what peaks
        batch = o.batch_size
        _place_encoders(plan, c, o)
        for i, rank in enumerate(o.lora_ranks):  # unmerged LoRA branches (qie edit's default), bf16
            name = "LoRA branches" + (f" ({i + 1} of {len(o.lora_ranks)}, rank {rank})" if len(o.lora_ranks) > 1 else "")
            plan.gpu[name] = c.lora_params(rank) * o.dtype_bytes
        kv = kv_cache_bytes(c, o)
        if kv:
            plan.gpu["prefix KV cache" + (" (positive + negative prompt)" if o.cfg else "")] = kv
        # no graph is kept: one block's working set at a time, or the VAE's while it encodes / decodes
        dit = round(batch * o.tokens * c.dim * CALIBRATION["K_INFER"] * o.dtype_bytes)
        vae = _vae_bytes(o, o.batch_size)
        plan.gpu["activations (one block, no grad)"] = dit
        if vae > dit and o.vae_on_gpu:
            plan.gpu[VAE_BEYOND] = vae - dit
    plan.gpu["CUDA context + allocator slack"] = o.overhead_bytes
    plan.host["process baseline"] = HOST_BASELINE
    # no process holds the DiT's state dict: a GPU load reads tensor by tensor, ZeRO-3 streams one tensor at a
    # time, and the FP8 / swapping host loads map the files and finish one layer (one block) at a time
    # (models/load/host_weights.py, training/placement.py)
    plan.host["loading (about one block at a time)"] = block
    if o.fp8_base or o.blocks_to_swap:
        plan.shared["DiT files mapped while loading (page cache)"] = c.params * o.dtype_bytes
    return plan


# the terms of the text encoder and the VAE (weights and working sets): what a run of the DiT part leaves out
VAE_BEYOND = "VAE encode/decode (beyond the DiT's working set)"
ENCODER_TERMS = ("text encoder", "VAE", "on the fly: text encoder", "on the fly: VAE",
                 "on the fly: encode working set (one image, VAE)", VAE_BEYOND)


def _place_encoders(plan: Plan, c: DiTCensus, o: PlanOptions, prefix: str = "") -> None:
    """The text encoder's and the VAE's weights on the GPU or, with their device flag at cpu, in host RAM
    (fp32 there: the CPU runs fp32)."""
    for name, params, on_gpu in (("text encoder", c.text_encoder_params, o.text_encoder_on_gpu),
                                 ("VAE", c.vae_params, o.vae_on_gpu)):
        if on_gpu:
            plan.gpu[prefix + name] = params * o.dtype_bytes
        else:
            plan.host[prefix + name + " (fp32, on the CPU)"] = params * 4


def candidates(c: DiTCensus, base: PlanOptions) -> list[PlanOptions]:
    """Option sets from the least to the most slowdown, never weaker than ``base``'s own choices:
    checkpointing < FP8 < swapping N blocks (N ascending) < ZeRO-3; for an edit with a prefix KV cache, all of
    these with the cache on the GPU, then with it off (each step recomputes the prefix)."""
    multi = base.num_gpus > 1 and base.task == "train"
    stages = [s for s in (0, 2, 3) if s >= base.zero_stage] if multi else [base.zero_stage]
    ckpts = [True] if base.gradient_checkpointing or base.task == "edit" else [False, True]
    kvs = [base.kv_cache] + (["off"] if base.kv_cache != "off" and kv_cache_bytes(c, base) else [])
    out = []
    for stage, kv in ((s, k) for k in kvs for s in stages):
        # only option sets `qie train` accepts: no swapping under DeepSpeed, no FP8 under ZeRO-3
        swaps = range(base.blocks_to_swap, c.num_layers + 1) if stage == 0 else [base.blocks_to_swap] * (not base.blocks_to_swap)
        fp8s = ([True] if base.fp8_base else [False, True]) if stage != 3 else [False] * (not base.fp8_base)
        for swap in swaps:
            for fp8 in fp8s:
                for ckpt in ckpts:
                    out.append(dataclasses.replace(base, zero_stage=stage, blocks_to_swap=swap, fp8_base=fp8,
                                                   gradient_checkpointing=ckpt, kv_cache=kv))
    return out


def recommend(c: DiTCensus, base: PlanOptions, gpu_memory_gb: float) -> Optional[Plan]:
    """The first (cheapest) option set whose predicted peak fits ``gpu_memory_gb``; None if none does."""
    budget = gpu_memory_gb * GiB
    for opts in candidates(c, base):
        plan = predict(c, opts)
        if plan.gpu_peak <= budget:
            return plan
    return None


def describe(o: PlanOptions) -> str:
    parts = [f"--resolution {o.resolution}", f"--ref_images {o.ref_images}", f"--batch_size {o.batch_size}"]
    if o.task == "train":
        parts.append(f"--lora_rank {o.lora_rank}")
        parts += ["--gradient_checkpointing"] if o.gradient_checkpointing else []
        parts += [f"--checkpoint_blocks {o.checkpoint_blocks}"] if o.gradient_checkpointing and \
            o.checkpoint_blocks is not None else []
        parts += [f"--checkpoint_policy {o.checkpoint_policy}"] if o.gradient_checkpointing and \
            o.checkpoint_policy != "full" else []
        parts += ["--compile"] if o.compile else []
    parts += [f"--compute_precision {o.compute_precision}"] if o.task == "train" and o.compute_precision != "auto" \
        else []
    parts += ["--ema_decay D"] if o.ema else []
    parts += [f"--validate_with {o.validate_with}"] if o.validate_with != "raw" else []
    parts += ["--on_the_fly"] if o.on_the_fly else []
    if o.task == "edit":
        parts += [f"--loras {' '.join(map(str, o.loras))}"] if o.loras else []
        parts += ["--no_cfg"] if not o.cfg else []
        parts += [f"--kv_cache {o.kv_cache}"] if o.kv_cache != "on" else []
    parts += ["--fp8_compute"] if o.fp8_compute else ["--fp8_base"] if o.fp8_base else []
    parts += [f"--blocks_to_swap {o.blocks_to_swap}"] if o.blocks_to_swap else []
    parts += [f"--zero_stage {o.zero_stage} --num_gpus {o.num_gpus}"] if o.zero_stage else []
    return " ".join(parts)


def format_plan(plan: Plan) -> str:
    rows = [f"  {name:<48} {b / GiB:8.2f} GiB" for name, b in plan.gpu.items()]
    rows.append(f"  {'predicted peak GPU memory (per GPU)':<48} {plan.gpu_peak / GiB:8.2f} GiB")
    rows += [f"  host: {name:<42} {b / GiB:8.2f} GiB" for name, b in plan.host.items()]
    rows.append(f"  {'predicted peak host RAM (per process)':<48} {plan.host_peak / GiB:8.2f} GiB")
    rows += [f"  {name + ' (shared by the processes on a machine, reclaimable)'} {b / GiB:.2f} GiB"
             for name, b in plan.shared.items()]
    return "\n".join(rows)


def choose_distribution(c: DiTCensus, base: PlanOptions, gpu_memory_gb: float) -> tuple[int, str]:
    """The ZeRO stage for ``base.num_gpus`` processes: 2 when the unsharded run fits ``gpu_memory_gb`` (ZeRO-2
    shards only the LoRA's gradients and optimizer state, and never all-gathers the frozen DiT), else 3.
    Returns (stage, the reason in words)."""
    two = predict(c, dataclasses.replace(base, zero_stage=2, blocks_to_swap=0))
    if two.gpu_peak <= gpu_memory_gb * GiB:
        return 2, (f"ZeRO-2: the unsharded DiT run needs {two.gpu_peak / GiB:.1f} GiB per GPU, which fits "
                   f"{gpu_memory_gb:.0f} GiB, and ZeRO-3 would all-gather the frozen DiT every micro-batch")
    three = predict(c, dataclasses.replace(base, zero_stage=3, blocks_to_swap=0, fp8_base=False, fp8_compute=False))
    return 3, (f"ZeRO-3: the unsharded run needs {two.gpu_peak / GiB:.1f} GiB per GPU, more than {gpu_memory_gb:.0f} "
               f"GiB; sharded over {base.num_gpus} GPUs it needs {three.gpu_peak / GiB:.1f} GiB")
