"""``--compile``: the compiled blocks give the eager numbers, forward and backward."""
from __future__ import annotations

import copy

import torch

from diffsynth_qie.models.load.compile import compile_blocks
from diffsynth_qie.models.qwen_image_edit.forward import dit_forward
from diffsynth_qie.tiny.build import DIT_SIZES, TinyQwenImageDiT


def test_compiled_blocks_match_eager_forward_and_backward():
    torch.manual_seed(0)
    eager = TinyQwenImageDiT(**DIT_SIZES)
    compiled = copy.deepcopy(eager)
    # aot_eager traces every block through dynamo and AOTAutograd as inductor would (graph breaks, hooks,
    # autograd), without spending minutes on C++ code generation on a CPU test machine
    assert compile_blocks(compiled, backend="aot_eager") == DIT_SIZES["num_layers"]
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(16, 8, 8, generator=g), torch.randn(16, 8, 12, generator=g)]
    emb = [torch.randn(9, DIT_SIZES["text_dim"], generator=g), torch.randn(6, DIT_SIZES["text_dim"], generator=g)]
    refs = [[torch.randn(16, 8, 8, generator=g)], [torch.randn(16, 8, 12, generator=g)]]
    t = torch.tensor([300.0, 800.0])
    outs = []
    for model in (eager, compiled):
        out = dit_forward(model, x, t, emb, refs, zero_cond_t=True)
        sum(o.square().sum() for o in out).backward()
        outs.append((out, model.transformer_blocks[0].img_mlp.net[2].weight.grad))
    for a, b in zip(outs[0][0], outs[1][0]):
        assert float((a - b).abs().max() / a.abs().max()) < 1e-5
    assert float((outs[0][1] - outs[1][1]).abs().max() / outs[0][1].abs().max()) < 1e-5
