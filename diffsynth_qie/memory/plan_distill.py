"""``qie plan --loss dmd``: what DMD2's distillation adds to a training step (``training/losses/dmd.py``).

Beside the student's LoRA and its optimizer state (the plan's usual terms): the teacher's LoRA as frozen unmerged
branches (bf16 buffers; its rank taken as the student's), the fake score's adapter (fp32, the student's size) with
its AdamW state, and during the fake score's own step its gradients. The passes without a graph (the student's
sample, the teacher's CFG pass, on a GPU two passes of one sample each, and the fake score's) and the fake score's
step (its own graph, the step's size) run before the student's graph is built (``dmd_sample.py``): they raise the
peak only where one of them exceeds the step's own activations, which is what is added.
"""
from __future__ import annotations


def distill_terms(plan, c, o) -> None:
    """Add the distillation terms of ``o`` (a ``PlanOptions`` with ``distill``) for the model ``c`` to ``plan``."""
    from .plan_terms import CALIBRATION, activation_bytes

    n = c.lora_params(o.lora_rank)
    plan.gpu["teacher LoRA (frozen branches, bf16)"] = 2 * n
    plan.gpu["fake score LoRA + its AdamW state (fp32)"] = 12 * n
    plan.gpu["fake score gradients (its own step)"] = 4 * n
    no_graph = o.tokens * c.dim * CALIBRATION["K_INFER"] * o.dtype_bytes  # one sample's pass, one block's working set
    beyond = no_graph - activation_bytes(c, o)
    if beyond > 0:
        plan.gpu["teacher CFG / fake score passes (beyond the activations)"] = round(beyond)
