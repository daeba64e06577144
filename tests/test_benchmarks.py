"""The benchmark harness (benchmarks/): FLOP counter, parity of ours vs DiffSynth's stock paths, CPU smoke runs.

The smoke runs call each script's ``main(argv)`` with ``--tiny`` (tiny model, CPU,
fp32, 1–2 steps): their timings mean nothing, but the result files, the rows they
must hold, and the parity of our step/editor against DiffSynth's are asserted.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import build, common, flops  # noqa: E402
from benchmarks.flops import DiTDims, SampleShape  # noqa: E402

TINY_DIMS = DiTDims(dim=64, num_layers=2, text_dim=32, in_channels=64, ff_mult=4, timestep_dim=256)


# --- FLOP counter -------------------------------------------------------------------------
def _hand_count_forward(s_img: int, s_txt: int, zero_cond_t: bool) -> int:
    """Every matmul of the tiny DiT written out layer by layer: (rows, in, out) -> 2·rows·in·out."""
    d, f, c, t, heads, hd = 64, 256, 64, 256, 2, 32
    n_t = 2 if zero_cond_t else 1
    linears = [(s_img, c, d), (s_txt, 32, d), (n_t, t, d), (n_t, d, d)]          # img_in, txt_in, time embed
    for _ in range(2):                                                          # blocks
        linears += [(n_t, d, 6 * d), (1, d, 6 * d)]                             # img_mod, txt_mod
        for rows in (s_img, s_txt):
            linears += [(rows, d, d)] * 4 + [(rows, d, f), (rows, f, d)]        # q k v out, mlp
    linears += [(1, d, 2 * d), (s_img, d, c)]                                   # norm_out, proj_out
    total = sum(2 * r * i * o for r, i, o in linears)
    s = s_img + s_txt
    total += 2 * 2 * (2 * heads * s * s * hd)                                   # 2 blocks x (QK^T, PV)
    return total


def test_flop_counter_equals_hand_count():
    sample = SampleShape(target=(16, 16), refs=((16, 16),), text_len=12)
    assert sample.image_tokens == 128
    for zero_cond_t in (False, True):
        got = flops.sample_forward_flops(TINY_DIMS, sample, zero_cond_t)
        assert got.forward == _hand_count_forward(128, 12, zero_cond_t)
    two = [sample, SampleShape(target=(12, 20), refs=(), text_len=5)]
    batch = flops.batch_forward_flops(TINY_DIMS, two, zero_cond_t=True)
    assert batch.forward == _hand_count_forward(128, 12, True) + _hand_count_forward(60, 5, True)
    assert flops.lora_step_flops(TINY_DIMS, two, True) == 2 * batch.forward


def test_mfu_formula():
    assert flops.mfu(4e14, 2.0, 4e14) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive"):
        flops.mfu(1.0, 0.0, 1.0)


def test_full_size_flops_are_in_the_expected_range():
    # 1024² target + 1024² reference + 300 prompt tokens on the real 60-block DiT.
    sample = SampleShape(target=(128, 128), refs=((128, 128),), text_len=300)
    fwd = flops.sample_forward_flops(DiTDims(), sample, zero_cond_t=True)
    assert sample.tokens == 8492
    assert 160e12 < fwd.forward < 180e12          # ≈ 24·S·d²·60 + 4·S²·d·60
    assert 0.25 < fwd.attention / fwd.forward < 0.35


@pytest.fixture(scope="module")
def tiny_dit():
    return build.build_dit(True, "cpu", torch.float32, seed=0)


def test_dims_of_tiny_dit(tiny_dit):
    assert flops.dims_of(tiny_dit) == TINY_DIMS


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_flop_counter_matches_torch_flop_counter(tiny_dit, zero_cond_t):
    """Our formula vs torch's FlopCounterMode on the real forward (math SDPA so attention is counted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from diffsynth_qie.models.qwen_image_edit.forward import dit_forward

    gen = torch.Generator().manual_seed(0)
    samples = [SampleShape(target=(16, 16), refs=((16, 16),), text_len=12)] * 2
    latents = [torch.randn(16, 16, 16, generator=gen) for _ in samples]
    refs = [[torch.randn(16, 16, 16, generator=gen)] for _ in samples]
    prompts = [torch.randn(12, 32, generator=gen) for _ in samples]
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
        dit_forward(tiny_dit, latents, torch.tensor([500.0, 250.0]), prompts, refs, zero_cond_t=zero_cond_t)
    measured = counter.get_total_flops()
    counted = flops.batch_forward_flops(TINY_DIMS, samples, zero_cond_t).forward
    assert measured == pytest.approx(counted, rel=0.03)


# --- building blocks ---------------------------------------------------------------------------
def test_materialize_builds_real_buffers_and_random_weights(tiny_dit):
    assert not any(p.is_meta for p in tiny_dit.parameters())
    assert tiny_dit.pos_embed.pos_freqs.device.type == "cpu" and not tiny_dit.pos_embed.pos_freqs.is_meta
    w = tiny_dit.transformer_blocks[0].attn.to_q.weight
    assert 0.015 < float(w.detach().std()) < 0.025
    again = build.build_dit(True, "cpu", torch.float32, seed=0)
    assert torch.equal(again.transformer_blocks[0].attn.to_q.weight, w)


def test_lora_strip_restores_the_model():
    from diffsynth_qie.models.presets import LORA_TARGETS_2511

    dit = build.build_dit(True, "cpu", torch.float32, seed=0)
    before = {n for n, _ in dit.named_parameters()}
    params = build.add_lora(dit, 8, LORA_TARGETS_2511, torch.float32)
    assert len(params) == 2 * 27  # 12 targets x 2 blocks + img_in, txt_in, proj_out; A and B each
    assert build.strip_lora(dit) == 27
    assert {n for n, _ in dit.named_parameters()} == before


def test_selective_checkpointing_keeps_gradients(tiny_dit):
    from diffsynth_qie.models.qwen_image_edit.forward import dit_forward

    gen = torch.Generator().manual_seed(1)
    x = [torch.randn(16, 8, 8, generator=gen)]
    prompt = [torch.randn(6, 32, generator=gen)]
    w = tiny_dit.transformer_blocks[1].attn.to_v.weight

    def grad():
        w.requires_grad_(True)
        out = dit_forward(tiny_dit, x, torch.tensor([300.0]), prompt, [[]])
        (g,) = torch.autograd.grad(out[0].square().sum(), w)
        w.requires_grad_(False)
        return g

    plain = grad()
    undo = build.wrap_selective_checkpointing(tiny_dit, 1)
    assert all(isinstance(b, build.CheckpointedBlock) for b in tiny_dit.transformer_blocks)
    try:
        checkpointed = grad()
    finally:
        undo()
    assert not any(isinstance(b, build.CheckpointedBlock) for b in tiny_dit.transformer_blocks)
    torch.testing.assert_close(checkpointed, plain)


def test_compile_blocks_is_regional_and_keeps_outputs():
    from diffsynth_qie.models.qwen_image_edit.forward import dit_forward

    dit = build.build_dit(True, "cpu", torch.float32, seed=0)
    gen = torch.Generator().manual_seed(2)
    args = ([torch.randn(16, 8, 8, generator=gen)], torch.tensor([700.0]), [torch.randn(6, 32, generator=gen)],
            [[torch.randn(16, 8, 8, generator=gen)]])
    with torch.no_grad():
        plain = dit_forward(dit, *args, zero_cond_t=True)[0]
        build.compile_blocks(dit, backend="eager")
        compiled = dit_forward(dit, *args, zero_cond_t=True)[0]
    assert all(b._compiled_call_impl is not None for b in dit.transformer_blocks)
    assert getattr(dit, "_compiled_call_impl", None) is None  # the DiT itself stays eager
    torch.testing.assert_close(compiled, plain)
    torch._dynamo.reset()


# --- parity: our training step's loss vs DiffSynth's FlowMatchSFTLoss ------------------------------
def test_training_loss_parity_with_diffsynth_and_it_can_fail():
    from benchmarks import train_step as ts

    dit = build.build_dit(True, "cpu", torch.float32, seed=0)
    module = ts.our_module(dit, 8, gradient_checkpointing=False, batch_size=1)
    pipe = ts.stock_pipeline(dit, torch.device("cpu"), torch.float32)
    entry = ts.make_samples([SampleShape((16, 16), ((16, 16),), 12)], 32, 3, "cpu", torch.float32)[0]
    ours, stock = ts.parity_losses(module, pipe, entry, seed=5)
    assert ours == pytest.approx(stock, rel=1e-5)
    other_ours, other_stock = ts.parity_losses(module, pipe, entry, seed=6)
    assert other_ours == pytest.approx(other_stock, rel=1e-5)
    assert abs(other_stock - stock) > 1e-3 * abs(stock)  # a different σ/noise gives a different loss


@pytest.mark.parametrize("precision", ["pure", "autocast"])
def test_ours_step_in_bf16_updates_fp32_lora(precision):
    """The GPU path of our step (a bf16 DiT, fp32 adapters, pure or under autocast) on the tiny DiT on the CPU."""
    from benchmarks import train_step as ts

    dit = build.build_dit(True, "cpu", torch.bfloat16, seed=0)
    module = ts.our_module(dit, 4, True, 2, "cpu", torch.bfloat16, precision)
    params = list(module.trainable_modules())
    entries = ts.make_samples([SampleShape((8, 8), ((8, 8),), 5)] * 2, 32, 0, "cpu", torch.bfloat16)
    before = [p.detach().clone() for p in params]
    step, _ = ts.make_ours_step(module, entries, 0)
    loss = step()
    assert torch.isfinite(loss) and all(p.dtype == torch.float32 for p in params)
    assert sum(not torch.equal(a, p.detach()) for a, p in zip(before, params)) > 0
    assert all(p.grad is None for p in params)  # zero_grad(set_to_none=True) ran


# --- results files ---------------------------------------------------------------------------
def test_write_results_merges_rows_by_id(tmp_path):
    base = {"script": "train_step", "case": "ours", "impl": "ours", "batch": 1, "lora_rank": 32,
            "checkpointing": "on", "options": {}, "status": "ok", "median_s": 1.0, "samples_per_s": 1.0}
    common.write_results([{**base, "id": "a"}, {**base, "id": "b"}], tmp_path, "NVIDIA H100 80GB HBM3", "2026-01-02")
    json_path, md_path = common.write_results([{**base, "id": "b", "median_s": 2.0}], tmp_path,
                                              "NVIDIA H100 80GB HBM3", "2026-01-02", extra={"note": 1})
    assert json_path.name == "nvidia-h100-80gb-hbm3-2026-01-02.json"
    data = json.loads(json_path.read_text())
    assert {r["id"]: r["median_s"] for r in data["rows"]} == {"a": 1.0, "b": 2.0}
    assert data["note"] == 1 and data["format_version"] == common.FORMAT_VERSION
    assert md_path.read_text().count("| ours | ours |") == 2


# --- smoke runs of the two scripts -------------------------------------------------------------
ROW_FIELDS = {"id", "script", "case", "impl", "status", "torch", "diffsynth", "gpu", "options", "tiny", "timestamp"}


def test_train_step_tiny_smoke(tmp_path):
    from benchmarks import train_step as ts

    out = ts.main(["--tiny", "--out_dir", str(tmp_path), "--lora_ranks", "8", "--checkpointing", "on",
                   "--batch_sizes", "2", "--steps", "1", "--warmup", "1", "--log_level", "WARNING"])
    data = json.loads(Path(out["json"]).read_text())
    rows = {(r["case"], r["impl"], r["batch"]): r for r in data["rows"]}
    assert set(rows) == {("ours", "ours", 1), ("stock", "stock", 1), ("batch", "ours", 2), ("mixed", "ours", 4)}
    for (case, _, batch), r in rows.items():
        assert ROW_FIELDS <= set(r), sorted(ROW_FIELDS - set(r))
        assert r["status"] == "ok" and r["gpu"] == "cpu" and r["lora_rank"] == 8 and r["checkpointing"] == "on"
        assert r["median_s"] > 0 and r["samples_per_s"] == pytest.approx(batch / r["median_s"])
        shapes = [SampleShape(tuple(s["target"]), tuple(tuple(x) for x in s["refs"]), s["text_len"])
                  for s in r["shapes"]]
        assert r["flops_step"] == flops.lora_step_flops(TINY_DIMS, shapes, zero_cond_t=True)
        assert r["mfu"] == pytest.approx(r["flops_step"] / (r["median_s"] * r["matmul_tflops"] * 1e12))
    assert len({s["target"][0] for s in rows[("mixed", "ours", 4)]["shapes"]}) > 1
    assert data["parity"]["rel_diff"] < 1e-5
    md = Path(out["markdown"]).read_text()
    assert "## LoRA training step" in md and md.count("| ok |") == 4


def test_train_step_options_smoke(tmp_path):
    """The speed-up flags on the tiny model: selective checkpointing, SDPA backend, FP8 base, bf16-style LoRA."""
    from benchmarks import train_step as ts

    out = ts.main(["--tiny", "--out_dir", str(tmp_path), "--cases", "ours", "--lora_ranks", "4",
                   "--checkpointing", "off", "--selective_checkpointing", "1", "--sdpa_backend", "math",
                   "--fp8_base", "--no-lora_fp32",
                   "--steps", "1", "--warmup", "1", "--tag", "opts", "--log_level", "WARNING"])
    rows = json.loads(Path(out["json"]).read_text())["rows"]
    assert sorted(r["checkpointing"] for r in rows) == ["every_1", "off"]
    for r in rows:
        assert r["status"] == "ok", r["status"]
        assert r["options"] == {"sdpa_backend": "math", "compile_blocks": False, "fp8_base": True, "lora_fp32": False,
                                "compute_precision": "auto"}
        assert r["id"].endswith("/opts")


def test_inference_tiny_smoke_and_parity(tmp_path):
    from benchmarks import inference

    out = inference.main(["--tiny", "--out_dir", str(tmp_path), "--steps", "2", "--lbm_steps", "1",
                          "--lightning_steps", "2", "--log_level", "WARNING"])
    data = json.loads(Path(out["json"]).read_text())
    rows = {(r["case"], r["impl"], r["num_inference_steps"]): r for r in data["rows"]}
    assert set(rows) == {("edit", "stock", 2), ("edit", "ours", 2), ("lbm", "ours", 1), ("lightning", "ours", 2)}
    assert rows[("lightning", "ours", 2)]["cfg_scale"] == 1.0 and rows[("edit", "ours", 2)]["cfg_scale"] == 4.0
    for r in rows.values():
        assert ROW_FIELDS <= set(r) and r["status"] == "ok" and r["s_per_image"] > 0 and r["text_len"] > 0
    assert rows[("edit", "stock", 2)]["dit_forwards"] == 4 and rows[("edit", "ours", 2)]["dit_forwards"] == 2
    parity = data["inference_parity"]
    assert parity["stock_latents_norm"] > 0 and parity["rel_diff_latents"] < 1e-4
    assert "## Edit inference" in Path(out["markdown"]).read_text()


def test_train_step_numerics_and_the_extra_rows(tmp_path):
    """--numerics on the tiny model in fp32: loss parity, bit-identical block swapping, the unmerged LoRA branch;
    and the rows of --blocks_to_swap, --sdpa_rows and --fp8_row, each compared with stock's plain step."""
    from benchmarks import train_step as ts

    out = ts.main(["--tiny", "--out_dir", str(tmp_path), "--cases", "ours", "stock", "--lora_ranks", "4",
                   "--checkpointing", "on", "--numerics", "--blocks_to_swap", "1", "--sdpa_rows", "math",
                   "--fp8_row", "--steps", "1", "--warmup", "0", "--log_level", "WARNING"])
    num = out["numerics"]
    assert num["loss_parity"]["rel_diff"] < 1e-6 and num["loss_parity"]["stock"] > 0
    swap = num["block_swap_parity"]
    assert swap["loss_equal"] and swap["grads_equal"] == swap["grads"] > 0 and swap["max_abs_grad_diff"] == 0
    assert 0 < num["lora_branch"]["max_rel_err"] < 1e-5 and num["lora_branch"]["layers"] > 0
    prec = num["precision"]  # (an fp32 DiT: the autocast step alone computes its matmuls in bf16)
    assert 0 < prec["rel_diff"] < 2e-3 and 0.98 < prec["grad_cosine"] < 1 and prec["loss_pure"] > 0
    extra = {k: v for r in out["rows"] for k, v in r["options"].items()
             if (k, v) in (("blocks_to_swap", 1), ("sdpa_backend", "math"), ("fp8_base", True))}
    assert extra == {"blocks_to_swap": 1, "sdpa_backend": "math", "fp8_base": True}
    assert all(r["status"] == "ok" for r in out["rows"]), [r["status"] for r in out["rows"]]
    md = Path(out["markdown"]).read_text()
    assert "## Numerics" in md and "bit-identical" in md
    swap_line = next(line for line in md.splitlines() if "blocks_to_swap=1" in line)
    assert swap_line.rstrip(" |").split("|")[-1].strip() != "–"  # × stock against stock's plain step


def test_the_ladders_checkpoint_rungs_prepare_the_blocks_as_qie_train(tmp_path, caplog):
    """The 1+2 and 1+2+3 rungs of `gpu_all.sh --ladder`: --checkpoint_policy selective, and --checkpoint_blocks N,
    go through qie train's block set-up (training/block_setup.py) and say so in the row's id and the log."""
    import logging

    from benchmarks import train_step as ts

    rows = []
    for extra in ([], ["--checkpoint_blocks", "1"]):
        with caplog.at_level(logging.INFO, logger="diffsynth_qie.models.load.block_checkpoint"):
            caplog.clear()
            out = ts.main(["--tiny", "--out_dir", str(tmp_path), "--cases", "ours", "--lora_ranks", "4",
                           "--checkpointing", "on", "--checkpoint_policy", "selective", "--steps", "1", "--warmup",
                           "0", *extra])
        assert f"{extra[-1] if extra else 2} of 2 blocks recompute (selective policy)" in caplog.text
        rows += out["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert [r["options"].get("checkpoint_blocks") for r in rows] == [None, "1"]


def test_train21_tiny_smoke(tmp_path):
    from benchmarks import train21

    out = train21.main(["--tiny", "--out_dir", str(tmp_path), "--refs", "1", "2", "--batch", "2", "--steps", "1",
                        "--warmup", "0", "--lora_rank", "4", "--log_level", "WARNING"])
    rows = {(r["impl"], r["batch"], r["refs"]): r for r in out["rows"]}
    assert set(rows) == {(i, b, n) for n in (1, 2) for i, b in (("ours", 1), ("stock", 1), ("ours", 2))}
    for r in rows.values():
        assert r["status"] == "ok" and r["model"] == "2.1" and r["loss_last"] > 0
        assert r["mfu"] == pytest.approx(r["flops_step"] / (r["median_s"] * r["matmul_tflops"] * 1e12))
    # the references are in the prompt as 2x2-merged slots: more references, a longer prompt
    assert rows[("ours", 1, 2)]["text_len"] > rows[("ours", 1, 1)]["text_len"]
    assert rows[("ours", 2, 1)]["flops_step"] == 2 * rows[("ours", 1, 1)]["flops_step"]


def test_inference21_kv_cache_rows_and_same_latents(tmp_path):
    """The 2.1 sampling benchmark's rows, and the prefix KV cache changes the time, not the latents."""
    from benchmarks import inference21
    from benchmarks.train21 import TINY_LATENT, TINY_TEXT, build_dit21, make_entry

    out = inference21.main(["--tiny", "--out_dir", str(tmp_path), "--refs", "2", "--steps", "2",
                            "--turbo_steps", "2", "--log_level", "WARNING"])
    rows = {(r["case"], r["options"]["kv_cache"]): r for r in out["rows"]}
    assert set(rows) == {("2.1 cfg, 2 ref", True), ("2.1 cfg, 2 ref", False), ("2.1 turbo, 2 ref", True)}
    assert rows[("2.1 cfg, 2 ref", True)]["dit_forwards"] == 4 and rows[("2.1 turbo, 2 ref", True)]["dit_forwards"] == 2
    dit = build_dit21(True, "cpu", torch.float32).requires_grad_(False)
    entry = make_entry(TINY_LATENT, 2, TINY_TEXT, dit.txt_in.in_layer.in_features, 0, "cpu", torch.float32)
    negative = make_entry(TINY_LATENT, 2, 10, dit.txt_in.in_layer.in_features, 1, "cpu", torch.float32)
    cached, plain = (inference21.sample(dit, entry, negative, 3, 4.0, kv, "default", 0) for kv in (True, False))
    assert torch.allclose(cached, plain, atol=1e-5) and cached.abs().sum() > 0


def test_the_plan_predicts_the_gpu_peaks_within_6_percent():
    """qie plan against every peak measured on the GPU (benchmarks/results): the constants come from that table."""
    from benchmarks import plan_vs_gpu

    results = json.loads((REPO / "benchmarks/results/nvidia-h200-2026-11-26.json").read_text())
    rows = {r["id"]: r for r in results["rows"]}
    checked = 0
    for row_id, label, flags, left_out in plan_vs_gpu.ROWS:
        r = rows[row_id]
        planned = plan_vs_gpu.comparable(plan_vs_gpu.plan_of(flags)[3], left_out) / 2 ** 30
        if r["status"] == "ok":
            assert -0.02 < planned / r["peak_mem_gib"] - 1 < 0.06, (label, planned, r["peak_mem_gib"])
            checked += 1
        else:  # out of memory on the GPU: the plan must say it does not fit
            assert planned > r["peak_mem_gib"], (label, planned)
    assert checked >= 15


def test_ladder_prints_stock_and_baseline_and_skips_a_rung_whose_flag_is_absent(capsys, monkeypatch):
    """``benchmarks.ladder_predict`` (``gpu_all.sh --ladder``'s prediction stage): the stored stock and baseline
    profiles costed on a table (the baseline slower than stock, as measured), and a rung of a flag ``qie train``
    does not have printed as skipped instead of failing; ``gpu_all.sh`` refuses an unknown argument."""
    import subprocess

    from benchmarks import ladder_predict

    assert ladder_predict.missing_flags({"compile": True, "no_such_flag": 1}) == ["no_such_flag"]
    # the +4 rung: --fp8_compute on top of 1+2, a flag qie train has (so it is predicted, not skipped), and the
    # benchmark's row takes it with the other rows' ids unchanged
    assert ladder_predict.RUNGS["+4"] == {**ladder_predict.RUNGS["1+2"], "fp8_compute": True}
    assert ladder_predict.missing_flags(ladder_predict.RUNGS["+4"]) == []
    four = ladder_predict.rung_config("2511", ladder_predict.RUNGS["+4"])[0].train  # FP8 compute needs the FP8 base
    assert four.fp8_compute and four.fp8_base and four.compile and four.checkpoint_policy == "selective"
    from benchmarks.train_step import TrainBenchConfig, options_of

    plain = options_of(TrainBenchConfig())
    assert "fp8_compute" not in plain and options_of(TrainBenchConfig(fp8_compute=True)) == {**plain, "fp8_compute": True}
    monkeypatch.setitem(ladder_predict.RUNGS, "later", {"compile": True, "no_such_flag": True})
    assert ladder_predict.main(["--model", "2511", "--rungs", "later", "--gpus", "h200"]) == 0
    out = capsys.readouterr().out
    stock, baseline = (next(line for line in out.splitlines() if line.startswith(f"| {name}"))
                       for name in ("stock", "baseline"))
    assert stock.split("|")[4].strip() == "1.00x" and float(baseline.split("|")[4].strip()[:-1]) < 1.0
    assert "| later | skipped: no --no_such_flag |" in out
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_all.sh"
    rc = subprocess.run(["bash", str(script), "--no_such_option"], capture_output=True, text=True,
                        env={"RUN_DIR": "/nonexistent-unused", "PATH": "/usr/bin:/bin"}).returncode
    assert rc == 2
