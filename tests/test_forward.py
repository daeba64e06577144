"""Batched DiT forward (models/qwen_image_edit/forward.py) against DiffSynth's own batch-1 model_fn.

Parity targets (ARCHITECTURE decision 4): batched output equals per-sample runs within
1e-3 relative error in fp32, for mixed target sizes, 1–3 reference images, different
prompt lengths and per-sample timesteps, with zero_cond_t on and off.
"""
from __future__ import annotations

import pytest
import torch

from diffsynth_qie.models.qwen_image_edit import forward as fwd
from diffsynth_qie.models.qwen_image_edit.forward import dit_forward
from diffsynth_qie.tiny.build import TinyQwenImageDiT

TEXT_DIM = 32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def dit():
    torch.manual_seed(0)
    model = TinyQwenImageDiT(num_layers=2).eval()
    # Random init of every parameter: the default zero-ish modulation init would hide bugs
    # in the per-sample modulation (zero_cond_t) path.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def make_sample(gen, h, w, refs, text_len):
    target = torch.randn(16, h, w, generator=gen)
    edits = [torch.randn(16, rh, rw, generator=gen) for rh, rw in refs]
    prompt = torch.randn(text_len, TEXT_DIM, generator=gen)
    return target, edits, prompt


MIXED = [  # (target latent h, w), reference latent sizes, prompt length
    ((8, 8), [(8, 8)], 7),
    ((12, 8), [(8, 12), (4, 4)], 11),
    ((8, 16), [(8, 8), (12, 12), (4, 8)], 5),
]


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_batch_one_matches_diffsynth_model_fn(dit, zero_cond_t):
    from diffsynth.pipelines.qwen_image import model_fn_qwen_image

    gen = torch.Generator().manual_seed(1)
    target, edits, prompt = make_sample(gen, 12, 8, [(8, 12), (4, 4)], 9)
    t = torch.tensor([730.0])
    with torch.no_grad():
        ours = dit_forward(dit, [target], t, [prompt], [edits], zero_cond_t=zero_cond_t)[0]
        ref = model_fn_qwen_image(
            dit=dit, latents=target[None], timestep=t, prompt_emb=prompt[None],
            prompt_emb_mask=torch.ones(1, prompt.shape[0], dtype=torch.long),
            height=target.shape[1] * 8, width=target.shape[2] * 8,
            edit_latents=[e[None] for e in edits], zero_cond_t=zero_cond_t,
        )[0]
    assert ours.shape == target.shape
    assert rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize("per_sample", [False, True], ids=["masked", "per-sample-attention"])
@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_mixed_batch_matches_per_sample(dit, zero_cond_t, per_sample):
    gen = torch.Generator().manual_seed(2)
    samples = [make_sample(gen, *shape, refs, tl) for shape, refs, tl in MIXED]
    timesteps = torch.tensor([900.0, 350.0, 20.0])
    with torch.no_grad():
        batched = dit_forward(
            dit, [s[0] for s in samples], timesteps, [s[2] for s in samples], [s[1] for s in samples],
            zero_cond_t=zero_cond_t, per_sample_attention=per_sample,
        )
        for i, (target, edits, prompt) in enumerate(samples):
            single = dit_forward(dit, [target], timesteps[i : i + 1], [prompt], [edits], zero_cond_t=zero_cond_t)[0]
            assert batched[i].shape == target.shape
            assert rel_err(batched[i], single) < 1e-3, f"sample {i}"


@pytest.mark.parametrize("per_sample", [False, True], ids=["masked", "per-sample-attention"])
def test_padding_values_are_hidden(dit, monkeypatch, per_sample):
    """Fill the padding with garbage instead of zeros: valid outputs must not move."""
    gen = torch.Generator().manual_seed(3)
    samples = [make_sample(gen, *shape, refs, tl) for shape, refs, tl in MIXED]
    args = ([s[0] for s in samples], torch.tensor([500.0, 500.0, 500.0]), [s[2] for s in samples], [s[1] for s in samples])
    with torch.no_grad():
        clean = dit_forward(dit, *args, zero_cond_t=True, per_sample_attention=per_sample)

    original = fwd._pad_stack

    def garbage_pad(items, length):
        out = original(items, length)
        for i, x in enumerate(items):
            out[i, x.shape[0]:] = 1e3 * torch.randn_like(out[i, x.shape[0]:])
        return out

    monkeypatch.setattr(fwd, "_pad_stack", garbage_pad)
    with torch.no_grad():
        noisy = dit_forward(dit, *args, zero_cond_t=True, per_sample_attention=per_sample)
    for a, b in zip(clean, noisy):
        assert rel_err(b, a) < 1e-5


def test_per_sample_attention_calls_sdpa_unmasked_and_keeps_the_gradients(dit):
    """A mixed-length batch's attention without a mask (the flash kernels need none), with gradient
    checkpointing: the recompute takes the same path, and the LoRA-style gradients equal the masked run's."""
    gen = torch.Generator().manual_seed(6)
    samples = [make_sample(gen, *shape, refs, tl) for shape, refs, tl in MIXED]
    timesteps = torch.tensor([700.0, 300.0, 50.0])
    from torch.overrides import TorchFunctionMode

    masks = []

    class Spy(TorchFunctionMode):  # below ours on the mode stack: it sees the calls that reach the kernel
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention:
                masks.append(kwargs.get("attn_mask"))
            return func(*args, **kwargs)

    grads = {}
    for per_sample in (False, True):
        dit.zero_grad(set_to_none=True)
        masks.clear()
        with Spy():
            out = dit_forward(dit, [s[0] for s in samples], timesteps, [s[2] for s in samples],
                              [s[1] for s in samples], zero_cond_t=True, use_gradient_checkpointing=True,
                              per_sample_attention=per_sample)
            sum((o.float() ** 2).mean() for o in out).backward()
        grads[per_sample] = {n: p.grad.clone() for n, p in dit.named_parameters() if p.grad is not None}
        blocks = len(dit.transformer_blocks)
        if per_sample:  # one unmasked call per sample and block (a recompute that differed would raise)
            assert len(masks) >= blocks * len(samples) and all(m is None for m in masks)
        else:
            assert len(masks) >= blocks and all(m is not None for m in masks)
    dit.zero_grad(set_to_none=True)
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 10
    for name, g in grads[False].items():
        assert (grads[True][name] - g).norm() <= 1e-4 * g.norm() + 1e-10, name  # (some are exactly 0)


def test_zero_cond_t_index_is_per_sample(dit):
    gen = torch.Generator().manual_seed(4)
    samples = [make_sample(gen, *shape, refs, tl) for shape, refs, tl in MIXED]
    packed = fwd.pack_batch([s[0] for s in samples], [s[1] for s in samples], [s[2] for s in samples])
    index = fwd.modulate_index(packed, "cpu")
    for b, (target, _, _) in enumerate(samples):
        n_target = target.shape[1] * target.shape[2] // 4
        assert index[b, :n_target].sum() == 0
        assert bool((index[b, n_target:] == 1).all())


def test_uniform_batch_uses_no_mask_and_matches(dit):
    """Equal shapes and prompt lengths: no padding mask (fast attention path), same numbers."""
    gen = torch.Generator().manual_seed(5)
    samples = [make_sample(gen, 8, 8, [(8, 8)], 6) for _ in range(3)]
    packed = fwd.pack_batch([s[0] for s in samples], [s[1] for s in samples], [s[2] for s in samples])
    assert packed.uniform and fwd.key_padding_mask(packed, "cpu") is None
    t = torch.tensor([100.0, 500.0, 999.0])
    with torch.no_grad():
        batched = dit_forward(dit, torch.stack([s[0] for s in samples]), t, [s[2] for s in samples], [s[1] for s in samples], zero_cond_t=True)
        for i, (target, edits, prompt) in enumerate(samples):
            single = dit_forward(dit, [target], t[i : i + 1], [prompt], [edits], zero_cond_t=True)[0]
            assert rel_err(batched[i], single) < 1e-4


def test_bad_inputs_raise(dit):
    target = torch.randn(16, 8, 8)
    with pytest.raises(ValueError, match="one timestep per sample"):
        dit_forward(dit, [target, target], torch.tensor([1.0, 2.0, 3.0]), [torch.randn(4, TEXT_DIM)] * 2)
    with pytest.raises(ValueError, match="even h, w"):
        dit_forward(dit, [torch.randn(16, 7, 8)], torch.tensor([1.0]), [torch.randn(4, TEXT_DIM)])


def test_timesteps_take_the_dit_dtype_as_in_diffsynth(dit, monkeypatch):
    """bf16 DiT: ``dit_forward`` feeds the time embedding 1000·σ rounded to bf16, then /1000 in bf16, exactly
    as DiffSynth's pipeline (``timestep.to(torch_dtype)``) feeds ``model_fn_qwen_image``, whether the caller
    passes fp32 (training, validation) or bf16 timesteps (inference); the outputs equal DiffSynth's."""
    import copy

    from diffsynth.pipelines.qwen_image import model_fn_qwen_image

    bf16 = copy.deepcopy(dit).to(torch.bfloat16)
    seen = []
    original = type(bf16.time_text_embed).forward

    def spy(self, timestep, dtype, *args, **kwargs):
        seen.append(timestep.detach().clone())
        return original(self, timestep, dtype, *args, **kwargs)

    monkeypatch.setattr(type(bf16.time_text_embed), "forward", spy)
    gen = torch.Generator().manual_seed(4)
    target, edits, prompt = (x.to(torch.bfloat16) if isinstance(x, torch.Tensor) else [e.to(torch.bfloat16) for e in x]
                             for x in make_sample(gen, 4, 4, [(4, 4)], 5))
    t32 = torch.tensor([973.7])  # not representable in bf16 (-> 974.0)
    with torch.no_grad():
        ours32 = dit_forward(bf16, [target], t32, [prompt], [edits])[0]
        ours16 = dit_forward(bf16, [target], t32.to(torch.bfloat16), [prompt], [edits])[0]
        ref = model_fn_qwen_image(
            dit=bf16, latents=target[None], timestep=t32.to(torch.bfloat16), prompt_emb=prompt[None],
            prompt_emb_mask=torch.ones(1, prompt.shape[0], dtype=torch.long),
            height=target.shape[1] * 8, width=target.shape[2] * 8, edit_latents=[e[None] for e in edits],
        )[0]
    ours_t, _, ref_t = seen
    assert ours_t.dtype == ref_t.dtype == torch.bfloat16
    assert torch.equal(ours_t, ref_t) and torch.equal(ours_t, t32.to(torch.bfloat16) / 1000)
    assert float(ours_t[0]) != pytest.approx(0.9737, abs=1e-5)  # really rounded
    assert torch.equal(ours32, ours16) and torch.equal(ours32, ref)
