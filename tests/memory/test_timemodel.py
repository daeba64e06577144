"""The time model: what the fake device counts per kernel (fakegpu/costs.py) and how a GPU's table turns it into
seconds (fakegpu/timemodel.py, preflight/timing.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from diffsynth_qie.fakegpu.costs import Group, Profile
from diffsynth_qie.fakegpu.device import FakeCuda
from diffsynth_qie.fakegpu.timemodel import gpu_table, predict, tables


def _matmuls(device):
    x = torch.randn(2, 256, 512, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    w = torch.randn(512, 1024, device=device, dtype=x.dtype)
    lora_a = torch.randn(16, 512, device=device, dtype=x.dtype)
    return (torch.nn.functional.linear(x, w.t(), w[0]) + (x @ lora_a.t()).sum()).bmm(w.t()[None, :, :512]
                                                                                      .expand(2, 1024, 512))


def test_flops_match_pytorchs_flop_counter_and_thin_gemms_are_their_own_class():
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        _matmuls("cpu")
    with FakeCuda(costs=True) as fc:
        _matmuls("cuda")
    p = fc.costs.profile
    assert p.total(("gemm", "gemm_thin"), what="flops") == counter.get_total_flops() > 0
    assert p.total(("gemm_thin",), what="flops") == 2 * 512 * 512 * 16  # the rank-16 LoRA-style GEMM alone
    with FakeCuda(costs=True) as fc:
        q = torch.randn(1, 4, 1024, 128, device="cuda", dtype=torch.bfloat16)
        F.scaled_dot_product_attention(q, q, q)
    assert fc.costs.profile.total(("attention",), what="flops") == 4 * 4 * 1024 ** 2 * 128  # QK^T and PV


def test_bytes_views_and_kernels_are_counted_as_a_gpu_moves_them():
    with FakeCuda(costs=True) as fc:
        x = torch.empty(1024, 1024, device="cuda", dtype=torch.bfloat16)
        row = torch.empty(1, 1024, device="cuda", dtype=torch.bfloat16)
        fc.costs.section = "work"
        x.t().reshape(-1)[:10]  # a view of a contiguous transpose copy: one copy kernel
        y = x + row.expand(1024, 1024)  # the broadcast row is read once: 2 MiB + 2 KiB + 2 MiB
        del y
    p = fc.costs.profile
    assert p.kernels(sections=("work",)) == 2
    add = 2 * 2 * 1024 ** 2 + 2 * 1024
    copy = 2 * 2 * 1024 ** 2
    assert p.total(("elementwise",), ("work",)) == add + copy


def test_a_table_turns_counts_into_seconds_by_class():
    table = dataclasses.replace(gpu_table("h200"), gemm_tflops={"bfloat16": 100.0}, gemm_size_efficiency=((0, 1.0),),
                                hbm_tbps=1.0, elementwise_tbps=1.0, launch_us=1.0,
                                attention_tflops={"cudnn": (50.0, 25.0)}, default_backend="cudnn")
    p = Profile({("f", "gemm", ("bfloat16", 4096, 4096, 4096)): Group(2, 2 * 2 * 4096 ** 3, 2 * 3 * 2 * 4096 ** 2),
                 ("f", "attention", ("bfloat16", 4096)): Group(1, 1e12, 0),
                 ("b", "attention_bwd", ("bfloat16", 4096)): Group(1, 1e12, 0),
                 ("f", "elementwise", "bfloat16"): Group(10, 0, 2e9)})
    e = predict(p, table, model_sections=("f",))
    assert e.split["gemm"] == pytest.approx(2 * 2 * 4096 ** 3 / 100e12)  # compute-bound: FLOPs / rate
    assert e.split["attention"] == pytest.approx(1e12 / 50e12 + 1e12 / 25e12)
    assert e.split["elementwise"] == pytest.approx(2e9 / 1e12)
    assert e.split["launch"] == pytest.approx(14 * 1e-6)
    assert e.seconds == pytest.approx(sum(e.split.values()))
    assert e.mfu == pytest.approx(2 * (2 * 2 * 4096 ** 3 + 1e12) / (e.seconds * table.matmul_tflops * 1e12))
    thin = Profile({("f", "gemm_thin", ("bfloat16", 8192, 32, 3072)): Group(1, 2 * 8192 * 32 * 3072, 60e6)})
    assert predict(thin, table).split["gemm"] == pytest.approx(60e6 / (table.thin_gemm_tbps * 1e12))  # memory-bound


def test_two_depths_scale_to_the_whole_dit():
    one = Profile({("f", "elementwise", "x"): Group(3, 0, 30), ("f", "gemm", ("bfloat16", 1, 2, 3)): Group(1, 6, 9)})
    two = Profile({("f", "elementwise", "x"): Group(5, 0, 50), ("f", "gemm", ("bfloat16", 1, 2, 3)): Group(2, 12, 18)})
    full = one.scaled_to(two, (1, 2), 60)
    assert full.groups[("f", "elementwise", "x")] == Group(121, 0, 1210)
    assert full.groups[("f", "gemm", ("bfloat16", 1, 2, 3))] == Group(60, 360, 540)
    assert Profile.from_json(full.to_json()).groups == full.groups


def test_a_section_counted_by_the_deeper_run_replaces_the_shallower_runs_in_place():
    """(An edit's encode is the same at both depths: the shallower run skips the language model's pass.)"""
    skipped = Profile({("encode", "elementwise", "x"): Group(1, 0, 10), ("denoise", "elementwise", "x"): Group(3, 0, 30),
                       ("decode", "gemm", "y"): Group(1, 2, 3)})
    two = Profile({("encode", "elementwise", "x"): Group(4, 0, 40), ("encode", "gemm", "z"): Group(1, 5, 6),
                   ("denoise", "elementwise", "x"): Group(5, 0, 50), ("decode", "gemm", "y"): Group(1, 2, 3)})
    one = skipped.with_sections(two, ("encode",))
    assert list(one.groups) == [("encode", "elementwise", "x"), ("encode", "gemm", "z"),
                                ("denoise", "elementwise", "x"), ("decode", "gemm", "y")]  # sums keep their order
    assert one.groups[("encode", "gemm", "z")] == Group(1, 5, 6) and one.groups[("denoise", "elementwise", "x")] \
        == Group(3, 0, 30)
    full = one.scaled_to(two, (1, 2), 60)
    assert full.total(sections=("encode",)) == two.total(sections=("encode",))  # counted once, not per block
    assert full.groups[("denoise", "elementwise", "x")] == Group(121, 0, 1210)
    assert skipped.groups[("encode", "elementwise", "x")] == Group(1, 0, 10)  # (a new profile)


def test_transformers_models_are_built_in_the_asked_dtype_whatever_their_config_says():
    from transformers import Qwen2Config, Qwen2Model

    from diffsynth_qie.fakegpu.standin_vl import transformers_built_in

    def config():  # (``_from_config`` writes the dtype it built in into the config)
        return Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, torch_dtype="float32")

    with transformers_built_in(torch.bfloat16), torch.device("meta"):
        built = Qwen2Model._from_config(config())
        kept = Qwen2Model._from_config(config(), dtype=torch.float16)  # the caller's own dtype
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in kept.parameters()} == {torch.float16}
    with torch.device("meta"):
        assert {p.dtype for p in Qwen2Model._from_config(config()).parameters()} == {torch.float32}  # restored


def test_every_table_is_complete_and_slower_gpus_predict_longer_steps():
    known = tables()
    assert {"h200", "h100", "a100", "l40s", "rtx4090", "rtx5090"} <= set(known)
    p = Profile({("f", "gemm", ("bfloat16", 8192, 3072, 3072)): Group(100, 100 * 2 * 8192 * 3072 ** 2, 100 * 1.2e8),
                 ("f", "attention", ("bfloat16", 8192)): Group(10, 10 * 4e11, 0),
                 ("f", "elementwise", "bfloat16"): Group(1000, 0, 5e10)})
    seconds = {k: predict(p, t).seconds for k, t in known.items()}
    assert seconds["h200"] < seconds["h100"] < seconds["a100"] < seconds["rtx4090"]
    for t in known.values():
        assert t.source and t.accuracy and t.default_backend in t.attention_tflops
    assert gpu_table("NVIDIA H200").key == "h200" and gpu_table("rtx 4090").key == "rtx4090"
    with pytest.raises(ValueError, match="no time table.*h100"):
        gpu_table("tpu")


def test_an_fp8_gemm_costs_the_fp8_rate_where_the_gpu_has_fp8_tensor_cores():
    """The FP8 rate is the datasheet's fp8/bf16 ratio (2x on every FP8 GPU listed) on the fitted bf16 rate; an A100
    has none. A compute-bound FP8 GEMM then costs half the bf16 one's seconds."""
    shape = (8192, 12288, 3072)
    flops = 2 * 8192 * 12288 * 3072
    for key, t in tables().items():
        assert t.has_fp8 == (key != "a100"), key
        if not t.has_fp8:
            continue
        assert 1.95 < t.gemm_tflops["float8_e4m3fn"] / t.gemm_tflops["bfloat16"] < 2.05, key
        assert "FP8 GEMM rate derived" in t.source, key
        bf16, fp8 = (predict(Profile({("f", "gemm", (d, *shape)): Group(1, flops, 1e8)}), t).split["gemm"]
                     for d in ("bfloat16", "float8_e4m3fn"))
        assert fp8 == pytest.approx(bf16 / (t.gemm_tflops["float8_e4m3fn"] / t.gemm_tflops["bfloat16"])), key


def test_the_report_shows_the_measured_step_time_beside_the_preflights_prediction(tmp_path):
    import json

    from diffsynth_qie.fakegpu.timemodel import Estimate
    from diffsynth_qie.preflight.timing import TimePrediction
    from diffsynth_qie.training.report import build_report, write_prediction

    table = gpu_table("h100")
    estimate = Estimate(1.9, {"gemm": 1.0, "attention": 0.5, "elementwise": 0.3, "launch": 0.1}, mfu=0.3,
                        gpu=table.name)
    write_prediction(tmp_path, TimePrediction(estimate, table))
    steps = [(1, 5.0), (2, 2.0), (3, 2.2), (4, 2.1)]  # the first step's warm-up is left out of the median
    (tmp_path / "loss.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5, "step_s": t}) + "\n"
                                                 for s, t in steps))
    page = build_report(tmp_path)
    assert "measured 2.100 s per optimizer step (median of 3 logged)" in page
    assert f"predicted 1.900 s on {table.name}" in page and table.accuracy in page
