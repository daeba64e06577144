"""bf16 numerics at full size: our loss vs DiffSynth's, block swapping's bit parity, the unmerged LoRA branch.

Run by ``python -m benchmarks.train_step --numerics`` on the model the step benchmark built (results under
``numerics`` in the JSON). Each check returns a dict of plain numbers; none asserts, the table states them:

- :func:`loss_parity` — our loss and ``FlowMatchSFTLoss`` on the same sample, σ and noise. DiffSynth draws
  its noise with ``torch.randn_like`` (on the GPU's generator on CUDA); for the check it is drawn on the CPU's
  global generator in fp32 and moved, as ours is (``training/losses/common.sample_noise``), so both see the
  same numbers on any device.
- :func:`block_swap_parity` — one forward + backward with and without ``--blocks_to_swap``: the loss and every
  LoRA gradient compared bit for bit (``torch.equal``), and the largest difference if not equal.
- :func:`precision_parity` — one step in pure bf16 against the same step under bf16 autocast
  (``--compute_precision``): loss and gradient differences.
- :func:`lora_branch_error` — every LoRA-wrapped linear of one block, run as serving runs it (the base layer
  plus the unmerged adapter, bf16), against the same layer merged in fp32 (``W + s·B·A``, fp32 input): the
  relative error ‖out − ref‖ / ‖ref‖, median and worst over the layers.
"""
from __future__ import annotations

import contextlib
import statistics
from typing import Iterator

import torch


@contextlib.contextmanager
def cpu_randn_like() -> Iterator[None]:
    """Make ``torch.randn_like`` draw on the CPU's global generator in fp32, then move (the check's noise)."""
    original = torch.randn_like

    def randn_like(x, *args, **kwargs):
        return torch.randn(x.shape, dtype=torch.float32).to(x.device, x.dtype)

    torch.randn_like = randn_like
    try:
        yield
    finally:
        torch.randn_like = original


def loss_parity(module, pipe, entry: dict, seed: int) -> dict:
    """Our loss vs DiffSynth's on one sample (same σ and noise, the model's dtype), no update."""
    from benchmarks.ours_step import parity_losses

    with cpu_randn_like():
        ours, stock = parity_losses(module, pipe, entry, seed)
    return {"seed": seed, "ours": ours, "stock": stock, "rel_diff": abs(ours - stock) / max(abs(stock), 1e-12)}


def _loss_and_grads(module, batch: dict, seed: int, params) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in params:
        p.grad = None
    loss, _ = module(batch, torch.Generator().manual_seed(seed))
    loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    return loss.detach().clone(), grads


def block_swap_parity(module, entry: dict, seed: int, blocks_to_swap: int, device) -> dict:
    """Loss and LoRA gradients of one step with and without swapping the last ``blocks_to_swap`` blocks."""
    from benchmarks.ours_step import ours_batch, set_checkpointing
    from diffsynth_qie.memory.block_swap import BlockSwapper

    set_checkpointing(module, True)
    params = list(module.trainable_modules())
    batch = ours_batch([entry])
    base_loss, base_grads = _loss_and_grads(module, batch, seed, params)
    swapper = BlockSwapper(module.dit, blocks_to_swap, device, "cpu").install()
    try:
        swap_loss, swap_grads = _loss_and_grads(module, batch, seed, params)
    finally:
        swapper.remove()
    equal = [torch.equal(a, b) for a, b in zip(base_grads, swap_grads)]
    worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(base_grads, swap_grads))
    return {"blocks_to_swap": blocks_to_swap, "loss_equal": bool(torch.equal(base_loss, swap_loss)),
            "loss": float(base_loss), "loss_swapped": float(swap_loss), "grads_equal": sum(equal),
            "grads": len(equal), "max_abs_grad_diff": worst}


@torch.no_grad()
def lora_branch_error(dit, block_index: int = 0, tokens: int = 4096, seed: int = 0) -> dict:
    """Unmerged bf16 LoRA layers of one block vs the merged fp32 layer, on random inputs (B made non-zero)."""
    from peft.tuners.lora import LoraLayer

    block = dit.transformer_blocks[block_index]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    errors = {}
    for name, layer in block.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        base = layer.get_base_layer()
        adapter = layer.active_adapters[0]
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        saved_b = b.detach().clone()
        b.copy_((torch.randn(b.shape, generator=gen) * 0.02).to(b.device, b.dtype))  # PEFT starts B at 0
        x = (torch.randn(tokens, base.in_features, generator=gen)).to(base.weight.device, base.weight.dtype)
        out = layer(x).float()
        weight = base.weight.float() + layer.scaling[adapter] * (b.float() @ a.float())
        ref = x.float() @ weight.T + (base.bias.float() if base.bias is not None else 0)
        errors[name] = float((out - ref).norm() / ref.norm().clamp_min(1e-12))
        b.copy_(saved_b)
    if not errors:
        raise AssertionError(f"block {block_index} has no LoRA layers")
    values = sorted(errors.values())
    return {"block": block_index, "layers": len(values), "tokens": tokens, "median_rel_err": statistics.median(values),
            "max_rel_err": values[-1], "worst_layer": max(errors, key=errors.get),
            "dtype": str(next(block.parameters()).dtype).replace("torch.", "")}


def precision_parity(module, entry: dict, seed: int) -> dict:
    """One step's loss and trainable gradients in pure bf16 and under bf16 autocast (``--compute_precision``),
    fp32 LoRA weights in both, same σ and noise: their relative differences (CUDA's autocast computes the norms
    and the modulation in fp32, the CPU's does not; docs/DIFFSYNTH_NOTES.md)."""
    from benchmarks.ours_step import ours_batch, set_lora_dtype

    params = list(module.trainable_modules())
    dtypes, saved = [p.dtype for p in params], module.autocast_dtype
    set_lora_dtype(params, torch.float32)
    batch = ours_batch([entry])
    try:
        module.autocast_dtype = None
        pure_loss, pure_grads = _loss_and_grads(module, batch, seed, params)
        module.autocast_dtype = torch.bfloat16
        auto_loss, auto_grads = _loss_and_grads(module, batch, seed, params)
    finally:
        module.autocast_dtype = saved
        for p, dtype in zip(params, dtypes):
            p.data = p.data.to(dtype)
    a, b = torch.cat([g.flatten() for g in pure_grads]), torch.cat([g.flatten() for g in auto_grads])
    out = {"loss_pure": float(pure_loss), "loss_autocast": float(auto_loss),
           "rel_diff": abs(float(pure_loss) - float(auto_loss)) / max(abs(float(auto_loss)), 1e-12),
           "grad_cosine": float(torch.nn.functional.cosine_similarity(a, b, 0)),
           "grad_rel_diff": float((a - b).norm() / b.norm().clamp_min(1e-12))}
    out["line"] = (f"pure bf16 vs bf16 autocast (`--compute_precision`), one step: loss {out['loss_pure']:.6g} vs "
                   f"{out['loss_autocast']:.6g} (relative difference {out['rel_diff']:.1e}), gradients cosine "
                   f"{out['grad_cosine']:.5f}, relative difference {out['grad_rel_diff']:.1e}")
    return out


def run_all(module, pipe, entry: dict, seed: int, device, blocks_to_swap: int) -> dict:
    """Every check on one sample; a check that fails records its error and the others still run."""
    checks = {
        "loss_parity": lambda: loss_parity(module, pipe, entry, seed),
        "block_swap_parity": lambda: block_swap_parity(module, entry, seed, blocks_to_swap, device),
        "lora_branch": lambda: lora_branch_error(module.dit),
        "precision": lambda: precision_parity(module, entry, seed),
    }
    out = {}
    for name, check in checks.items():
        try:
            out[name] = check()
        except Exception as exc:  # noqa: BLE001 - one failed check is a result, the rest still run
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return out
