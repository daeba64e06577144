"""Block swapping (``memory/block_swap.py``): same numbers, expected swap order, clear errors.

On the CPU the swapper moves between two host tensor sets. ``PoisonTransport`` makes an
evicted weight NaN, so a block that runs (forward, recompute or backward) while it is
not swapped in turns the loss, the gradients or the latents into NaN: bit-equality with
the unswapped run proves the hooks swap in every block before each use.
"""
from __future__ import annotations

import pytest
import torch

from diffsynth_qie.memory.block_swap import BlockSwapper, HostTransport


class PoisonTransport(HostTransport):
    def evicted(self, master):
        return torch.full_like(master, float("nan"))


def poisoned(dit, n, **kw) -> BlockSwapper:
    return BlockSwapper(dit, n, "cpu", "cpu", transport=PoisonTransport("cpu", "cpu"), record_events=True, **kw)


def fresh_dit(model_dir):
    from diffsynth_qie.models.load.loading import load_pipeline

    return load_pipeline("tiny", model_dir=model_dir, components=("dit",), device="cpu",
                         torch_dtype=torch.float32).dit


def expected_forward(swapped: list[int], keep_last: bool) -> list[tuple[str, int]]:
    """The forward order the design promises: each block fetched one block ahead, in, out."""
    events = [("fetch", swapped[0])]
    for k, i in enumerate(swapped):
        events.append(("in", i))
        if k + 1 < len(swapped):
            events.append(("fetch", swapped[k + 1]))
        events.append(("keep" if keep_last and k + 1 == len(swapped) else "out", i))
    return events


def expected_backward(swapped: list[int]) -> list[tuple[str, int]]:
    """Backward: last block first (kept from the forward), the one below prefetched, all out at the end."""
    events = []
    rev = swapped[::-1]
    for k, i in enumerate(rev):
        if k > 0:
            events += [("out", rev[k - 1]), ("in", i)]
        if k + 1 < len(rev):
            events.append(("fetch", rev[k + 1]))
    return events + [("out", rev[-1])]


def _random_inputs(dit, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 16, 8, 8, generator=g)
    prompts = [torch.randn(5 + b, dit.txt_in.in_features, generator=g) for b in range(batch)]
    edits = [[torch.randn(16, 8, 8, generator=g)] for _ in range(batch)]
    return latents, torch.tensor([300.0, 700.0][:batch]), prompts, edits


# --- errors and real-scale sizes ----------------------------------------------------------
def test_out_of_range_is_a_clear_value_error(tiny_model_dir):
    dit = fresh_dit(tiny_model_dir)
    blocks = len(dit.transformer_blocks)
    for bad in (0, -1, blocks + 1, 1.5, True):
        with pytest.raises(ValueError, match=rf"--blocks_to_swap {bad!r} is out of range.*{blocks} blocks"):
            BlockSwapper(dit, bad, "cpu")
    from diffsynth_qie.training.config import RunConfig, TrainConfig, validate

    with pytest.raises(ValueError, match="--blocks_to_swap must be >= 0"):
        validate(RunConfig(train=TrainConfig(cache_dir="c", output_dir="o", blocks_to_swap=-2)))


def test_real_dit_on_meta_offloads_n_blocks_of_frozen_weights():
    """The real 60-block DiT (built on the meta device): bytes off the GPU = N × one block."""
    from diffsynth.models.qwen_image_dit import QwenImageDiT

    with torch.device("meta"):
        dit = QwenImageDiT().to(torch.bfloat16).requires_grad_(False)
    per_block = sum(p.numel() * p.element_size() for p in dit.transformer_blocks[0].parameters())
    total = sum(p.numel() * p.element_size() for p in dit.parameters())
    assert len(dit.transformer_blocks) == 60 and 0.6e9 < per_block < 0.75e9 and 39e9 < total < 42e9
    with pytest.raises(ValueError, match="1 to 60"):
        BlockSwapper(dit, 61, "meta", "meta")
    for n in (16, 45):
        swapper = BlockSwapper(dit, n, "meta", "meta", transport=HostTransport("meta", "meta")).install()
        assert swapper.swapped == list(range(60 - n, 60))
        assert swapper.offloaded_bytes() == n * per_block
        assert len(swapper.offloaded_names()) == n * len(list(dit.transformer_blocks[0].parameters()))
        swapper.remove()


# --- forward / backward parity and order ----------------------------------------------------
def _loss_and_grads(dit, inputs, checkpointing):
    from diffsynth_qie.models.qwen_image_edit.forward import dit_forward

    latents, t, prompts, edits = inputs
    out = dit_forward(dit, latents, t, prompts, edits, zero_cond_t=True, use_gradient_checkpointing=checkpointing)
    loss = sum((o.float() ** 2).mean() for o in out)
    dit.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in dit.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_loss_and_gradients_identical_and_swap_order(tiny_model_dir, checkpointing):
    """Four blocks, three swapped, a trainable tensor inside a swapped block and one outside."""
    from diffsynth_qie.tiny.build import TinyQwenImageDiT

    torch.manual_seed(0)
    dit = TinyQwenImageDiT(num_layers=4).float()
    dit.requires_grad_(False)
    trainable = [dit.transformer_blocks[2].attn.to_q.weight, dit.transformer_blocks[0].img_mlp.net[2].weight,
                 dit.proj_out.weight]
    for p in trainable:
        p.requires_grad_(True)
    inputs = _random_inputs(dit)
    loss0, grads0 = _loss_and_grads(dit, inputs, checkpointing)
    weights = {n: p.detach().clone() for n, p in dit.named_parameters()}

    swapper = poisoned(dit, 3).install()
    assert swapper.swapped == [1, 2, 3]
    assert trainable[0] is dit.transformer_blocks[2].attn.to_q.weight and not torch.isnan(trainable[0]).any()
    assert torch.isnan(dit.transformer_blocks[2].attn.to_k.weight).all()  # evicted between uses
    for step in range(2):  # the second step runs from the state the first left behind
        swapper.events.clear()
        loss1, grads1 = _loss_and_grads(dit, inputs, checkpointing)
        assert torch.equal(loss0, loss1), (step, loss0.item(), loss1.item())
        assert grads1.keys() == grads0.keys() and len(grads0) == 3
        for n in grads0:
            assert torch.equal(grads0[n], grads1[n]), n
        assert swapper.events == expected_forward([1, 2, 3], keep_last=True) + expected_backward([1, 2, 3])
        assert not swapper._resident and not swapper._pending
    swapper.remove()
    assert all(torch.equal(weights[n], p) for n, p in dit.named_parameters())


def test_no_grad_forward_swaps_each_block_out_after_it_runs(tiny_model_dir):
    from diffsynth_qie.models.qwen_image_edit.forward import dit_forward
    from diffsynth_qie.tiny.build import TinyQwenImageDiT

    torch.manual_seed(1)
    dit = TinyQwenImageDiT(num_layers=4).float().requires_grad_(False)
    latents, t, prompts, edits = _random_inputs(dit)
    with torch.no_grad():
        ref = dit_forward(dit, latents, t, prompts, edits)
        for n in (1, 2, 4):
            swapper = poisoned(dit, n).install()
            out = dit_forward(dit, latents, t, prompts, edits)
            assert all(torch.equal(a, b) for a, b in zip(ref, out)), n
            assert swapper.events == expected_forward(swapper.swapped, keep_last=False), n
            swapper.remove()


def test_training_module_loss_and_lora_gradients_identical(tiny_model_dir, cache_dir, tmp_path):
    """The real training loss (QIETrainingModule, PEFT LoRA, gradient checkpointing) on a cached batch."""
    from diffsynth_qie.cache.store import CacheStore
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.config import RunConfig, TrainConfig
    from diffsynth_qie.training.data import CacheDataset, CachePart, SampleKey, collate
    from diffsynth_qie.training.module import QIETrainingModule

    cfg = RunConfig(train=TrainConfig(cache_dir=str(cache_dir), output_dir=str(tmp_path), model="tiny",
                                      model_dir=str(tiny_model_dir))).resolved(get_preset("tiny"))
    store = CacheStore.open(cache_dir)
    ds = CacheDataset.from_parts([CachePart(store, tuple(range(len(store))))])
    batch = collate([ds[SampleKey(i, 0)] for i in range(min(2, len(ds)))])

    def step(module):
        module.zero_grad(set_to_none=True)
        loss, _ = module(batch, torch.Generator().manual_seed(3))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in module.trainable_named_parameters()
                               if p.grad is not None}

    modules = []
    for _ in range(2):
        torch.manual_seed(0)
        m = QIETrainingModule(fresh_dit(tiny_model_dir), cfg, "tiny")
        with torch.no_grad():  # non-zero LoRA B so every LoRA tensor gets a gradient
            for n, p in m.trainable_named_parameters():
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
        modules.append(m)
    loss0, grads0 = step(modules[0])
    blocks = len(modules[1].dit.transformer_blocks)
    swapper = poisoned(modules[1].dit, blocks).install()
    loss1, grads1 = step(modules[1])
    assert torch.isfinite(loss0) and torch.equal(loss0, loss1)
    in_blocks = [n for n in grads0 if "transformer_blocks" in n and "lora_" in n]
    assert len(in_blocks) >= blocks and grads0.keys() == grads1.keys()
    for n in grads0:
        assert torch.equal(grads0[n], grads1[n]), n
    assert [e for e in swapper.events if e[0] == "in"] == [("in", i) for i in range(blocks)] + \
        [("in", i) for i in reversed(range(blocks - 1))]  # the last block is kept for the backward


def test_edit_latents_identical(tiny_model_dir):
    from diffsynth_qie.inference.editor import EditRequest, Editor
    from diffsynth_qie.models.load.loading import load_pipeline
    from PIL import Image

    pipe = load_pipeline("tiny", model_dir=tiny_model_dir, device="cpu", torch_dtype=torch.float32)
    image = Image.new("RGB", (64, 48), (200, 80, 40))
    request = EditRequest(images=[image], prompt="make it blue", steps=3, cfg=2.0, seed=4)
    pipe.dit.requires_grad_(False)
    ref = Editor(pipe).edit(request).latents
    swapper = poisoned(pipe.dit, len(pipe.dit.transformer_blocks)).install()
    assert torch.equal(Editor(pipe).edit(request).latents, ref)
    # 3 steps × one batched CFG forward, every block swapped in once per forward
    assert sum(e[0] == "in" for e in swapper.events) == 3 * len(pipe.dit.transformer_blocks)
    swapper.remove()
    editor = Editor(pipe, blocks_to_swap=1)  # the product path: default host transport
    assert editor.block_swapper.swapped == [len(pipe.dit.transformer_blocks) - 1]
    assert torch.equal(editor.edit(request).latents, ref)
    editor.block_swapper.remove()
    with pytest.raises(ValueError, match="cpu_offload"):
        Editor(pipe, cpu_offload=True, blocks_to_swap=1)


def test_qie_train_with_swapping_trains_the_same_lora(tiny_model_dir, cache_dir, tmp_path, monkeypatch):
    """The whole loop (accelerate, no device placement, optimizer, save): same losses, same LoRA."""
    from safetensors.torch import load_file

    from diffsynth_qie.training import loop, placement
    from diffsynth_qie.training.config import RunConfig, TrainConfig

    made = []

    class Recording(BlockSwapper):  # the loop's own swapper (host transport), with its events recorded
        def __init__(self, *args, **kw):
            super().__init__(*args, record_events=True, **kw)
            made.append(self)

    monkeypatch.setattr(placement, "BlockSwapper", Recording)
    results = {}
    for n in (0, 2):
        cfg = RunConfig(train=TrainConfig(cache_dir=str(cache_dir), output_dir=str(tmp_path / f"swap{n}"),
                                          model="tiny", model_dir=str(tiny_model_dir), max_steps=3, save_every=0,
                                          device="cpu", blocks_to_swap=n))
        result = loop.train(cfg)
        results[n] = (result.losses, load_file(result.lora_path))
    (losses0, lora0), (losses2, lora2) = results[0], results[2]
    assert len(losses0) == 3 and losses0 == losses2
    assert lora0.keys() == lora2.keys() and all(torch.equal(lora0[k], lora2[k]) for k in lora0)
    assert any(not torch.equal(lora0[k], torch.zeros_like(lora0[k])) for k in lora0 if "lora_B" in k)
    assert len(made) == 1 and made[0].swapped == [0, 1]
    assert sum(e == ("in", 0) for e in made[0].events) >= 2 * 3  # forward and backward of every step


def test_deepspeed_is_refused_by_name():
    from diffsynth_qie.training.config import RunConfig, TrainConfig
    from diffsynth_qie.training.placement import install_block_swap

    cfg = RunConfig(train=TrainConfig(cache_dir="c", output_dir="o", blocks_to_swap=4))
    with pytest.raises(ValueError, match="--blocks_to_swap 4 does not work under DeepSpeed"):
        install_block_swap(object(), cfg, object(), {"zero_optimization": {"stage": 2}})
    assert install_block_swap(object(), RunConfig(train=TrainConfig(cache_dir="c", output_dir="o")), object(),
                              {"zero_optimization": {"stage": 3}}) is None


def test_a_swapped_block_is_one_allocation_of_its_exact_size():
    """One (pinned) buffer per block, tensors carved out at aligned offsets; a buffer per
    tensor cost 1.58x at the real shapes (the pinned allocator rounds each allocation to a power of two)."""
    from diffsynth.models.qwen_image_dit import QwenImageDiT

    from diffsynth_qie.memory.block_swap import ALIGN, block_layout

    with torch.device("meta"):
        dit = QwenImageDiT(num_layers=2).to(torch.bfloat16).requires_grad_(False)
    tensors = [p for p in dit.transformer_blocks[0].parameters()]
    offsets, total = block_layout(tensors)
    exact = sum(t.numel() * t.element_size() for t in tensors)
    assert all(o % ALIGN == 0 for o in offsets) and exact <= total < exact + ALIGN * len(tensors)
    assert total < 1.01 * exact  # the per-tensor power-of-two rounding made this 1.58x
    swapper = BlockSwapper(dit, 1, "meta", "meta", transport=HostTransport("meta", "meta")).install()
    masters = [m for _, m in swapper._masters[1].values()]
    assert len({m.untyped_storage().nbytes() for m in masters}) == 1 and masters[0].untyped_storage().nbytes() == total
    assert swapper.offloaded_bytes() == exact
    swapper.remove()
