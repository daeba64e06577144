"""Fit ``qie plan``'s activation constants from full-width training steps on the fake CUDA device.

    python -m benchmarks.fit_plan            # prints the measurements, the fitted constants and the check

Each case is one real training step (``preflight/train_step.py``: the 2511 DiT at full width, bf16 as
``--compute_precision`` says (pure by default: ``CALIBRATION``; autocast: ``AUTOCAST_CALIBRATION``),
rank-32 LoRA on the 2511 targets, 1024² target + one 1024² reference + 300 prompt tokens) at 2 and 4 blocks,
with and without activation checkpointing. The activation term is what the steady-state peak holds beyond
the DiT, the LoRA weights and the LoRA's gradients + AdamW moments (the plan's other rows); a line through
the two depths gives the per-block and the outside constants of ``memory/plan_terms.py``. The last check runs
the whole 60-block DiT and compares the plan's prediction with its fake-device peak.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging

log = logging.getLogger("fit_plan")
GiB = 1024 ** 3


def step_case(depth: int, checkpointing: bool, rank: int = 32, precision: str = "auto", checkpoint_blocks=None,
              policy: str = "full"):
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.config import RunConfig
    from diffsynth_qie.preflight.train_step import batch_shapes, verify_train_step

    preset = get_preset("2511")
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, model="2511", cache_dir="-", output_dir="-",
                                                             gradient_checkpointing=checkpointing,
                                                             compute_precision=precision, checkpoint_policy=policy,
                                                             checkpoint_blocks=checkpoint_blocks),
                              lora=dataclasses.replace(cfg.lora, lora_rank=rank))
    return verify_train_step(cfg.resolved(preset), preset, batch_shapes(1024, 1, 300, 1), num_layers=depth)


def main() -> None:
    from diffsynth_qie.memory.census import preset_census
    from diffsynth_qie.memory.plan import PlanOptions, activation_bytes, predict

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip_full", action="store_true", help="skip the 60-block check (about a minute)")
    parser.add_argument("--compute_precision", default="auto", choices=("auto", "pure", "autocast"),
                        help="the training step's --compute_precision (auto: pure bf16, the default)")
    parser.add_argument("--partial", action="store_true",
                        help="only check --checkpoint_blocks N: 4 blocks with N = 0..4, full and selective, against "
                             "the plan (K_FIRST_PLAIN is the plain first block's deficit it measures)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    census = preset_census("2511", with_encoders=False)
    options = PlanOptions(lora_rank=32, compute_precision=args.compute_precision)
    if args.partial:
        return partial(options, args.compute_precision)
    tokens_width = options.tokens * census.dim * options.dtype_bytes
    lora_per_token = census.lora_token_targets * options.lora_rank / census.dim
    fitted = {}
    for ckpt in (False, True):
        per_depth = {}
        for depth in (2, 4):
            r = step_case(depth, ckpt, precision=args.compute_precision)
            # r.weights: the DiT at this depth + the fp32 LoRA; the plan's LoRA row adds 12 bytes per parameter
            # (gradient + AdamW's two moments), 1.5 x the 8-byte moments the step left alive
            act = r.peak - r.weights - 1.5 * r.optimizer_state
            per_depth[depth] = act / tokens_width
            log.info("checkpointing %-5s %d blocks: weights %.2f GiB, steady peak %.2f GiB, activations %.3f GiB",
                     ckpt, depth, r.weights / GiB, r.peak / GiB, act / GiB)
        slope = (per_depth[4] - per_depth[2]) / 2
        intercept = per_depth[2] - 2 * slope
        if ckpt:
            fitted["K_BOUNDARY"] = slope
            fitted["K_OUTSIDE_CKPT"] = intercept - fitted["K_BLOCK"] - lora_per_token
        else:
            fitted["K_BLOCK"] = slope - lora_per_token
            fitted["K_OUTSIDE"] = intercept
    from diffsynth_qie.preflight.edit_step import verify_edit
    from diffsynth_qie.models.presets import get_preset

    e = verify_edit(get_preset("2511"), num_layers=2, lora_rank=32)  # no graph: one block's working set at a time
    fitted["K_INFER"] = (e.denoise_peak - e.weights) / tokens_width  # true CFG: two passes of one sample
    fitted["VAE_BYTES_PER_PIXEL"] = (max(e.encode_peak, e.decode_peak) - e.weights) / options.resolution ** 2
    log.info("edit, 2 blocks: weights %.2f GiB, encode %.2f, denoise %.2f, decode %.2f GiB", e.weights / GiB,
             e.encode_peak / GiB, e.denoise_peak / GiB, e.decode_peak / GiB)
    log.info("fitted constants (elements per token per unit of width; bytes per pixel for the VAE): %s",
             {k: round(v, 2) for k, v in fitted.items()})
    if args.skip_full:
        return
    r = step_case(60, True, precision=args.compute_precision)
    plan = predict(census, dataclasses.replace(options, gradient_checkpointing=True))
    predicted = plan.gpu_peak - options.overhead_bytes
    log.info("60 blocks, checkpointing: fake-device steady peak %.2f GiB, plan %.2f GiB (without the CUDA "
             "context), %+.1f %%; plan activations %.2f GiB", r.peak / GiB, predicted / GiB,
             100 * (predicted / r.peak - 1), activation_bytes(census, plan.options) / GiB)


def partial(options, precision: str) -> None:
    """4 full-width blocks with the first N checkpointed: the fake-device steady peak beside the plan's."""
    from diffsynth_qie.memory.census import preset_census
    from diffsynth_qie.memory.plan import predict

    census = preset_census("2511", with_encoders=False, num_layers=4)
    for policy in ("full", "selective"):
        for n in range(0 if policy == "full" else 1, 5):  # (N = 0 has no policy)
            r = step_case(4, True, precision=precision, checkpoint_blocks=n, policy=policy)
            o = dataclasses.replace(options, gradient_checkpointing=True, checkpoint_blocks=n, checkpoint_policy=policy)
            planned = predict(census, o).gpu_peak - o.overhead_bytes
            log.info("%-9s %d of 4 checkpointed: fake-device steady peak %.3f GiB, plan %.3f GiB (%+.1f %%)", policy,
                     n, r.peak / GiB, planned / GiB, 100 * (planned / r.peak - 1))


if __name__ == "__main__":
    main()
