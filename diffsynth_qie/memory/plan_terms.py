"""The per-token terms of ``qie plan`` (``memory/plan.py``) and their constants: training activations, an edit's
prefix KV cache, the VAE's working set. Their own module so that ``plan.py`` and ``plan_rollouts.py`` share them."""
from __future__ import annotations

# Activation constants, in elements (of ``dtype_bytes``) per token and per unit of model width, fitted on
# full-width training steps and edits of the real 2511 DiT on the fake CUDA device (``fakegpu/device.py``,
# ``python -m benchmarks.fit_plan``): bf16 without autocast (``--compute_precision pure``, the default), rank-32
# LoRA on the 2511 targets, 1024² target + one 1024² reference + 300 prompt tokens, at 2 and 4 blocks (a line
# through the two depths), with and without checkpointing; attention runs the fused (flash / memory-efficient)
# kernels, so memory is linear in tokens. The activation term is what the steady-state peak (optimizer state
# alive) holds beyond the DiT, the LoRA weights and the LoRA's gradients + optimizer state. ``qie plan --verify``
# checks the whole 60-block model.
CALIBRATION = {
    "K_BLOCK": 34.05,  # kept per block for backward (q, k, v, MLP hidden, norms, gates, fp32 RoPE)
    "K_OUTSIDE": 18.82,  # img_in/txt_in, modulation, norm_out/proj_out, the loss, the last block's backward
    "K_BOUNDARY": 1.0,  # checkpointing: each block's saved inputs (image + text hidden states)
    "K_OUTSIDE_CKPT": 8.26,  # checkpointing: everything outside the recomputed block
    "K_INFER": 21.07,  # an edit: one block's working set without a graph, per sample of a pass
}
# ``--checkpoint_policy selective``: what each checkpointed block keeps beyond its inputs (the large GEMMs' and
# attention's outputs), the same fit at 2 and 4 blocks (0.47 GiB per block at 1024² + 1 reference). The block
# being recomputed holds them already (K_BLOCK), so every block but one adds them.
K_KEPT_SELECTIVE = 9.67
# ``--checkpoint_blocks N`` (0 < N < L): the first block, whose input needs no gradient, keeps this much less than the
# others when plain, and the line through 2 and 4 plain blocks puts the difference into K_OUTSIDE; with the first
# block checkpointed (the first N are) the start of the backward holds it. Fitted on 4 blocks with N = 1, 2, 3 (full
# and selective: 23.00 each, ``python -m benchmarks.fit_plan --partial``); taken for autocast too.
K_FIRST_PLAIN = 23.0
# The same under bf16 autocast (``--compute_precision autocast``, ``fit_plan --compute_precision autocast``): the
# LayerNorm outputs and the modulation in fp32, and their bf16 copies for the linears, are kept for backward too.
AUTOCAST_CALIBRATION = {"K_BLOCK": 40.05, "K_OUTSIDE": 19.75, "K_BOUNDARY": 1.0, "K_OUTSIDE_CKPT": 10.8}
# Measured on a GPU (benchmarks/results/nvidia-h200-2026-11-26.md, ``python -m benchmarks.plan_vs_gpu``; those
# steps ran under autocast): a checkpointed training step's activations, measured peak minus the static terms,
# grow 7 % faster with the tokens than the fake device counts (2511 at batch 1/2/4: 0.93, 1.00, 1.04 x the
# autocast constants; 2.1 at 1 and 3 references, batch 1 and 4: 1.03-1.07 x). The plan takes the larger slope,
# so a real step is predicted within +2 %/-0 % instead of +1 %/-5 %; the pure step takes the same factor until
# it is measured. A partly checkpointed step (``--checkpoint_blocks``) takes it at its first recompute, not at the
# start of its backward, which is a plain step's moment (unmeasured on a GPU, so unscaled as the plain step is: the
# peak then falls with every block checkpointed, up to all but one). Without checkpointing our step ran out of
# 139 GiB (the plan: 160 GiB).
GPU_CHECKPOINTED_ACTIVATION_SCALE = 1.07
# The VAE's working set while encoding a reference or decoding the result, bytes per output pixel (bf16).
VAE_BYTES_PER_PIXEL = 1357


def calibration(o) -> dict:
    """The constants of ``o``'s (a ``plan.PlanOptions``) training step: pure bf16, or under autocast."""
    return {**CALIBRATION, **AUTOCAST_CALIBRATION} if o.compute_precision == "autocast" else CALIBRATION


def checkpointed_blocks(c, o) -> int:
    """How many of ``c``'s blocks recompute in ``o``'s backward (``--checkpoint_blocks``; every one by default)."""
    if not o.gradient_checkpointing:
        return 0
    return c.num_layers if o.checkpoint_blocks is None else min(o.checkpoint_blocks, c.num_layers)


def checkpointed_label(c, o) -> str:
    """The activation row's note: checkpointed, or N of L blocks checkpointed."""
    n = checkpointed_blocks(c, o)
    return "" if not n else " (checkpointed)" if n == c.num_layers else f" ({n} of {c.num_layers} blocks checkpointed)"


def activation_bytes(c, o) -> int:
    """Training activations of ``o`` (a ``plan.PlanOptions``) on the model ``c`` (a ``census.DiTCensus``), bytes.

    With the first N of L blocks checkpointed (``--checkpoint_blocks N``) the backward runs the last block first: it
    starts with every block's saved state alive (the N checkpointed blocks' inputs, the L - N others' whole
    activations) and frees each plain block's as its backward ends, then recomputes the checkpointed ones one at a
    time. The peak is the larger of the two moments: the start of the backward (the plain blocks' term with N of
    its blocks reduced to their inputs, the first one's :data:`K_FIRST_PLAIN` with them) and the first recompute
    (the checkpointed term of N blocks)."""
    k = calibration(o)
    lora = c.lora_token_targets * o.lora_rank / c.dim
    kept = K_KEPT_SELECTIVE if o.checkpoint_policy == "selective" else 0.0
    n, layers = checkpointed_blocks(c, o), c.num_layers
    per = 0.0
    if n:  # the first recompute: N blocks' inputs (and kept outputs), one block recomputed
        per = (n * k["K_BOUNDARY"] + (n - 1) * kept + k["K_BLOCK"] + lora + k["K_OUTSIDE_CKPT"]) \
            * GPU_CHECKPOINTED_ACTIVATION_SCALE
    if n < layers:  # the start of the backward: L - N blocks' whole activations, N blocks' inputs
        start = (layers - n) * (k["K_BLOCK"] + lora) + k["K_OUTSIDE"]
        if n:  # (the plain step's moment, unscaled as the plain step is: no GPU has measured it)
            start += n * k["K_BOUNDARY"] + (n - 1) * kept + K_FIRST_PLAIN
        per = max(per, start)
    return round(o.batch_size * (2 if o.pairs else 1) * max(1, o.rollouts) * o.tokens * c.dim * per * o.dtype_bytes)


def kv_cache_bytes(c, o) -> int:
    """An edit's prefix KV caches, kept for the whole edit: one per prompt (two with true CFG) and sample."""
    if not c.prefix_kv_width or o.kv_cache == "off":
        return 0
    per_token = c.num_layers * 2 * c.prefix_kv_width * o.dtype_bytes
    return per_token * o.prefix_tokens * o.batch_size * (2 if o.cfg else 1)


def vae_bytes(o, images: int) -> int:
    """The VAE's working set encoding or decoding ``images`` images of ``resolution``²."""
    return round(images * o.resolution ** 2 * VAE_BYTES_PER_PIXEL * o.dtype_bytes / 2)
