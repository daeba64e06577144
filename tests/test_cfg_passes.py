"""True CFG as one masked batch of 2B or two unmasked passes: the rule, and the same numbers."""
from __future__ import annotations

import torch

from diffsynth_qie.models.qwen_image_edit import forward as fwd
from diffsynth_qie.models.samplers.sampling import Conditioning, predict_velocity, split_cfg
from diffsynth_qie.tiny.build import DIT_SIZES, TinyQwenImageDiT


def conditioning(device, neg_len, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    emb = lambda n: torch.randn(n, DIT_SIZES["text_dim"], generator=g).to(device, dtype)  # noqa: E731
    ref = torch.randn(16, 8, 8, generator=g).to(device, dtype)
    return Conditioning(prompt_embs=[emb(12)], negative_embs=[emb(neg_len)], edit_latents=[[ref]], zero_cond_t=True)


def test_split_and_joint_cfg_give_the_same_velocity():
    torch.manual_seed(0)
    dit = TinyQwenImageDiT(**DIT_SIZES).eval()
    cond = conditioning("cpu", neg_len=5)
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([700.0])
    with torch.no_grad():
        joint = predict_velocity(dit, x, t, cond, cfg=4.0, split=False)
        split = predict_velocity(dit, x, t, cond, cfg=4.0, split=True)
    assert float((joint - split).abs().max() / joint.abs().max()) < 1e-5
    assert split_cfg(x, cond) is False  # the CPU keeps one batch


def test_on_a_gpu_prompts_of_different_lengths_run_as_two_unmasked_passes(monkeypatch):
    from diffsynth_qie.fakegpu.device import FakeCuda

    calls = []
    real = fwd.key_padding_mask

    def spy(packed, device):
        mask = real(packed, device)
        calls.append((len(packed.txt_lens) if hasattr(packed, "txt_lens") else None, mask is None))
        return mask

    monkeypatch.setattr(fwd, "key_padding_mask", spy)
    with FakeCuda() as fc:
        with fc.build(torch.bfloat16, "cuda:0"):
            dit = TinyQwenImageDiT(**DIT_SIZES)
        x = torch.empty(1, 16, 8, 8, device="cuda:0", dtype=torch.bfloat16)
        t = torch.tensor([700.0])
        with torch.no_grad():
            predict_velocity(dit, x, t.to("cuda:0"), conditioning("cuda:0", 5, torch.bfloat16), cfg=4.0)
            assert len(calls) == 2 and all(unmasked for _, unmasked in calls)  # two passes, no key mask
            calls.clear()
            predict_velocity(dit, x, t.to("cuda:0"), conditioning("cuda:0", 12, torch.bfloat16), cfg=4.0)
            assert len(calls) == 1 and calls[0][1]  # equal lengths: one batch of 2, still no mask
