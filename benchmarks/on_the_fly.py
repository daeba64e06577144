"""Training on the fly vs from the cache, and what the background encoding hides (CPU, tiny model).

    python -m benchmarks.on_the_fly [--steps 30]

Builds the tiny model, the demo dataset and its cache in a temporary directory, then times ``qie train``'s
loop three ways on the same data and seed: from the cache, on the fly with the encoders in a background thread
(``--prefetch 2``), and on the fly inline (``--prefetch 0``). Prints steps/s and the ratios. The figures are
whole-loop rates on this machine's CPU (model loads excluded: ``TrainResult.steps_per_second``).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=2)
    args = parser.parse_args()

    import torch
    from accelerate.state import AcceleratorState, GradientState

    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.demo import make_demo_data
    from diffsynth_qie.data.formats import DatasetConfig
    from diffsynth_qie.tiny.build import build_tiny
    from diffsynth_qie.training import config as tc
    from diffsynth_qie.training.loop import train
    from diffsynth_qie.utils.logging import setup_logging

    setup_logging("WARNING")
    torch.set_num_threads(1)
    max_pixels = 128 * 128
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny(tmp / "tiny", seed=0)
        data = make_demo_data(tmp / "data", num_pairs=16, seed=0, mixed_sizes=True)
        meta = str(data / "metadata.json")
        write_cache(CacheConfig(cache_dir=str(tmp / "cache"), model="tiny", model_dir=str(model), max_pixels=max_pixels,
                                device="cpu", dtype="float32", dataset=DatasetConfig(dataset_metadata=meta)))

        def run(name: str, on_the_fly: bool, prefetch: int = 2) -> float:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            cfg = tc.RunConfig(
                train=tc.TrainConfig(cache_dir=None if on_the_fly else str(tmp / "cache"), output_dir=str(tmp / name),
                                     model="tiny", model_dir=str(model), device="cpu", max_steps=args.steps,
                                     batch_size=args.batch_size, gradient_checkpointing=False, mixed_precision="no"),
                lora=tc.LoRAConfig(lora_rank=8),
                onthefly=tc.OnTheFlyConfig(on_the_fly=on_the_fly, max_pixels=max_pixels, prefetch=prefetch),
                dataset=DatasetConfig(dataset_metadata=meta if on_the_fly else None))
            return train(cfg).steps_per_second

        cached = run("cached", False)
        overlapped = run("live", True, prefetch=2)
        inline = run("inline", True, prefetch=0)
    print(f"tiny model, {args.steps} steps of batch {args.batch_size}, 128² budget, one CPU thread:")
    print(f"  from the cache:                    {cached:6.2f} steps/s")
    print(f"  on the fly, encoded in a thread:   {overlapped:6.2f} steps/s ({overlapped / cached:.2f}x the cached rate)")
    print(f"  on the fly, encoded inline:        {inline:6.2f} steps/s ({inline / cached:.2f}x the cached rate)")
    print(f"  the background thread: {overlapped / inline:.2f}x the inline rate")


if __name__ == "__main__":
    main()
