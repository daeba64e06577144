"""``qie plan --loss nft``: what DiffusionNFT's rollouts add to a training step (``training/losses/nft.py``).

Per source, ``K = --nft_group_size`` rollouts are sampled at once with the old policy, decoded one by one by the
VAE, and trained on as K samples (``activation_bytes`` multiplies by K), the old policy's forward beside them.
What stays for the whole step: the old policy (an fp32 copy of the trainable weights) and the VAE's weights. What
comes and goes before the training forward: the rollouts' working set (one block of K samples without a graph,
as an edit's, and on Qwen-Image-2.1 each rollout's prefix KV cache), the old policy's forward (the same for the K·B training samples), the VAE's decode of one image
and the trainable weights' copy while the old policy is swapped in. Only what of that exceeds the step's own
activations can raise the peak, so only that is added.
"""
from __future__ import annotations


def rollout_terms(plan, c, o) -> None:
    """Add the rollout terms of ``o`` (a ``PlanOptions`` with ``rollouts`` = K) for the model ``c`` to ``plan``."""
    import dataclasses

    from .plan_terms import CALIBRATION, activation_bytes, kv_cache_bytes, vae_bytes

    lora = 4 * c.lora_params(o.lora_rank)
    plan.gpu["old policy (fp32 copy of the LoRA)"] = lora
    plan.gpu["VAE weights (decodes the rollouts)"] = c.vae_params * o.dtype_bytes
    per_sample = o.tokens * c.dim * CALIBRATION["K_INFER"] * o.dtype_bytes
    # a DiT that caches its prefix (2.1) keeps one cache per rollout while they are sampled
    prefix = kv_cache_bytes(c, dataclasses.replace(o, task="edit", cfg=False, batch_size=o.rollouts))
    transient = max(o.rollouts * per_sample + prefix, o.batch_size * o.rollouts * per_sample, vae_bytes(o, 1)) + lora
    beyond = transient - activation_bytes(c, o)
    if beyond > 0:
        plan.gpu["rollouts / old policy pass (beyond the activations)"] = round(beyond)
