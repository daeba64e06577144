"""``--compute_precision``: the pure-bf16 step over fp32 LoRA masters against the autocast step and fp32, the
benchmarks' set-up against ``qie train``'s, and the small step-start items (fused AdamW, pinned batch copies).

bf16 on this CPU is slow: the numerics run on the tiny DiT at 8×8 latents only. The fp32 runs (every other
training test, the pinned loss curve) do not pass through any of this: the test at the end checks that."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from diffsynth_qie.models.presets import get_preset
from diffsynth_qie.tiny.build import DIT_SIZES, TinyQwenImageDiT
from diffsynth_qie.training.config import LoRAConfig, RunConfig, TrainConfig
from diffsynth_qie.training.placement import training_module
from diffsynth_qie.training.precision import CastLinear, autocast_dtype

#: relative difference allowed between the loss of a pure-bf16 step and the autocast step (and fp32) on the same
#: sample, σ and noise: half a bf16 step (2^-8 ≈ 3.9e-3); measured up to 7.9e-4 (docs/DIFFSYNTH_NOTES.md)
LOSS_TOLERANCE = 2e-3
#: cosine between the LoRA gradients of a bf16 step (pure or autocast) and the fp32 step; measured ≥ 0.9916
GRAD_COSINE = 0.98


def tiny_config(precision: str = "auto", **lora) -> RunConfig:
    train = TrainConfig(model="tiny", cache_dir="-", output_dir="-", cfg_dropout=0.0, gradient_checkpointing=True,
                        compute_precision=precision)
    return RunConfig(train=train, lora=LoRAConfig(lora_rank=4, **lora)).resolved(get_preset("tiny"))


def tiny_module(dtype: torch.dtype, precision: str = "auto", **lora):
    """The training module over the tiny DiT (the same weights for every dtype), LoRA B made non-zero."""
    torch.manual_seed(0)
    dit = TinyQwenImageDiT(**DIT_SIZES).to(dtype)
    torch.manual_seed(1)
    module = training_module(dit, tiny_config(precision, **lora), "tiny", torch.device("cpu"), dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:  # PEFT starts B at 0: the LoRA would not reach the loss
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    return module


def tiny_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"target_latents": [torch.randn(16, 8, 8, generator=g) for _ in range(2)],
            "edit_latents": [[torch.randn(16, 8, 8, generator=g)] for _ in range(2)],
            "prompt_emb": [torch.randn(7, DIT_SIZES["text_dim"], generator=g) for _ in range(2)],
            "back_mask": [None, None]}


def loss_and_grad(module, batch: dict, seed: int) -> tuple[float, torch.Tensor]:
    loss, _ = module(batch, torch.Generator().manual_seed(seed))
    loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.trainable_modules()]
    assert all(g.dtype == torch.float32 for g in grads)  # fp32 masters get fp32 gradients
    return float(loss.detach()), torch.cat([g.flatten() for g in grads])


@pytest.fixture
def cuda_like_autocast(monkeypatch):
    """CPU autocast keeps ``layer_norm`` in bf16; CUDA's computes it in fp32 (and the modulation after it then
    runs in fp32 too), which is what ``autocast`` means on a GPU. The fixture makes CPU autocast do the same."""
    layer_norm = torch.nn.functional.layer_norm

    def fp32_under_autocast(x, shape, weight=None, bias=None, eps=1e-5):
        if torch.is_autocast_enabled("cpu"):
            cast = (lambda t: None if t is None else t.float())
            return layer_norm(x.float(), shape, cast(weight), cast(bias), eps)
        return layer_norm(x, shape, weight, bias, eps)

    monkeypatch.setattr(torch.nn.functional, "layer_norm", fp32_under_autocast)


def test_pure_bf16_step_matches_the_autocast_step_and_fp32_within_tolerance(cuda_like_autocast):
    pure, auto, fp32 = (tiny_module(torch.bfloat16, "pure"), tiny_module(torch.bfloat16, "autocast"),
                        tiny_module(torch.float32))
    assert pure.autocast_dtype is None and auto.autocast_dtype == torch.bfloat16 and fp32.autocast_dtype is None
    assert all(p.dtype == torch.float32 for m in (pure, auto) for p in m.trainable_modules())
    assert any(isinstance(m, CastLinear) for m in pure.modules())
    batch = tiny_batch(1)  # (the draw of the largest difference to fp32 among those measured)
    (lp, gp), (la, ga), (lf, gf) = (loss_and_grad(m, batch, 11) for m in (pure, auto, fp32))
    assert abs(lp - la) <= LOSS_TOLERANCE * abs(la), (lp, la)
    assert abs(lp - lf) <= LOSS_TOLERANCE * abs(lf), (lp, lf)
    cos_pure, cos_auto = (torch.nn.functional.cosine_similarity(g, gf, 0) for g in (gp, ga))
    assert cos_pure >= GRAD_COSINE and cos_pure >= cos_auto - 0.005, (cos_pure, cos_auto)
    # the bounds can fail: another σ and noise draw moves the loss and the gradient by more than they allow
    fp32.zero_grad(set_to_none=True)
    (l_a, g_a), (l_b, g_b) = (loss_and_grad(fp32, batch, seed) for seed in (11, 12))
    assert abs(l_a - l_b) > LOSS_TOLERANCE * abs(l_a)
    assert torch.nn.functional.cosine_similarity(g_a, g_b - g_a, 0) < GRAD_COSINE  # (grads accumulate)


def test_an_adapted_layer_computes_with_its_fp32_masters_rounded_to_bf16():
    """Pure bf16: base + scale·B(A(x)) with A and B rounded to bf16, bit for bit, and the weight gradients of that
    bf16 computation reach the fp32 masters."""
    module = tiny_module(torch.bfloat16, "pure")
    layer = next(m for m in module.dit.modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = torch.randn(5, a.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    out = layer(x)
    a16, b16 = (w.detach().bfloat16().requires_grad_() for w in (a, b))
    ref = layer.base_layer(x) + (x @ a16.T @ b16.T) * layer.scaling["default"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    assert a.grad.dtype == b.grad.dtype == torch.float32
    assert torch.equal(a.grad, a16.grad.float()) and torch.equal(b.grad, b16.grad.float())


def test_pure_bf16_trains_full_finetune_modules_of_any_kind():
    """A fully trained RMSNorm (``txt_norm``) and linear (``img_in``) keep fp32 weights under pure bf16: the
    linear casts its weight per call, the norm returns its input's dtype (its fp32 weight would promote it)."""
    module = tiny_module(torch.bfloat16, "pure", full_finetune_modules=["txt_norm", "img_in"])
    seen = []
    module.dit.txt_norm.register_forward_hook(lambda m, a, out: seen.append(out.dtype))  # (returns None)
    loss_and_grad(module, tiny_batch(0), 10)
    assert seen == [torch.bfloat16]
    assert module.dit.txt_norm.weight.dtype == torch.float32 and module.dit.txt_norm.weight.grad is not None
    assert isinstance(module.dit.img_in, CastLinear) and module.dit.img_in.weight.grad.dtype == torch.float32


def test_compute_precision_choices():
    assert autocast_dtype("auto", torch.bfloat16) is None
    assert autocast_dtype("auto", torch.float16) == torch.float16
    assert autocast_dtype("autocast", torch.bfloat16) == torch.bfloat16
    assert autocast_dtype("autocast", torch.float32) is None and autocast_dtype("pure", torch.float32) is None
    with pytest.raises(ValueError, match="--compute_precision pure computes in bf16.*--mixed_precision is float16"):
        autocast_dtype("pure", torch.float16)


def test_fp32_modules_are_left_as_they_were():
    """Without mixed precision nothing is cast, hooked or autocast: the CPU runs (and the pinned curve) keep
    PEFT's own layers bit for bit."""
    module = tiny_module(torch.float32, "pure")
    assert module.autocast_dtype is None
    assert not any(isinstance(m, CastLinear) or m._forward_hooks for m in module.modules())
    assert all(getattr(m, "cast_input_dtype_enabled", True) for m in module.modules())


# --- the benchmarks build the step as qie train does ----------------------------------------------------
def setup_of(module) -> dict:
    """What decides how the module computes: every module's class, PEFT's input cast, hooks; every parameter's
    dtype and trainability; the module's autocast."""
    return {"modules": {n: (type(m).__name__, getattr(m, "cast_input_dtype_enabled", None), len(m._forward_hooks),
                            len(m._forward_pre_hooks)) for n, m in module.dit.named_modules()},
            "params": {n: (p.dtype, p.requires_grad) for n, p in module.dit.named_parameters()},
            "autocast_dtype": module.autocast_dtype}


def seen_by_the_blocks(module, step) -> set:
    """(autocast on, its dtype, the hidden states' dtype) at every transformer block during ``step()``."""
    seen = set()

    def record(m, args, kwargs):
        x = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point())
        seen.add((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), x.dtype))

    handles = [b.register_forward_pre_hook(record, with_kwargs=True) for b in module.dit.transformer_blocks]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("precision", ["auto", "autocast"])
def test_benchmark_step_is_set_up_as_qie_train(precision, tiny_model_dir, cache_dir, tmp_path,
                                               fresh_accelerate_state):
    from benchmarks.flops import SampleShape
    from benchmarks.ours_step import make_ours_step, make_samples, our_module
    from diffsynth_qie.training.data import DataPosition, iterate_batches
    from diffsynth_qie.training.placement import load_dit, weight_dtype
    from diffsynth_qie.training.run_setup import setup

    cfg = RunConfig(train=TrainConfig(cache_dir=[str(cache_dir)], output_dir=str(tmp_path / "run"), model="tiny",
                                      model_dir=str(tiny_model_dir), mixed_precision="bf16", device="cpu",
                                      compute_precision=precision, cfg_dropout=0.0, save_every=0),
                    lora=LoRAConfig(lora_rank=4))
    run = setup(cfg)
    try:
        trained = setup_of(run.module)
        batch, _ = next(iterate_batches(run.dataset, run.sampler, DataPosition()))
        train_seen = seen_by_the_blocks(run.module, lambda: run.wrapped(batch, torch.Generator().manual_seed(0)))
        dtype = weight_dtype(run.accelerator)
        bench = our_module(load_dit(get_preset("tiny"), run.cfg, run.accelerator), 4, True, 1, "cpu", dtype,
                           precision, model="tiny")
        bench_setup = setup_of(bench)
        entries = make_samples([SampleShape((8, 8), ((8, 8),), 5)], DIT_SIZES["text_dim"], 0, "cpu", dtype)
        step, optimizer = make_ours_step(bench, entries, 0)
        bench_seen = seen_by_the_blocks(bench, step)
    finally:
        run.lock.release()
    assert dtype == torch.bfloat16
    assert bench_setup == trained
    assert bench_seen == train_seen and len(train_seen) == 1
    assert next(iter(train_seen))[:2] == ((True, torch.bfloat16) if precision == "autocast" else (False,
                                                                                                  torch.bfloat16))
    assert {k: optimizer.defaults[k] for k in ("fused", "foreach")} == \
        {k: run.optimizer.defaults[k] for k in ("fused", "foreach")}


# --- fused AdamW and pinned copies at the step's start ------------------------------------------------
def test_adamw_is_fused_on_a_gpu_only():
    from diffsynth_qie.fakegpu.device import FakeCuda
    from diffsynth_qie.training.config import OptimConfig
    from diffsynth_qie.training.optim import build_optimizer

    cpu = build_optimizer([torch.nn.Parameter(torch.zeros(3))], OptimConfig(optimizer="adamw"))
    assert not cpu.defaults["fused"] and cpu.defaults["foreach"] is None  # PyTorch's CPU default, unchanged
    with FakeCuda():
        p = torch.nn.Parameter(torch.zeros(3, device="cuda"))
        gpu = build_optimizer([p], OptimConfig(optimizer="adamw"))
        sharded = build_optimizer([p], OptimConfig(optimizer="adamw"), deepspeed=True)
        p.grad = torch.ones_like(p)
        gpu.step()  # the fused kernel runs on the device
    assert gpu.defaults["fused"] is True
    assert not sharded.defaults["fused"]


def test_batches_reach_a_gpu_through_pinned_memory_without_blocking():
    from torch.utils._python_dispatch import TorchDispatchMode

    from diffsynth_qie.fakegpu.device import FakeCuda
    from diffsynth_qie.training.module import _to_device

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self.ops.append((func.__name__, kwargs.get("non_blocking", False), str(kwargs.get("device", ""))))
            return func(*args, **kwargs)

    batch = {"target_latents": [torch.randn(4, 2, 2)], "edit_latents": [[torch.randn(4, 2, 2)]], "n": 3}
    with FakeCuda():
        with Copies() as gpu:
            moved = _to_device(batch, torch.device("cuda:0"), torch.bfloat16)
    assert moved["target_latents"][0].device.type == "cuda" and moved["edit_latents"][0][0].dtype == torch.bfloat16
    assert moved["n"] == 3
    names = [name for name, _, _ in gpu.ops]
    assert names.count("_pin_memory.default") == 2
    assert [op for op in gpu.ops if op[0] == "_to_copy.default" and op[2].startswith("cuda")] == \
        [("_to_copy.default", True, "cuda:0")] * 2
    with Copies() as cpu:
        same = _to_device(batch, torch.device("cpu"), torch.float32)
    assert same["target_latents"][0] is batch["target_latents"][0]  # nothing copied on the CPU
    assert not any("pin" in name for name, _, _ in cpu.ops)
