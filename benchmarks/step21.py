"""Qwen-Image-2.1 training step: ours (one DiT call per same-layout group, ``forward21``) beside DiffSynth's own
(``model_fn_qwen_image_21``, one sample per call, as its ``QwenImage21Pipeline`` training path runs it), on the
tiny 2.1 at B = 1 and 4, with the step's model FLOPs and the same count for the full-size 2.1.

    python -m benchmarks.step21 [--repeats 5]

Both sides run the same forward + backward of a rank-4 LoRA on the same samples (one 64x64 target latent grid,
one reference, one prompt length), so any difference is the batching. FLOPs (2.1 is single-stream, SwiGLU MLP;
see ``benchmarks/flops.py`` for the conventions): per block ``2·S·(4d² + 3·d·F) + 4·S²·d`` with ``S`` the joint
tokens (text + image tokens), a LoRA step = 2 x forward.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def forward_flops21(dim: int, ffn: int, layers: int, image_tokens: int, text_tokens: int) -> int:
    """Model FLOPs of one 2.1 forward of one sample (linears and attention; element-wise work not counted)."""
    s = image_tokens + text_tokens
    return layers * (2 * s * (4 * dim * dim + 3 * dim * ffn) + 4 * s * s * dim)


def _samples(b: int, h: int, w: int, text: int, dim_text: int):
    import torch

    from diffsynth_qie.models.qwen_image_21.qwen21 import Prompt21

    g = torch.Generator().manual_seed(0)
    pad = torch.zeros(text, dtype=torch.bool)
    pad[2:2 + (h // 2) * (w // 2)] = True  # the reference's slots (a 2x2 merge of its latents)
    prompt = Prompt21(emb=torch.randn(text, dim_text, generator=g), pad_mask=pad)
    return ([torch.randn(64, h, w, generator=g) for _ in range(b)], torch.rand(b, generator=g) * 1000,
            [prompt] * b, [[torch.randn(64, h, w, generator=g)] for _ in range(b)])


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    import torch
    from diffsynth.pipelines.qwen_image_21 import model_fn_qwen_image_21
    from peft import LoraConfig, inject_adapter_in_model

    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.models.qwen_image_21.qwen21 import forward21
    from diffsynth_qie.tiny.qwen21 import build_tiny21

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny21(Path(tmp) / "tiny21", seed=0)
        dit = load_pipeline("tiny-2.1", model_dir=model_dir, components=("dit",), device="cpu",
                            torch_dtype=torch.float32).dit
    dit = inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]), dit.requires_grad_(False))
    dim, text_dim = dit.img_in.out_features, dit.txt_in.in_layer.in_features
    h = w = 16
    print("| B | ours (s/step) | DiffSynth model_fn per sample (s/step) | ours / stock | step GFLOPs (tiny) |")
    print("| --- | --- | --- | --- | --- |")
    block = dit.transformer_blocks[0]
    ffn = block.img_mlp.proj.out_features
    text = 2 + (h // 2) * (w // 2) + 12
    for b in (1, 4):
        x, t, prompts, refs = _samples(b, h, w, text, text_dim)

        def ours():
            loss = sum(v.square().mean() for v in forward21(dit, x, t, prompts, refs))
            loss.backward()

        def stock():
            loss = 0
            for i in range(b):
                v = model_fn_qwen_image_21(dit, latents=x[i][None], timestep=t[i].reshape(1),
                                           prompt_embeds=prompts[i].emb[None], prompt_embeds_mask=None,
                                           edit_image_pad_mask=prompts[i].pad_mask[None], edit_latents=[refs[i][0][None]])
                loss = loss + v.square().mean()
            loss.backward()

        a, s = _time(ours, args.repeats), _time(stock, args.repeats)
        flops = 2 * b * forward_flops21(dim, ffn, len(dit.transformer_blocks), 2 * h * w // 4 * 4, text)
        print(f"| {b} | {a:.4f} | {s:.4f} | {a / s:.2f} | {flops / 1e9:.3f} |")
    # DiffSynth's QwenImage21DiT defaults: 32 blocks, 32 heads x 128 = 4096 wide, MLP 3x; 1024² = 64x64 tokens
    full = 2 * forward_flops21(4096, 3 * 4096, 32, 2 * 4096, 300)  # 1024² target, one 1024² reference, 300 text
    print(f"full-size 2.1 (32 blocks, d 4096, MLP 3x; 1024² target + one 1024² reference, 300 text tokens): "
          f"{full / 1e12:.1f} TFLOPs per sample per LoRA step")


if __name__ == "__main__":
    main()
