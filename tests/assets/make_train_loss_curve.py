"""Regenerate ``train_loss_curve.json``: the pinned fixed-seed loss curve of tests/test_training.py.

Run it when a change is *meant* to change training numerics (the tiny model, the demo
data, the cache, the loss or the sampler), then commit the JSON with that change:

    .venv/bin/python tests/assets/make_train_loss_curve.py

It rebuilds exactly what the test session builds (conftest: ``build_tiny(seed=0)``,
``make_demo_data(num_pairs=8, seed=0)``; the cache with ``CACHE_MAX_PIXELS``), trains
with ``REFERENCE`` and stores the config next to the per-step losses, so the test
replays the very same run.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DIFFSYNTH_SKIP_DOWNLOAD", "True")

HERE = Path(__file__).resolve().parent
OUT = HERE / "train_loss_curve.json"
CACHE_MAX_PIXELS = 64 * 64

# Flags of the reference run (RunConfig sections -> fields); paths are filled in at run time.
REFERENCE = {
    "train": {"model": "tiny", "batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 8,
              "mixed_precision": "no", "gradient_checkpointing": False, "cfg_dropout": 0.25,
              "save_every": 0, "seed": 0, "device": "cpu"},
    "lora": {"lora_rank": 4, "lora_alpha": 8.0},
    "optim": {"learning_rate": 1e-2, "warmup_steps": 2, "lr_schedule": "cosine", "min_lr_ratio": 0.1},
    "timesteps": {"timestep_sampling": "uniform"},
    "loss": {"loss_weighting": "diffsynth", "mask_loss_weights": [2.0, 1.0]},
}


def build_cache(tiny_pipe, demo_dir: Path, cache_dir: Path) -> Path:
    """The test session's cache (also used by tests/test_training.py's fixture)."""
    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.formats import DatasetConfig

    config = CacheConfig(cache_dir=str(cache_dir), model="tiny", max_pixels=CACHE_MAX_PIXELS, num_workers=1,
                         dataset=DatasetConfig(dataset_metadata=str(demo_dir / "metadata.json")))
    write_cache(config, pipe=tiny_pipe, rank=0, world_size=1)
    return cache_dir


def run_config(sections: dict, cache_dir, output_dir, model_dir):
    """A RunConfig from REFERENCE-style sections plus the run's paths."""
    from diffsynth_qie.training import config as tc

    parts = {
        "train": tc.TrainConfig(**{**sections.get("train", {}), "cache_dir": str(cache_dir),
                                   "output_dir": str(output_dir), "model_dir": str(model_dir)}),
        "lora": tc.LoRAConfig(**sections.get("lora", {})),
        "optim": tc.OptimConfig(**sections.get("optim", {})),
        "timesteps": tc.TimestepConfig(**sections.get("timesteps", {})),
        "loss": tc.LossConfig(**{k: (tuple(v) if isinstance(v, list) else v)
                                 for k, v in sections.get("loss", {}).items()}),
    }
    return tc.RunConfig(**parts)


def main() -> int:
    import torch

    from diffsynth_qie.data.demo import make_demo_data
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.tiny.build import build_tiny
    from diffsynth_qie.training.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny(tmp / "tiny" / "Qwen-Image-Edit-tiny", seed=0)
        demo = make_demo_data(tmp / "demo", num_pairs=8, seed=0)
        pipe = load_pipeline("tiny", model_dir=model_dir, device="cpu", torch_dtype=torch.float32)
        cache = build_cache(pipe, Path(demo), tmp / "cache")
        result = train(run_config(REFERENCE, cache, tmp / "out", model_dir))
    data = {
        "about": "per-optimizer-step training loss of REFERENCE; regenerate with tests/assets/make_train_loss_curve.py",
        "config": REFERENCE,
        "losses": result.losses,
        "generated_with": {"python": platform.python_version(), "torch": torch.__version__},
    }
    OUT.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {OUT}: {len(result.losses)} steps, first {result.losses[0]:.5f}, last {result.losses[-1]:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
