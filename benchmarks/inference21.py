"""Benchmark Qwen-Image-2.1 edit sampling at 1024²: the DiT part of ``qie edit --model 2.1``, with and without
the prefix KV cache, 1 and 3 references, true CFG 4 at 40 steps and the turbo's 8 steps at CFG 1.

    python -m benchmarks.inference21 [--refs 1 3] [--steps 40] [--turbo_steps 8]   # GPU, random full-size DiT
    python -m benchmarks.inference21 --tiny                                         # CPU smoke test

Runs our sampler exactly as ``Editor.edit`` does after encoding (``Qwen21Ops.conditioning`` → ``velocity`` →
``sample_flow_match`` on the family's schedule) on DiffSynth's ``QwenImage21DiT`` at its own sizes with random bf16
weights. The prompt encoder (Qwen3-VL) and the VAE run once per edit outside this loop and are not timed here:
their weights cannot be built at full size without the model's configuration files. Rows carry s/image of the
sampling loop, the DiT forwards and the peak memory.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a file: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import common
from benchmarks.train21 import FULL_LATENT, FULL_TEXT, TINY_LATENT, TINY_TEXT, build_dit21, make_entry

log = logging.getLogger("benchmarks.inference21")


def sample(dit, entry: dict, negative: dict, steps: int, cfg: float, kv_cache: bool, kind: str, seed: int):
    from diffsynth_qie.models.family import QWEN21
    from diffsynth_qie.models.family_ops import ops_for
    from diffsynth_qie.models.qwen_image_21.qwen21 import Prompt21
    from diffsynth_qie.models.samplers.sampling import sample_flow_match
    from diffsynth_qie.models.samplers.schedules import ScheduleSpec

    ops = ops_for(QWEN21)
    to_dit = lambda t: t  # noqa: E731 - the entries are on the DiT's device and dtype already
    cond = ops.conditioning([Prompt21(entry["prompt"], entry["pad"])],
                            None if cfg == 1.0 else [Prompt21(negative["prompt"], negative["pad"])],
                            [entry["refs"]], False, to_dit)
    cond.kv_cache = kv_cache
    noise = torch.randn((1,) + tuple(entry["target"].shape), generator=torch.Generator().manual_seed(seed))
    noise = noise.to(entry["target"].device, entry["target"].dtype)
    spec = ScheduleSpec(steps=steps, latent_hw=tuple(noise.shape[-2:]), kind=kind)
    with torch.no_grad():
        return sample_flow_match(ops.velocity(dit, cond, cfg), noise, spec, ops.schedule)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.inference21", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny 2.1 (fp32; not timings)")
    p.add_argument("--refs", type=int, nargs="+", default=[1, 3])
    p.add_argument("--steps", type=int, default=None, help="CFG steps (default 40; tiny 3)")
    p.add_argument("--cfg_scale", type=float, default=4.0)
    p.add_argument("--turbo_steps", type=int, default=8, help="CFG-1 steps of the turbo row (0 = skip)")
    p.add_argument("--no_cache_rows", action="store_true", help="skip the rows without the prefix KV cache")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out_dir", default="benchmarks/results")
    p.add_argument("--log_level", default="INFO")
    p.add_argument("--device", default=None)
    cfg = p.parse_args(argv)
    steps = cfg.steps or (3 if cfg.tiny else 40)
    device, dtype, env, date = common.start_run(cfg)
    t0 = time.perf_counter()
    dit = build_dit21(cfg.tiny, device, dtype, cfg.seed).requires_grad_(False)
    log.info("built %s 2.1 DiT in %.1f s", "tiny" if cfg.tiny else "full", time.perf_counter() - t0)
    side, text = (TINY_LATENT, TINY_TEXT) if cfg.tiny else (FULL_LATENT, FULL_TEXT)
    text_dim = dit.txt_in.in_layer.in_features
    rows = []
    for refs in cfg.refs:
        entry = make_entry(side, refs, text, text_dim, cfg.seed, device, dtype)
        negative = make_entry(side, refs, 2 + 8, text_dim, cfg.seed + 1, device, dtype)  # an empty negative prompt
        cases = [("cfg", steps, cfg.cfg_scale, True)]
        if not cfg.no_cache_rows:
            cases.append(("cfg", steps, cfg.cfg_scale, False))
        if cfg.turbo_steps and refs == cfg.refs[0]:
            cases.append(("turbo", cfg.turbo_steps, 1.0, True))
        for case, n, scale, kv in cases:
            row = {"id": f"inference21/{case}/refs={refs}/steps={n}/kv_cache={kv}", "script": "inference",
                   "model": "2.1", "case": f"2.1 {case}, {refs} ref", "impl": "ours", "num_inference_steps": n,
                   "cfg_scale": scale, "size": side * 16, "reference_images": refs,
                   "dit_forwards": n * (1 if scale == 1.0 else 2), "options": {"kv_cache": kv}, "tag": "",
                   "tiny": cfg.tiny, "repeats": cfg.repeats, "status": "not run", **env}
            run = lambda: sample(dit, entry, negative, n, scale, kv, "default", cfg.seed)  # noqa: E731
            warm = lambda: sample(dit, entry, negative, 2, scale, kv, "default", cfg.seed)  # noqa: E731
            common.time_image_row(row, run, None if cfg.tiny else warm, device, cfg.repeats, log)
            rows.append(row)
            common.write_results(rows, cfg.out_dir, env["gpu"], date)
    return common.finish(rows, cfg.out_dir, env, date, log)


if __name__ == "__main__":
    main()
