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


def _count_graphs(dit, runs) -> int:
    """Graphs dynamo builds for ``dit``'s compiled blocks over ``runs`` (a counting backend: no code generation)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compile_blocks(dit, backend=counter)
    runs()
    return counter.frame_count


def test_prompt_lengths_do_not_recompile_in_training_or_inference():
    """Every prompt length used to compile its own graph (two in training: the first block's inputs do not require
    grad, the later blocks' do), and past dynamo's recompile_limit (8) the blocks ran eagerly: 6 lengths here
    now build one graph for training, one without grad, and one for the masked (mixed-length) batch."""
    torch.manual_seed(0)
    dit = TinyQwenImageDiT(**{**DIT_SIZES, "num_layers": 2})
    for p in dit.parameters():
        p.requires_grad_(False)
    for block in dit.transformer_blocks:  # a trainable weight inside each block, as a LoRA's
        block.img_mlp.net[2].weight.requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, 8, generator=g)
    lengths = range(5, 11)

    def emb(n):
        return torch.randn(n, DIT_SIZES["text_dim"], generator=g)

    def runs():
        for n in lengths:  # training: forward and backward
            dit_forward(dit, [x], torch.tensor([300.0]), [emb(n)], [[x]], zero_cond_t=True)[0].sum().backward()
        with torch.no_grad():
            for n in lengths:  # validation / inference
                dit_forward(dit, [x], torch.tensor([300.0]), [emb(n)], [[x]], zero_cond_t=True)
            for n in lengths:  # CFG's positive and negative prompts in one batch
                dit_forward(dit, [x, x], torch.tensor([300.0, 300.0]), [emb(n), emb(n + 3)], [[x], [x]],
                            zero_cond_t=True)

    assert _count_graphs(dit, runs) <= 3


def test_compiled_blocks_keep_the_eager_numbers_over_prompt_lengths():
    """The dynamic prompt length and the uniform requires_grad change no value: outputs and LoRA-like gradients
    equal the eager model's for several lengths, mixed batches included."""
    torch.manual_seed(0)
    eager = TinyQwenImageDiT(**{**DIT_SIZES, "num_layers": 2})
    for p in eager.parameters():
        p.requires_grad_(False)
    eager.transformer_blocks[0].txt_mlp.net[2].weight.requires_grad_(True)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compile_blocks(compiled, backend="eager")  # (dynamo's graphs run as they are: the inputs are what changed)
    g = torch.Generator().manual_seed(2)
    x = [torch.randn(16, 8, 8, generator=g), torch.randn(16, 8, 8, generator=g)]
    for lengths in ([7], [11], [4, 9]):
        emb = [torch.randn(n, DIT_SIZES["text_dim"], generator=g) for n in lengths]
        got = []
        for model in (eager, compiled):
            weight = model.transformer_blocks[0].txt_mlp.net[2].weight
            weight.grad = None
            out = dit_forward(model, x[:len(lengths)], torch.full((len(lengths),), 500.0), emb, zero_cond_t=True)
            sum(o.square().sum() for o in out).backward()
            got.append((out, weight.grad))
        for a, b in zip(got[0][0], got[1][0]):
            assert float((a - b).abs().max() / a.abs().max()) < 1e-5
        assert float((got[0][1] - got[1][1]).abs().max() / got[0][1].abs().max()) < 1e-5


def _lora_like(dit):
    """Frozen blocks with one trainable weight inside each (as a LoRA's), and the trainable copy of it."""
    for p in dit.parameters():
        p.requires_grad_(False)
    for block in dit.transformer_blocks:
        block.img_mlp.net[2].weight.requires_grad_(True)
    return dit


def test_checkpoint_inside_the_compiled_blocks_keeps_the_numbers_and_one_graph():
    """Training with the checkpoint inside the compiled region (selective policy) gives the eager numbers of
    DiffSynth's full checkpoint around each block, over two resolutions, two prompt lengths and one or two
    references, in one graph for the checkpointed forward; the blocks own the checkpoint (the loop around them
    does not checkpoint again: its recompute would run each block a third time)."""
    from diffsynth_qie.models.load import block_checkpoint
    from diffsynth_qie.models.load.compile import compile_counts
    from diffsynth_qie.models.qwen_image_edit.edit_ops import EditOps

    torch.manual_seed(0)
    eager = _lora_like(TinyQwenImageDiT(**{**DIT_SIZES, "num_layers": 2}))
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compile_blocks(compiled, backend="aot_eager", checkpointed=[True, True], policy="selective")

    g = torch.Generator().manual_seed(1)
    ops = EditOps()
    for h, w, n, refs in ((8, 8, 5, 1), (8, 12, 9, 2)):
        x = torch.randn(16, h, w, generator=g)
        emb, ref = torch.randn(n, DIT_SIZES["text_dim"], generator=g), [torch.randn(16, h, w, generator=g)] * refs
        grads = []
        for model in (eager, compiled):
            model.zero_grad()
            out = ops.forward(model, [x], torch.tensor([400.0]), [emb], [ref], zero_cond_t=True,
                              use_gradient_checkpointing=True)
            out[0].square().sum().backward()
            grads.append((out[0], model.transformer_blocks[1].img_mlp.net[2].weight.grad.clone()))
        (a, ga), (b, gb) = grads
        assert float((a - b).abs().max() / a.abs().max()) < 1e-5
        assert float((ga - gb).abs().max() / ga.abs().max()) < 1e-5
    assert block_checkpoint.outer_checkpointing(compiled, True) is False
    assert block_checkpoint.outer_checkpointing(eager, True) is True
    counts = compile_counts(compiled)
    assert counts == {"graphs": 1, "recompiles": 0}, counts


def _kept_counter():
    """A dispatch mode counting the operators the selective policy keeps (large GEMMs, attention) as they run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from diffsynth_qie.models.load.block_checkpoint import kept

    class Kept(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += kept(func, args)
            return func(*args, **(kwargs or {}))

    return Kept


def test_selective_policy_keeps_the_gemms_and_gives_the_full_checkpoints_gradients():
    """Eager, without compiling: the selective policy's backward recomputes no large GEMM and no attention (the full
    policy recomputes every one), and its gradients equal the full checkpoint's bit for bit."""
    from diffsynth_qie.models.load.block_checkpoint import own_checkpointing
    from diffsynth_qie.models.qwen_image_edit.edit_ops import EditOps

    Kept = _kept_counter()
    torch.manual_seed(0)
    base = _lora_like(TinyQwenImageDiT(**{**DIT_SIZES, "num_layers": 2}))
    g = torch.Generator().manual_seed(3)
    x, emb = torch.randn(16, 8, 8, generator=g), torch.randn(6, DIT_SIZES["text_dim"], generator=g)
    results = {}
    for policy in ("full", "selective"):
        model = copy.deepcopy(base)
        own_checkpointing(model, [True, True], policy)
        out = EditOps().forward(model, [x], torch.tensor([400.0]), [emb], [[x]], zero_cond_t=True,
                                use_gradient_checkpointing=True)
        with Kept() as mode:
            out[0].square().sum().backward()
        results[policy] = (mode.count, model.transformer_blocks[0].img_mlp.net[2].weight.grad)
    assert results["full"][0] > 0 and results["selective"][0] == 0
    assert torch.equal(results["full"][1], results["selective"][1])


def test_partly_checkpointed_blocks_give_the_fully_checkpointed_gradients_and_recompute_only_theirs():
    """--checkpoint_blocks: eager, the first of two blocks checkpointed gives the gradients of both checkpointed (and
    of none) bit for bit, for every trainable weight; only the checkpointed block's forward runs again in backward."""
    from diffsynth_qie.models.load.block_checkpoint import own_checkpointing, spread
    from diffsynth_qie.models.qwen_image_edit.edit_ops import EditOps

    Gemms = _kept_counter()
    torch.manual_seed(0)
    base = _lora_like(TinyQwenImageDiT(**{**DIT_SIZES, "num_layers": 2}))
    g = torch.Generator().manual_seed(5)
    x, emb = torch.randn(16, 8, 8, generator=g), torch.randn(7, DIT_SIZES["text_dim"], generator=g)
    results = {}
    for count in (0, 1, 2):
        model = copy.deepcopy(base)
        assert own_checkpointing(model, spread(count, 2), "full") == count
        out = EditOps().forward(model, [x], torch.tensor([300.0]), [emb], [[x]], zero_cond_t=True,
                                use_gradient_checkpointing=True)
        with Gemms() as mode:
            out[0].square().sum().backward()
        results[count] = (mode.count, [b.img_mlp.net[2].weight.grad for b in model.transformer_blocks])
    assert results[0][0] == 0 < results[1][0] and results[2][0] == 2 * results[1][0]
    for count in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(results[count][1], results[2][1]))


def test_fp8_compute_runs_inside_the_compiled_selectively_checkpointed_blocks():
    """`--compile --checkpoint_policy selective --fp8_compute` together: the FP8 layers' autograd function traces
    into the compiled, checkpointed block (aot_eager) in one graph and gives the eager FP8 numbers (output and the
    trainable weight's gradient) of DiffSynth's full checkpoint around each block."""
    from diffsynth_qie.memory.fp8 import quantize_linears
    from diffsynth_qie.memory.fp8_compute import enable_fp8_compute
    from diffsynth_qie.models.load.compile import compile_counts
    from diffsynth_qie.models.qwen_image_edit.edit_ops import EditOps

    torch.manual_seed(0)
    eager = _lora_like(TinyQwenImageDiT(**{**DIT_SIZES, "num_layers": 2}))
    quantize_linears(eager)
    assert enable_fp8_compute(eager) > 0
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compile_blocks(compiled, backend="aot_eager", checkpointed=[True, True], policy="selective")
    g = torch.Generator().manual_seed(1)
    x, emb = torch.randn(16, 8, 8, generator=g), torch.randn(5, DIT_SIZES["text_dim"], generator=g)
    ref = [torch.randn(16, 8, 8, generator=g)]
    got = []
    for model in (eager, compiled):
        out = EditOps().forward(model, [x], torch.tensor([400.0]), [emb], [ref], zero_cond_t=True,
                                use_gradient_checkpointing=True)
        out[0].square().sum().backward()
        got.append((out[0], model.transformer_blocks[1].img_mlp.net[2].weight.grad))
    (a, ga), (b, gb) = got
    assert float((a - b).abs().max() / a.abs().max()) < 1e-5
    assert float((ga - gb).abs().max() / ga.abs().max()) < 1e-5
    assert compile_counts(compiled) == {"graphs": 1, "recompiles": 0}
