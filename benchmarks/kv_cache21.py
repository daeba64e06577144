"""Qwen-Image-2.1's prefix KV cache: what it saves, counted and timed.

The text + reference prefix is conditioned at t=0 and attends only to itself, so its keys and values are the
same at every step; with the cache, steps 2..N run the DiT's blocks on the target's tokens only.

    python -m benchmarks.kv_cache21            # tiny 2.1 on the CPU: tokens per block call and edit time, both ways

It prints the tokens each step sends through the first block (counted with a forward hook), the edit's
median time over ``--repeats`` runs with and without the cache, and the same token count for the real model
at 1024² with one 1024² reference and a 300-token prompt (arithmetic from the model's sizes: 16 px per token).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _edit(editor, request, use_cache: bool) -> tuple[float, list[int]]:
    from diffsynth_qie.models.qwen_image_21 import qwen21
    seen: list[int] = []
    real = qwen21.Cond21.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.kv_cache = use_cache

    hook = editor.pipe.dit.transformer_blocks[0].register_forward_hook(
        lambda m, a, kw, out: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True)
    qwen21.Cond21.__init__ = init
    try:
        start = time.perf_counter()
        editor.edit(request)
        return time.perf_counter() - start, seen
    finally:
        qwen21.Cond21.__init__ = real
        hook.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=128, help="output and reference side (multiple of 32)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch
    from PIL import Image

    from diffsynth_qie.inference import EditRequest, Editor
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.tiny.qwen21 import build_tiny21

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        pipe = load_pipeline("tiny-2.1", model_dir=build_tiny21(Path(tmp) / "tiny21"), device="cpu",
                             torch_dtype=torch.float32)
        editor = Editor(pipe)
        request = EditRequest(images=[Image.new("RGB", (args.size, args.size), (200, 30, 30))],
                              prompt="make the red square blue and keep the background", steps=args.steps, seed=0)
        _edit(editor, request, True)  # warm-up
        rows = {}
        for use_cache in (False, True):
            times, tokens = zip(*(_edit(editor, request, use_cache) for _ in range(args.repeats)))
            rows[use_cache] = (statistics.median(times), tokens[0])
    for use_cache, (seconds, tokens) in rows.items():
        print(f"tiny 2.1, {args.size}² + one {args.size}² reference, {args.steps} steps, kv cache {use_cache}: "
              f"{sum(tokens)} block-0 tokens ({tokens[0]} on step 1, {tokens[-1]} after), median {seconds:.3f} s")
    print(f"tiny: {1 - sum(rows[True][1]) / sum(rows[False][1]):.1%} fewer block tokens, "
          f"{rows[False][0] / rows[True][0]:.2f}x faster with the cache")
    target, prefix = (1024 // 16) ** 2, (1024 // 16) ** 2 + 300
    steps = 40
    full, cached = steps * (target + prefix), (target + prefix) + (steps - 1) * target
    print(f"real 2.1, 1024² + one 1024² reference + 300 prompt tokens, {steps} steps: {full} vs {cached} block tokens "
          f"per block ({1 - cached / full:.1%} fewer linear-layer FLOPs; attention queries likewise)")


if __name__ == "__main__":
    main()
