"""The measured GPU rows, rebuilt on the fake CUDA device with their kernels counted (the time model's inputs).

Each row of ``benchmarks/results/nvidia-h200-2026-11-26.json`` is run here as the benchmark ran it (its own
builders: ``ours_step.py``, ``stock_step.py``, ``train21.py``; the edits through ``preflight/edit_step.py``)
at 1 and 2 blocks on the fake device, and the counted kernels (``fakegpu/costs.py``) are scaled to the whole
DiT. The profiles go to ``benchmarks/results/timemodel-profiles.json``; ``benchmarks/timemodel_fit.py`` fits
the GPU table on them and reports the leave-one-out accuracy.

    python -m benchmarks.timemodel_rows [--only SUBSTRING]     # about 2-4 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from pathlib import Path
from unittest import mock

import torch

RESULTS = Path(__file__).with_name("results")
PROFILES = RESULTS / "timemodel-profiles.json"
DEVICE = "cuda:0"
log = logging.getLogger("timemodel_rows")
TRAIN = "train_step/{case}/{impl}/b{b}/r32/ckpt={ckpt}/{swap}compile_blocks=False,fp8_base={fp8},lora_fp32=True," \
        "sdpa_backend={backend}"
PURE = "compute_precision=auto"  # in the ids of rows measured as qie train now runs (pure bf16, fused AdamW)
INFER = "inference/{case}/{impl}/steps={steps}/1024px/compile_blocks=False,fp8_base=False,sdpa_backend=auto"


def rows() -> list[dict]:
    """Every measured row the fake device can rebuild: (id, how to build it)."""
    t = lambda case, impl, b, ckpt="on", swap=0, fp8=False, backend="auto": TRAIN.format(  # noqa: E731
        case=case, impl=impl, b=b, ckpt=ckpt, swap=f"blocks_to_swap={swap}," if swap else "", fp8=fp8,
        backend=backend)
    out = [dict(id=t("ours", "ours", 1), kind="train", impl="ours", batch=1),
           dict(id=t("stock", "stock", 1), kind="train", impl="stock", batch=1),
           dict(id=t("batch", "ours", 2), kind="train", impl="ours", batch=2),
           dict(id=t("batch", "ours", 4), kind="train", impl="ours", batch=4),
           dict(id=t("mixed", "ours", 4), kind="train", impl="ours", batch=4, mixed=True),
           dict(id=t("stock", "stock", 1, ckpt="off"), kind="train", impl="stock", batch=1, ckpt=False),
           dict(id=t("ours", "ours", 1, backend="cudnn"), kind="train", impl="ours", batch=1, backend="cudnn"),
           dict(id=t("ours", "ours", 1, backend="flash"), kind="train", impl="ours", batch=1, backend="flash"),
           dict(id=t("ours", "ours", 1, swap=16), kind="train", impl="ours", batch=1, swap=16),
           dict(id=t("ours", "ours", 1, swap=30), kind="train", impl="ours", batch=1, swap=30),
           dict(id=t("ours", "ours", 1, fp8=True), kind="train", impl="ours", batch=1, fp8=True)]
    out += [dict(r, id=r["id"].replace("compile_blocks=False,", f"compile_blocks=False,{PURE},"), pure=True)
            for r in out if r["impl"] == "ours"]
    for impl, b, refs in (("ours", 1, 1), ("stock", 1, 1), ("ours", 1, 3), ("stock", 1, 3), ("ours", 4, 3),
                          ("ours", 4, 1)):
        out.append(dict(id=f"train21/{impl}/b{b}/refs={refs}/r32/ckpt=on", kind="train21", impl=impl, batch=b,
                        refs=refs))
        if impl == "ours":
            out.append(dict(out[-1], id=f"{out[-1]['id']}/{PURE}", pure=True))
    out += [dict(id=INFER.format(case="edit", impl="ours", steps=40), kind="edit", model="2511", steps=40, cfg=4.0),
            dict(id=INFER.format(case="lightning", impl="ours", steps=4), kind="edit", model="2511", steps=4,
                 cfg=1.0)]
    out += [dict(id=INFER.format(case="lbm", impl="ours", steps=n), kind="edit", model="2511", steps=n, cfg=1.0,
                 lbm=True) for n in (1, 2, 4)]
    out += [dict(id=f"inference21/cfg/refs={r}/steps=40/kv_cache={kv}", kind="edit", model="2.1", steps=40, cfg=4.0,
                 refs=r, kv_cache=kv) for r, kv in ((1, True), (1, False), (3, True))]
    out.append(dict(id="inference21/turbo/refs=1/steps=8/kv_cache=True", kind="edit", model="2.1", steps=8, cfg=1.0))
    return out


@contextlib.contextmanager
def counted_backward(fc):
    """``loss.backward()`` on the fake device (its own engine walk), counted as the backward section; what
    follows it is the optimizer step."""
    from diffsynth_qie.fakegpu.device import backward

    def run(loss, *args, **kwargs):
        fc.costs.section = "backward"
        backward(loss)
        fc.costs.section = "optimizer step"

    with mock.patch.object(torch.Tensor, "backward", run):
        yield


@contextlib.contextmanager
def host_sigma(pipe):
    """DiffSynth's stock loss reads the step's σ on the host (``timestep.cpu()`` in its scheduler: a sync the fake
    device refuses). Here the scheduler gets a host timestep instead, which changes no kernel but that sync."""
    from torch._subclasses.fake_tensor import FakeTensor

    sched = pipe.scheduler
    host_t = sched.timesteps[len(sched.timesteps) // 2]
    patched = {}
    for name in ("add_noise", "training_target", "training_weight"):
        real = getattr(sched, name)
        patched[name] = real

        def call(*args, _real=real):
            args = [host_t if isinstance(a, FakeTensor) and a.numel() == 1 else a for a in args]
            return _real(*args)
        setattr(sched, name, call)
    try:
        yield
    finally:
        for name, real in patched.items():
            setattr(sched, name, real)


def precision(row: dict) -> str:
    """The row's ``--compute_precision``: the rows of 2026-11-26 ran under bf16 autocast."""
    return "auto" if row.get("pure") else "autocast"


def as_measured(module, row: dict) -> None:
    """A row of 2026-11-26 (not ``pure``): PEFT's fp32 copy of every adapted input left on, as the benchmarks ran
    before they built the module with ``qie train``'s builder."""
    for m in module.dit.modules():
        if hasattr(m, "cast_input_dtype_enabled") and not row.get("pure"):
            m.cast_input_dtype_enabled = True


def foreach_adamw(row: dict):
    """Inside: AdamW as the row ran it: PyTorch's ``foreach`` for the rows of 2026-11-26, else fused."""
    return contextlib.nullcontext() if row.get("pure") else \
        mock.patch("diffsynth_qie.training.optim.fused_adamw", return_value=False)


def train_profile(row: dict, layers: int):
    """One step of a 2511 training row at ``layers`` blocks on the fake device; its counted kernels."""
    from benchmarks import ours_step, stock_step
    from benchmarks.build import sdpa_context
    from benchmarks.flops import SampleShape
    from benchmarks.train_step import FULL_MIXED, FULL_TARGET, FULL_TEXT_LEN
    from diffsynth_qie.fakegpu.device import FakeCuda
    from diffsynth_qie.memory.census import build_dit
    from diffsynth_qie.models.presets import get_preset

    one = SampleShape(target=FULL_TARGET, refs=(FULL_TARGET,), text_len=FULL_TEXT_LEN)
    samples = (one,) * row["batch"]
    if row.get("mixed"):
        n = FULL_TEXT_LEN
        samples = tuple(SampleShape(target=hw, refs=(hw,), text_len=t)
                        for hw, t in zip(FULL_MIXED, (n, n * 7 // 8, n * 9 // 8, n * 3 // 4)))
    ckpt = row.get("ckpt", True)
    with FakeCuda(costs=True) as fc:
        with fc.build(torch.bfloat16, DEVICE):
            dit = build_dit(get_preset("2511"), layers)
            module = ours_step.our_module(dit, 32, ckpt, row["batch"], DEVICE, torch.bfloat16, precision(row))
        as_measured(module, row)
        params = list(module.trainable_modules())
        if row.get("fp8"):
            module.quantize_frozen_base(DEVICE)
        if row.get("swap"):
            from diffsynth_qie.memory.block_swap import BlockSwapper

            BlockSwapper(module.dit, min(row["swap"], layers - 1) or 1, DEVICE, "cpu").install()
        entries = ours_step.make_samples(samples, 3584, 0, DEVICE, torch.bfloat16)
        if row["impl"] == "ours":
            ours_step.set_lora_dtype(params, torch.float32)
            ours_step.set_checkpointing(module, ckpt)
            with foreach_adamw(row):
                step, _ = ours_step.make_ours_step(module, entries, 0)
        else:
            ours_step.set_lora_dtype(params, torch.bfloat16)
            pipe = stock_step.stock_pipeline(module.dit, DEVICE, torch.bfloat16)
            inputs = stock_step.stock_inputs(entries[0], ckpt)
            # model_fn_qwen_image reads the mask's lengths on the host (.tolist(), a sync): the mask starts there
            inputs["prompt_emb_mask"] = torch.ones(1, samples[0].text_len, dtype=torch.long)
            step, _ = stock_step.make_stock_step(pipe, params, entries[0], ckpt, inputs=inputs)
        fc.costs.section = "forward"
        with counted_backward(fc), sdpa_context("auto"), (host_sigma(pipe) if row["impl"] == "stock"
                                                          else contextlib.nullcontext()):
            step()
    return fc.costs.profile


def train21_profile(row: dict, layers: int):
    from benchmarks import ours_step, stock_step, train21
    from diffsynth_qie.fakegpu.device import FakeCuda
    from diffsynth_qie.models.presets import family_of, get_preset

    family = family_of(get_preset("2.1"))
    with FakeCuda(costs=True) as fc, family.fake_device_standin():
        from diffsynth.models.qwen_image_21_dit import QwenImage21DiT

        with fc.build(torch.bfloat16, DEVICE):
            dit = QwenImage21DiT(num_layers=layers)
            module = ours_step.our_module(dit, 32, True, 1, DEVICE, torch.bfloat16, precision(row), model="2.1")
        as_measured(module, row)
        params = list(module.trainable_modules())
        entry = train21.make_entry(train21.FULL_LATENT, row["refs"], train21.FULL_TEXT, dit.txt_in.in_layer.in_features,
                                   0, DEVICE, torch.bfloat16)
        if row["impl"] == "ours":
            for p in params:
                p.data = p.data.to(torch.float32)
            with foreach_adamw(row):
                step = train21.make_ours_step(module, [entry] * row["batch"], 0)
        else:
            pipe = train21.stock_pipeline21(module.dit, DEVICE, torch.bfloat16)
            step, _ = stock_step.make_stock_step(pipe, params, entry, True, inputs=train21.stock_inputs21(entry))
        fc.costs.section = "forward"
        with counted_backward(fc), (host_sigma(pipe) if row["impl"] == "stock" else contextlib.nullcontext()):
            step()
    return fc.costs.profile


def edit_profile(row: dict, layers: int):
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.preflight.edit_step import verify_edit

    report = verify_edit(get_preset(row["model"]), ref_images=row.get("refs", 1), steps=run_steps(row),
                         cfg=row["cfg"], num_layers=layers, kv_cache=row.get("kv_cache", True),
                         lbm_steps=row["steps"] if row.get("lbm") else None, costs=True)
    return report.costs


def run_steps(row: dict) -> int:
    """Denoising steps an edit row runs on the fake device (LBM: all of its steps; else the first and one more)."""
    return row["steps"] if row.get("lbm") else min(2, row["steps"])


def full_layers(model: str) -> int:
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.preflight.timing import full_depth

    return full_depth(get_preset(model))


def profile_row(row: dict) -> dict:
    """The row's counted kernels at full depth (scaled from 1 and 2 blocks) as JSON."""
    build = {"train": train_profile, "train21": train21_profile, "edit": edit_profile}[row["kind"]]
    model = "2.1" if row["kind"] == "train21" or row.get("model") == "2.1" else "2511"
    shallow, deep = build(row, 1), build(row, 2)
    full = shallow.scaled_to(deep, (1, 2), full_layers(model))
    out = {"id": row["id"], "kind": row["kind"], "backend": row.get("backend", "auto"), "profile": full.to_json()}
    if row["kind"] == "edit":
        out.update(steps=row["steps"], steps_run=run_steps(row))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=None, help="profile only rows whose id contains this")
    p.add_argument("--out", default=str(PROFILES))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out_path = Path(args.out)
    done = json.loads(out_path.read_text())["rows"] if out_path.exists() else []
    by_id = {r["id"]: r for r in done}
    for row in rows():
        if args.only and args.only not in row["id"]:
            continue
        t0 = time.perf_counter()
        by_id[row["id"]] = profile_row(row)
        log.info("%-100s %.1f s", row["id"], time.perf_counter() - t0)
        from diffsynth_qie.utils.atomic import atomic_write_text

        atomic_write_text(out_path, json.dumps({"format_version": 1, "rows": list(by_id.values())}))


if __name__ == "__main__":
    main()
