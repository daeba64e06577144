"""Tiny CPU training throughput: real mixed-shape batches of 4 against batch 1 (issue 6's closing figure).

    python -m benchmarks.tiny_throughput [--cache_dir DIR] [--samples 32] [--repeats 5]

What is timed: the training loop's inner step, as ``training/loop.py`` runs it
without accelerate around it — ``QIETrainingModule`` forward (our flow-matching SFT
loss over ``models.forward.dit_forward``), backward, gradient clipping at 1.0, AdamW
step, ``zero_grad`` — over the same ``--samples`` cache entries:

- ``batch 4 mixed``: the batches ``BucketBatchSampler`` (``--bucket_policy auto``)
  makes at batch size 4 from a mixed-size demo cache; batches whose samples differ in
  layout are padded and masked;
- ``batch 1``: the very same samples, in the same order, one per step.

Settings: tiny model, fp32, ``torch.set_num_threads(1)``, gradient checkpointing
off, CFG dropout 0, LoRA rank 8 on the tiny preset's targets. One untimed warm-up
pass, then ``--repeats`` timed passes; reported: median seconds per pass, samples/s
(samples / median), and the image-token padding fraction of the batches (token
weighted, as ``data/buckets.padding_fraction`` defines it). Without ``--cache_dir``
the script builds the tiny model (if missing) and a mixed-size demo cache (36 pairs,
128² pixel budget, as ``Qwen-Image-Edit-2511.sh`` does) under ``--work_dir``.

Tiny CPU numbers show batching overheads (Python, kernel launches, padding), not GPU
speed: the tiny DiT is dominated by per-call overhead, so batching helps far more
here than it would on a GPU-bound full-size step.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `diffsynth_qie` / `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("DIFFSYNTH_SKIP_DOWNLOAD", "True")

log = logging.getLogger("benchmarks.tiny_throughput")


def build_demo_cache(work_dir: Path, model_dir: Path, num_pairs: int, max_pixels: int) -> Path:
    """A mixed-size demo dataset cached with the tiny encoders (reused when already there)."""
    import torch

    from diffsynth_qie.cache.store import MANIFEST_NAME
    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.demo import make_demo_data
    from diffsynth_qie.data.formats import DatasetConfig
    from diffsynth_qie.models.load.loading import load_pipeline

    cache = work_dir / f"cache-{num_pairs}-{max_pixels}"
    if (cache / MANIFEST_NAME).is_file():
        return cache
    data = make_demo_data(work_dir / "demo-data", num_pairs=num_pairs, seed=0, mixed_sizes=True)
    pipe = load_pipeline("tiny", model_dir=model_dir, device="cpu", torch_dtype=torch.float32)
    write_cache(CacheConfig(cache_dir=str(cache), model="tiny", max_pixels=max_pixels, num_workers=1,
                            dataset=DatasetConfig(dataset_metadata=str(data / "metadata.json"))),
                pipe=pipe, rank=0, world_size=1)
    return cache


def measure(module, optimizer, batches: list[list[dict]], repeats: int) -> list[float]:
    """Seconds per pass over ``batches`` (one optimizer step per batch), after one warm-up pass."""
    import torch

    from diffsynth_qie.training.data import collate

    collated = [collate(b) for b in batches]  # cache reads are not what is measured
    params = module.trainable_modules()
    times = []
    for r in range(repeats + 1):
        gen = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        for batch in collated:
            loss, _ = module(batch, gen)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if r > 0:  # pass 0 warms up
            times.append(time.perf_counter() - t0)
    return times


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from diffsynth_qie.data.sampling import BucketBatchSampler, SamplingConfig, padding_fraction
    from diffsynth_qie.models.load.loading import default_tiny_dir, load_pipeline
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.tiny.build import ensure_tiny
    from diffsynth_qie.training import config as tc
    from diffsynth_qie.training.data import CacheDataset, SampleKey
    from diffsynth_qie.training.module import QIETrainingModule
    from diffsynth_qie.training.optim import build_optimizer

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir) if args.model_dir else ensure_tiny(default_tiny_dir())
    cache = Path(args.cache_dir) if args.cache_dir else build_demo_cache(Path(args.work_dir), model_dir,
                                                                         args.num_pairs, args.max_pixels)
    from diffsynth_qie.cache.store import CacheStore

    dataset = CacheDataset(CacheStore.open(cache), seed=0, cfg_dropout=0.0)
    infos = dataset.sample_infos()
    sampler = BucketBatchSampler(infos, SamplingConfig(batch_size=args.batch_size, seed=0))
    batches4: list[list[int]] = []
    epoch = 0
    while sum(len(b) for b in batches4) < args.samples:
        batches4 += sampler.epoch_batches(epoch)
        epoch += 1
    while sum(len(b) for b in batches4) > args.samples:  # keep whole batches only
        batches4.pop()
    samples = sum(len(b) for b in batches4)
    singles = [[i] for b in batches4 for i in b]  # the same samples, in the same order, one per step
    pad = padding_fraction(batches4, infos)
    mixed = sum(1 for b in batches4 if len({infos[i].layout for i in b}) > 1)

    def setup():
        cfg = tc.RunConfig(train=tc.TrainConfig(cache_dir=str(cache), output_dir="(benchmark)", model="tiny",
                                                gradient_checkpointing=False, cfg_dropout=0.0, seed=0),
                           lora=tc.LoRAConfig(lora_rank=8)).resolved(get_preset("tiny"))
        torch.manual_seed(0)
        dit = load_pipeline("tiny", model_dir=model_dir, components=("dit",), device="cpu",
                            torch_dtype=torch.float32).dit
        module = QIETrainingModule(dit, cfg, "tiny")
        return module, build_optimizer(module.trainable_modules(), cfg.optim)

    rows = []
    for name, plan in ((f"batch {args.batch_size} mixed", batches4), ("batch 1", singles)):
        module, optimizer = setup()
        module.train()
        data = [[dataset[SampleKey(i, 0)] for i in b] for b in plan]
        times = measure(module, optimizer, data, args.repeats)
        median = statistics.median(times)
        rows.append({"case": name, "steps": len(plan), "samples": samples, "median_s": median,
                     "samples_per_s": samples / median, "times": times,
                     "padding": pad if plan is batches4 else 0.0})
        log.info("%s: %d steps, passes %s s", name, len(plan), ", ".join(f"{t:.3f}" for t in times))
    rows[0]["mixed_batches"] = mixed
    return rows


def table(rows: list[dict], threads: int) -> str:
    base = next(r for r in rows if r["case"] == "batch 1")["samples_per_s"]
    lines = [f"tiny DiT, CPU fp32, {threads} thread(s), gradient checkpointing off, "
             f"{rows[0]['samples']} samples per pass, median of {len(rows[0]['times'])} passes after 1 warm-up",
             "",
             "| case | steps | median s/pass | samples/s | × batch 1 | padding |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['steps']} | {r['median_s']:.3f} | {r['samples_per_s']:.1f} | "
                     f"{r['samples_per_s'] / base:.2f} | {100 * r['padding']:.1f}% |")
    if "mixed_batches" in rows[0]:
        lines.append("")
        lines.append(f"{rows[0]['mixed_batches']} of {rows[0]['steps']} batches mix image layouts (padded + masked)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache_dir", help="an existing tiny cache (default: build a demo cache in --work_dir)")
    parser.add_argument("--model_dir", help="tiny model directory (default: the tiny preset's, built if missing)")
    parser.add_argument("--work_dir", default="outputs/bench-tiny-throughput", help="where the demo cache goes")
    parser.add_argument("--num_pairs", type=int, default=36, help="demo rows when building the cache")
    parser.add_argument("--max_pixels", type=int, default=128 * 128, help="cache pixel budget when building it")
    parser.add_argument("--samples", type=int, default=32, help="samples per timed pass (whole batches)")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = run(args)
    print(table(rows, args.threads))  # the script's result (stdout); progress goes to the log
    return 0


if __name__ == "__main__":
    sys.exit(main())
