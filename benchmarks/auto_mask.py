"""What ``qie cache --auto_mask diff`` buys on the CPU demo (the pretrained tiny base, "make the red circle blue").

    python -m benchmarks.auto_mask

The demo's training rows without their masks are cached twice, plainly and with ``--auto_mask diff``; a LoRA is
trained on each with the demo's settings (400 steps of batch 4, rank 16, lr 1e-3, same seed), the masked one
with the mask-weighted loss (``--mask_loss_weights 1.0 0.1``: the derived region weighs 10x the rest). Both edit
the 8 held-out pairs (8 steps, CFG 1, no mask at inference) and are scored against the targets with the
held-out pairs' true masks: PSNR inside the edit region, and outside it (preservation). Takes a few minutes.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path


def _psnr(a, b, where) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64)[where], np.asarray(b, np.float64)[where]
    return float(10 * np.log10(255.0 ** 2 / max(((a - b) ** 2).mean(), 1e-10)))


def main() -> None:
    import numpy as np
    import torch
    from accelerate.state import AcceleratorState, GradientState
    from PIL import Image

    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.demo import make_recolour_demo
    from diffsynth_qie.data.formats import DatasetConfig, read_rows
    from diffsynth_qie.data.images import load_mask, load_rgb
    from diffsynth_qie.inference import EditRequest, Editor
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.training import config as tc
    from diffsynth_qie.training.loop import train
    from diffsynth_qie.training.pretrain_tiny import ensure_pretrained_tiny
    from diffsynth_qie.utils.logging import setup_logging

    setup_logging("WARNING")
    torch.set_num_threads(1)
    base = ensure_pretrained_tiny()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = make_recolour_demo(tmp / "demo")
        rows = json.loads((data / "metadata.json").read_text())
        for r in rows:
            r.pop("back_mask", None)
        (data / "train.json").write_text(json.dumps(rows))
        results = {}
        for auto in ("none", "diff"):
            cache = tmp / f"cache-{auto}"
            write_cache(CacheConfig(cache_dir=str(cache), model="tiny", model_dir=str(base), max_pixels=16384,
                                    device="cpu", dtype="float32", auto_mask=auto,
                                    dataset=DatasetConfig(dataset_metadata=str(data / "train.json"))))
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            lora = train(tc.RunConfig(
                train=tc.TrainConfig(cache_dir=str(cache), output_dir=str(tmp / f"run-{auto}"), model="tiny",
                                     model_dir=str(base), device="cpu", max_steps=400, batch_size=4,
                                     gradient_checkpointing=False, cfg_dropout=0.0, zero_cond_t=True,
                                     mixed_precision="no", seed=0),
                lora=tc.LoRAConfig(lora_rank=16), optim=tc.OptimConfig(learning_rate=1e-3),
                loss=tc.LossConfig(mask_loss_weights=(1.0, 0.1) if auto == "diff" else None))).lora_path
            editor = Editor(load_pipeline("tiny", model_dir=base, device="cpu", torch_dtype=torch.float32),
                            zero_cond_t=True)
            editor.set_loras([(str(lora), 1.0)])
            inside, outside = [], []
            for row in read_rows(data / "heldout.json"):
                out = editor.edit(EditRequest(images=[load_rgb(row.edit_images[0])], prompt=row.prompts[0], steps=8,
                                              cfg=1.0, seed=0)).image
                target = load_rgb(row.target).resize(out.size)
                region = np.asarray(load_mask(row.back_mask).resize(out.size, Image.NEAREST)) > 127
                inside.append(_psnr(out, target, region))
                outside.append(_psnr(out, target, ~region))
            results[auto] = (float(np.mean(inside)), float(np.mean(outside)))
    print("held-out PSNR to the target (8 pairs), inside the edit region / outside it:")
    for auto, (i, o) in results.items():
        label = "--auto_mask diff + --mask_loss_weights 1.0 0.1" if auto == "diff" else "no mask (plain loss)"
        print(f"  {label:48s} {i:6.2f} dB / {o:6.2f} dB")


if __name__ == "__main__":
    main()
