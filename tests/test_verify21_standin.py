"""The 2.1 DiT's host-bookkeeping stand-in (``fakegpu/standin21.py``) computes what DiffSynth's forward computes.

Real tensors on the CPU, DiffSynth's tiny 2.1 DiT: the stand-in's output and gradients must equal DiffSynth's own
``QwenImage21DiT.forward`` through DiffSynth's ``model_fn_qwen_image_21``, with and without references, with a
key mask, and over the prefix KV cache's fill and decode calls. A DiffSynth upgrade that changes the mirrored
lines fails here.
"""
from __future__ import annotations

import pytest
import torch


def _tiny_dit():
    from diffsynth_qie.tiny.qwen21 import tiny_dit

    torch.manual_seed(0)
    dit = tiny_dit()
    with torch.no_grad():  # DiffSynth's zero-initialised norms would hide a wrong row
        for p in dit.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return dit


def _inputs(refs: list[tuple[int, int]], text: int = 7, target=(4, 6), seed: int = 1):
    """Latents, timestep, prompt embeddings and the slot mask laid out as the 2.1 prompt encoder gives them:
    a template head, per reference two markers around its slots (one per 2x2 latents), the prompt text."""
    g = torch.Generator().manual_seed(seed)
    mask = [False] * 3
    for h, w in refs:
        mask += [False] * 2 + [True] * (h * w // 4) + [False]
    mask += [False] * text
    pad = torch.tensor(mask)[None]
    return dict(latents=torch.randn(1, 64, *target, generator=g), timestep=torch.tensor([0.6]),
                prompt_embeds=torch.randn(1, pad.shape[1], 32, generator=g), edit_image_pad_mask=pad,
                edit_latents=[torch.randn(1, 64, h, w, generator=g) for h, w in refs] or None)


def _run(dit, inputs, standin: bool, **kwargs):
    from diffsynth.pipelines.qwen_image_21 import model_fn_qwen_image_21

    from diffsynth_qie.fakegpu.standin21 import host_bookkeeping21

    dit.zero_grad(set_to_none=True)
    with host_bookkeeping21() if standin else torch.enable_grad():
        out = model_fn_qwen_image_21(dit, **inputs, **kwargs)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in dit.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("refs", [[], [(4, 4)], [(2, 6), (4, 2)]], ids=["no-ref", "one-ref", "two-refs"])
@pytest.mark.parametrize("key_mask", [False, True], ids=["no-key-mask", "key-mask"])
def test_the_standin_gives_diffsynths_output_and_gradients(refs, key_mask):
    dit = _tiny_dit()
    inputs = _inputs(refs)
    mask = None
    if key_mask:  # the last two prompt tokens padded away
        mask = torch.ones(inputs["edit_image_pad_mask"].shape, dtype=torch.long)
        mask[:, -2:] = 0
    want, want_grads = _run(dit, inputs, standin=False, prompt_embeds_mask=mask)
    got, got_grads = _run(dit, inputs, standin=True, prompt_embeds_mask=mask)
    assert torch.equal(got, want)
    assert want_grads.keys() == got_grads.keys() and len(want_grads) > 10
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_the_standin_fills_and_reads_the_prefix_kv_cache_as_diffsynth_does():
    from diffsynth_qie.models.qwen_image_21.qwen21 import new_kv_cache

    dit = _tiny_dit().requires_grad_(False)
    inputs = _inputs([(4, 4), (2, 6)])
    results = {}
    for standin in (False, True):
        cache = new_kv_cache(dit)
        outs = []
        for step, t in enumerate((0.9, 0.4, 0.1)):  # the first call fills the cache, the others decode
            step_inputs = dict(inputs, timestep=torch.tensor([t]),
                               latents=inputs["latents"] * (1 + step))
            with torch.no_grad():
                outs.append(_run_no_grad(dit, step_inputs, standin, cache))
        results[standin] = outs, cache
    (want, want_cache), (got, got_cache) = results[False], results[True]
    for w, g in zip(want, got):
        assert torch.equal(g, w)
    assert all(torch.equal(gb[k], wb[k]) for gb, wb in zip(got_cache, want_cache) for k in ("key", "value"))
    prefix = int((~inputs["edit_image_pad_mask"][0]).sum()) + 4 * int(inputs["edit_image_pad_mask"].sum())
    assert got_cache[0]["key"].shape[1] == prefix  # every prefix token, nothing of the target


def _run_no_grad(dit, inputs, standin, cache):
    from diffsynth.pipelines.qwen_image_21 import model_fn_qwen_image_21

    from diffsynth_qie.fakegpu.standin21 import host_bookkeeping21

    with host_bookkeeping21() if standin else torch.no_grad():
        return model_fn_qwen_image_21(dit, **inputs, prompt_embeds_mask=None, kv_cache=cache)


def test_the_context_restores_diffsynths_forward():
    from diffsynth.models.qwen_image_21_dit import QwenImage21DiT

    from diffsynth_qie.fakegpu.standin21 import host_bookkeeping21

    original = QwenImage21DiT.__dict__["forward"]
    with pytest.raises(KeyError):
        with host_bookkeeping21():
            assert QwenImage21DiT.__dict__["forward"] is not original
            raise KeyError("inside")
    assert QwenImage21DiT.__dict__["forward"] is original
