"""`qie plan --verify`'s fake CUDA device: our real training step and edit at full width, with no GPU.

The full 60-block model runs in tests/memory/test_verify_fullsize_*.py; here two blocks at the real width
cover each configuration, the errors a GPU run would hit, and the memory count itself.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from diffsynth_qie.fakegpu.device import FakeCuda, FakeRunError, backward
from diffsynth_qie.models.presets import get_preset

GiB = 1024 ** 3


def run_config(model="2511", **train):
    from diffsynth_qie.training.config import RunConfig

    lora_rank = train.pop("lora_rank", 32)
    loss = train.pop("loss", "sft")
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, model=model, cache_dir="-", output_dir="-",
                                                             **train),
                              lora=dataclasses.replace(cfg.lora, lora_rank=lora_rank),
                              loss=dataclasses.replace(cfg.loss, loss=loss))
    return cfg.resolved(get_preset(model))


def test_live_bytes_follow_what_python_holds():
    with FakeCuda() as fc:
        x = torch.empty(1024, 1024, device="cuda", dtype=torch.bfloat16)
        assert fc.current_bytes == 2 * 1024 ** 2
        view = x[:10]  # a view shares the storage: no new bytes
        assert fc.current_bytes == 2 * 1024 ** 2
        with fc.phase("temp"):
            y = torch.empty(512, 1024, device="cuda", dtype=torch.float32) * 2
            del y
        assert fc.phases[-1].peak_bytes >= 2 * 1024 ** 2 + 4 * 512 * 1024
        assert fc.current_bytes == 2 * 1024 ** 2
        del x, view
        assert fc.current_bytes == 0
        cpu = torch.ones(3)  # host tensors stay real and are not counted
        assert cpu.sum().item() == 3.0 and fc.current_bytes == 0


def test_backward_frees_activations_and_matches_autograd_shapes():
    with FakeCuda() as fc:
        with fc.build(torch.bfloat16, "cuda:0"):
            lin = torch.nn.Linear(256, 256)
        lin.weight.requires_grad_(True)
        fc.register(lin)
        before = fc.current_bytes
        x = torch.empty(64, 256, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):  # repeated steps must not accumulate memory
            loss = (torch.relu(lin(x)) * 2).float().sum()
            backward(loss)
            del loss
        assert lin.weight.grad.shape == lin.weight.shape and lin.bias.grad.shape == lin.bias.shape
        assert fc.current_bytes == before + x.nbytes + lin.weight.nbytes + lin.bias.nbytes


def test_a_host_read_of_a_device_tensor_names_the_line():
    with FakeCuda():
        x = torch.empty(4, device="cuda")
        with pytest.raises(FakeRunError, match=r"host read.*test_verify\.py:\d+"):
            if x.sum() > 0:  # a sync a GPU step would stall on
                pass


def test_a_cpu_tensor_meeting_a_device_tensor_is_an_error():
    with FakeCuda():
        x = torch.empty(4, 4, device="cuda")
        with pytest.raises(FakeRunError, match="device mismatch|same device"):
            x + torch.ones(4, 4)


@pytest.mark.parametrize("case", [
    dict(model="2511", gradient_checkpointing=True),
    dict(model="2509", gradient_checkpointing=False),
    dict(model="2511", batch_size=2, mixed=True),
    dict(model="2511", fp8_base=True),
    dict(model="2511", loss="lbm"),
    dict(model="2511", refs=2),
], ids=["2511-ckpt", "2509-no-ckpt", "batch2-mixed", "fp8", "lbm", "2-refs"])
def test_training_step_configurations_run_at_full_width(case):
    from diffsynth_qie.preflight.train_step import batch_shapes, verify_train_step

    case = dict(case)
    mixed, refs = case.pop("mixed", False), case.pop("refs", 1)
    cfg = run_config(**case)
    shapes = batch_shapes(512, refs, 120, cfg.train.batch_size, mixed=mixed)
    if mixed:
        assert len({(s.height, s.width) for s in shapes}) == 2 and len({s.prompt_tokens for s in shapes}) == 2
    r = verify_train_step(cfg, get_preset(case["model"]), shapes, num_layers=2)
    assert r.loss_dtype == "float32"
    # 2 blocks of the real width hold 2 x 0.34 B parameters + the embeddings: about 1.3 GB in bf16
    dit = 2 * 0.34e9 * (1 if case.get("fp8_base") else 2)
    assert 0.5 * dit < r.weights < 2.5 * dit + 0.5 * GiB
    assert r.forward_backward_peak > r.weights and r.optimizer_state > 0
    assert r.peak >= r.forward_backward_peak


def test_checkpointing_lowers_the_peak_and_the_plan_agrees_with_the_depth_slope():
    """Activation memory per block, measured on the fake device, against qie plan's constants."""
    from diffsynth_qie.memory.census import preset_census
    from diffsynth_qie.memory.plan import CALIBRATION, PlanOptions
    from diffsynth_qie.preflight.train_step import batch_shapes, verify_train_step

    preset = get_preset("2511")
    shapes = batch_shapes(1024, 1, 300, 1)
    per_block = {}
    for ckpt in (False, True):
        peaks = [verify_train_step(run_config(gradient_checkpointing=ckpt), preset, shapes, num_layers=n).peak
                 for n in (1, 2)]
        per_block[ckpt] = peaks[1] - peaks[0]
    census = preset_census("2511", with_encoders=False)
    unit = PlanOptions().tokens * census.dim * 2  # bytes of one element per token per unit of width
    lora = census.lora_token_targets * 32 / census.dim
    block_params = census.block_params * 2 + 8 * 16 * 32 * 1e3  # a block's bf16 weights (+ its LoRA, small)
    assert per_block[True] < per_block[False] / 3
    predicted = (CALIBRATION["K_BLOCK"] + lora) * unit + census.block_params * 2
    assert abs(per_block[False] - predicted) / predicted < 0.1, (per_block[False] / GiB, predicted / GiB, block_params)


def test_edit_runs_at_full_width_with_lora_branches_and_cfg():
    from diffsynth_qie.preflight.edit_step import verify_edit

    r = verify_edit(get_preset("2511"), resolution=512, steps=1, lora_rank=16, num_layers=2)
    te = 8.29e9 * 2  # the real Qwen2.5-VL-7B text encoder in bf16
    assert te < r.weights < te + 3 * GiB
    assert r.denoise_peak > r.weights and r.encode_peak > r.weights and r.decode_peak > r.weights


def test_block_swapping_runs_on_the_fake_device_and_frees_the_swapped_blocks():
    """The real BlockSwapper's forward and backward hooks run under the fake device's backward walk."""
    from diffsynth_qie.preflight.train_step import batch_shapes, verify_train_step

    preset, shapes = get_preset("2511"), batch_shapes(512, 1, 50, 1)
    plain = verify_train_step(run_config(), preset, shapes, num_layers=5)
    swapped = verify_train_step(run_config(blocks_to_swap=4), preset, shapes, num_layers=5)
    block = 0.34e9 * 2  # one real-width block's frozen bf16 weights
    assert 3.6 * block < plain.weights - swapped.weights < 4.4 * block
    # qie plan counts 3 swapped blocks on the device at once (running, prefetched, kept for the backward
    # pass); this step peaks with 2 of the 4 in (the kept last block and the prefetched one before it)
    assert 1.6 * block < plain.forward_backward_peak - swapped.forward_backward_peak < 2.4 * block
    ins = [b for what, b in swapped.swap_events if what == "in"]
    assert ins.count(1) == 2 and ins.count(3) == 2  # swapped in again by their backward pre-hooks
    assert swapped.swap_events[-1][0] == "out"  # the callback queued on the engine ran at the end
    assert plain.swap_events == []


def test_edit_with_block_swapping_keeps_the_swapped_block_off_the_device():
    from diffsynth_qie.preflight.edit_step import verify_edit

    plain = verify_edit(get_preset("2511"), resolution=512, steps=1, num_layers=3)
    swapped = verify_edit(get_preset("2511"), resolution=512, steps=1, num_layers=3, blocks_to_swap=2)
    block = 0.34e9 * 2
    assert 1.8 * block < plain.weights - swapped.weights < 2.2 * block
    # an edit holds the running block and the prefetched one: both swapped blocks at the peak
    assert abs(plain.denoise_peak - swapped.denoise_peak) < 0.2 * block


def test_train_preflight_turns_a_host_sync_into_a_value_error(monkeypatch):
    from diffsynth_qie.preflight import train as verify_preflight
    from diffsynth_qie.training.losses import common

    real = common.per_sample_mse

    def syncing(pred, target, weight=None):
        err = real(pred, target, weight)
        if err > 0:  # what a careless metric would do inside the step
            return err
        return err

    monkeypatch.setattr(common, "per_sample_mse", syncing)  # the SFT loss imports it from common when called
    with pytest.raises(ValueError, match=r"preflight.*host read.*(test_verify|losses/sft)\.py:\d+.*--no_preflight"):
        verify_preflight.preflight(run_config(), get_preset("2511"))


def test_train_preflight_runs_a_block_swapping_run_with_its_swapper():
    from diffsynth_qie.preflight import train as verify_preflight

    report = verify_preflight.preflight(run_config(blocks_to_swap=20), get_preset("2511"))
    assert report.forward_backward_peak > report.weights
    last = verify_preflight.PREFLIGHT_BLOCKS  # the deeper run's last block (of PREFLIGHT_BLOCKS + 1) is the swapped one
    assert ("in", last) in report.swap_events and report.swap_events[-1] == ("out", last)
