"""The fake device's checks, each shown able to fail: a planted GPU bug is caught at its file:line with a hint,
and the legal counterpart passes (fakegpu/checks.py, streams.py, ops.py)."""
from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn.functional as F

from diffsynth_qie.fakegpu.device import FakeCuda, FakeRunError

HERE = "test_fake_checks.py"


def line_of(marker: str) -> int:
    """The line of this file that carries the comment ``# plant: <marker>``."""
    lines = open(__file__).read().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# plant: {marker}"))


def at(line: int) -> str:
    return rf"{HERE}:{line} "


def bf16(*shape):
    return torch.empty(*shape, device="cuda", dtype=torch.bfloat16)


# --- dtypes ---------------------------------------------------------------------------------------------------

def test_fp32_adapter_on_bf16_activations_without_autocast_is_caught():
    with FakeCuda():
        x, a = bf16(2, 8, 16), torch.empty(4, 16, device="cuda")  # an fp32 adapter
        with pytest.raises(FakeRunError, match=rf"dtype mismatch in aten\.\w+.* at .*{at(line_of('fp32'))}.*cast one"):
            F.linear(x, a)  # plant: fp32


def test_fp8_weight_reaching_f_linear_is_caught(monkeypatch):
    from diffsynth_qie.memory.fp8 import Fp8Linear, quantize_linears

    def forward(self, x):  # the plant: the FP8 bits, not dequantised
        return F.linear(x, self.weight)

    monkeypatch.setattr(Fp8Linear, "forward", forward)
    plant = inspect.getsourcelines(forward)[1] + 1
    with FakeCuda() as fc:
        with fc.build(torch.bfloat16):
            model = torch.nn.Sequential(torch.nn.Linear(16, 16)).requires_grad_(False)
        holder = torch.nn.Module()
        holder.transformer_blocks = model
        quantize_linears(holder, device="cuda:0")
        with pytest.raises(FakeRunError, match=rf"FP8 .*float8_e4m3fn.* in aten\.\w+.* at .*{at(plant)}.*dequantise"):
            model(bf16(2, 16))


def test_fp8_base_dequantises_and_passes():
    from diffsynth_qie.memory.fp8 import quantize_linears

    with FakeCuda() as fc:
        with fc.build(torch.bfloat16):
            holder = torch.nn.Module()
            holder.transformer_blocks = torch.nn.Sequential(torch.nn.Linear(16, 16)).requires_grad_(False)
        quantize_linears(holder, device="cuda:0")
        assert holder.transformer_blocks(bf16(2, 16)).dtype == torch.bfloat16


def test_autocast_mixed_inputs_are_legal_and_cast_as_autocast_does():
    with FakeCuda():
        x, w = bf16(2, 8, 16), torch.empty(4, 16, device="cuda")
        q = torch.empty(1, 2, 8, 16, device="cuda")  # fp32 query, bf16 key/value
        k = v = bf16(1, 2, 8, 16)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert F.linear(x, w).dtype == torch.bfloat16
            assert F.scaled_dot_product_attention(q, k, v).dtype == torch.bfloat16
        with pytest.raises(FakeRunError, match=rf"dtype mismatch in aten\._scaled_dot_product.* at .*"
                                               rf"{at(line_of('qkv'))}"):
            F.scaled_dot_product_attention(q, k, v)  # plant: qkv


def test_lora_branch_in_fp32_under_autocast_passes():
    from diffsynth_qie.lora.branch import attach
    from diffsynth_qie.lora.state import LoraModule

    with FakeCuda() as fc:
        with fc.build(torch.bfloat16):
            layer = torch.nn.Linear(16, 16).requires_grad_(False)
        attach(layer, LoraModule(torch.empty(4, 16, device="cuda"), torch.empty(16, 4, device="cuda")), 1.0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert layer(bf16(2, 16)).dtype == torch.bfloat16
        assert layer(bf16(2, 16)).dtype == torch.bfloat16  # the branch casts its input itself


# --- generators -------------------------------------------------------------------------------------------------

def test_cpu_generator_drawing_on_the_device_is_caught():
    with FakeCuda():
        gen = torch.Generator().manual_seed(0)
        with pytest.raises(FakeRunError, match=rf"generator on the wrong device .* at .*{at(line_of('randn'))}.*"
                                               rf"Expected a 'cuda' device type for generator but found 'cpu'"):
            torch.randn(4, 4, generator=gen, device="cuda")  # plant: randn
        x = bf16(4)
        with pytest.raises(FakeRunError, match=rf"generator on the wrong device .* at .*{at(line_of('normal_'))}"):
            x.normal_(generator=gen)  # plant: normal_


def test_cuda_generator_and_cpu_draws_moved_to_the_device_pass():
    with FakeCuda():
        gen = torch.Generator("cuda").manual_seed(1)
        assert gen.device.type == "cuda" and isinstance(gen, torch.Generator)
        assert torch.randn(4, generator=gen, device="cuda").device.type == "cuda"
        cpu = torch.Generator("cpu").manual_seed(1)
        noise = torch.randn(4, generator=cpu).to("cuda")  # the project's way (sample_noise, seeded_noise)
        assert noise.device.type == "cuda"
        assert isinstance(torch.default_generator, torch.Generator)


# --- host syncs -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["cpu", "to_cpu", "copy_"])
def test_device_to_host_copy_followed_by_device_work_in_a_phase_is_caught(shape):
    with FakeCuda() as fc:
        x = bf16(4, 4)
        with fc.phase("step"):
            host = torch.empty(4, 4, dtype=torch.bfloat16)
            if shape == "cpu":
                x.cpu()  # plant: cpu
            elif shape == "to_cpu":
                x.to("cpu")  # plant: to_cpu
            else:
                host.copy_(x)  # plant: copy_
            with pytest.raises(FakeRunError, match=rf"host sync in aten\.\w+.* at .*{at(line_of(shape))}.*'step' "
                                                   rf"phase.*keep the value on the device"):
                x * 2


def test_tolist_numpy_and_tensor_of_device_scalars_are_caught():
    with FakeCuda() as fc:
        x = bf16(4)
        with pytest.raises(FakeRunError, match=rf"host read .* at .*{at(line_of('tolist'))}"):
            x.tolist()  # plant: tolist
        with fc.phase("step"):
            with pytest.raises(FakeRunError, match=rf"host read .*\.numpy\(\).* at .*{at(line_of('numpy'))}"):
                x.float().cpu().numpy()  # plant: numpy
        with fc.phase("step"):
            with pytest.raises(FakeRunError, match=rf"host sync in torch\.tensor.* at .*{at(line_of('tensor'))}"
                                                   rf".*torch\.stack"):
                torch.tensor([x[0], x[1]])  # plant: tensor


def test_host_copies_outside_phases_at_a_phase_end_or_into_pinned_memory_pass():
    with FakeCuda() as fc:
        x = bf16(4)
        assert x.cpu().device.type == "cpu"  # building, saving: outside the verified phases
        assert torch.tensor([x[0], x[1]]).shape == (2,)
        with fc.phase("edit"):
            y = x * 2
            result = y.float().cpu()  # the phase's result, after its device work
        assert result.device.type == "cpu"
        with fc.phase("swap"):
            pinned = torch.empty(4, dtype=torch.bfloat16, pin_memory=True)
            pinned.copy_(x)  # the offload path (block swapping's masters)
            x * 2
        with fc.phase("save", host_syncs=True):
            x.cpu()
            x * 2


# --- legal CUDA calls -------------------------------------------------------------------------------------------

def test_streams_events_synchronize_generators_and_pinned_memory_are_modelled():
    with FakeCuda() as fc:
        side = torch.cuda.Stream()
        event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            y = bf16(4) * 2
            event.record()
        torch.cuda.current_stream().wait_event(event)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        assert event.query() and event.elapsed_time(event) == 0.0
        y.record_stream(torch.cuda.current_stream())
        host = torch.ones(1024).pin_memory()
        assert host.is_pinned() and host.sum().item() == 1024.0  # a real host tensor keeps its values
        torch.empty(3 << 20, dtype=torch.uint8, pin_memory=True)  # fake: no memory
        assert fc.memory.pinned >= 4096


def test_a_driver_error_becomes_a_fake_run_error_naming_our_frame():
    with pytest.raises(FakeRunError, match=rf"CUDA driver call at .*{at(line_of('driver'))}"):
        with FakeCuda():
            torch.cuda.mem_get_info()  # plant: driver


# --- stream order (block swapping's real CUDA transport) ----------------------------------------------------------

class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        for block in self.transformer_blocks:
            x = block(x)
        return x


def _swap_and_run(fc):
    from diffsynth_qie.memory.block_swap import BlockSwapper, CudaTransport

    with fc.build(torch.bfloat16):
        model = _Blocks().requires_grad_(False)
    swapper = BlockSwapper(model, 2, "cuda:0").install()
    assert isinstance(swapper.transport, CudaTransport)
    with fc.phase("forward"), torch.no_grad():
        return model(bf16(2, 16)), swapper


def test_block_swapping_runs_its_real_cuda_transport_on_the_fake_device():
    with FakeCuda() as fc:
        out, swapper = _swap_and_run(fc)
        assert out.shape == (2, 16)
        assert fc.memory.pinned > 0  # the swapped blocks' pinned buffers, counted on the host


def test_a_missing_wait_event_in_the_transport_is_caught_at_the_copy(monkeypatch):
    from diffsynth_qie.memory import swap_transport
    from diffsynth_qie.memory.block_swap import CudaTransport

    def finish(self, handle):  # the plant: no current.wait_event(event)
        tensors, event = handle
        return tensors

    monkeypatch.setattr(CudaTransport, "finish", finish)
    copy_line = next(i for i, text in enumerate(inspect.getsourcelines(swap_transport)[0], 1)
                     if "non_blocking=True" in text)
    with FakeCuda() as fc:
        with pytest.raises(FakeRunError, match=rf"stream order: .* copied to the device on a side stream at "
                                               rf"diffsynth_qie/memory/swap_transport\.py:{copy_line} .*wait_event"):
            _swap_and_run(fc)


# --- pinned buffers: exact size while swapping ------------------------------------------------------------------

def test_pinned_allocations_round_to_a_power_of_two_unless_exact():
    from diffsynth_qie.memory.swap_transport import pinned_allocation_bytes

    block = int(648.2 * 2 ** 20)  # a bf16 block of the real DiT
    assert pinned_allocation_bytes(block, exact_above=2 ** 64 - 1) == 1024 * 2 ** 20  # the default: 1.58x
    assert pinned_allocation_bytes(block, exact_above=16 << 20) == block
    assert pinned_allocation_bytes(3 << 20, exact_above=16 << 20) == 4 << 20


def test_swapping_sets_the_pinned_threshold_and_keeps_the_users(monkeypatch):
    from diffsynth_qie.memory import swap_transport

    monkeypatch.setattr(swap_transport, "_exact_above", None)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert swap_transport.pinned_allocation_bytes(int(648.2 * 2 ** 20)) == 1024 * 2 ** 20
    with FakeCuda():
        swap_transport.CudaTransport("cuda:0", "cpu")  # what BlockSwapper builds on a GPU
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,pinned_max_round_threshold_mb:16"
    assert swap_transport.pinned_allocation_bytes(int(648.2 * 2 ** 20)) == int(648.2 * 2 ** 20)
    monkeypatch.setattr(swap_transport, "_exact_above", None)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_max_round_threshold_mb:4096")
    swap_transport.exact_pinned_memory()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "pinned_max_round_threshold_mb:4096"
    assert swap_transport.pinned_allocation_bytes(int(648.2 * 2 ** 20)) == 1024 * 2 ** 20


def test_a_pytorch_without_the_pinned_threshold_gets_a_warning_and_an_untouched_environment(monkeypatch, caplog):
    """PyTorch 2.11's allocator refuses ``pinned_max_round_threshold_mb``: swapping must go on, warn about the
    rounding, and leave the allocator settings of later processes alone (they would refuse them too)."""
    import torch

    from diffsynth_qie.memory import swap_transport

    def refuse(setting):
        raise ValueError(f"Unrecognized key '{setting.split(':')[0]}' in Accelerator allocator config.")

    monkeypatch.setattr(swap_transport, "_exact_above", None)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse)
    with caplog.at_level("WARNING", logger=swap_transport.__name__):
        swap_transport.exact_pinned_memory()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert swap_transport.pinned_allocation_bytes(int(648.2 * 2 ** 20)) == 1024 * 2 ** 20  # rounded, as it is
    assert "power of two" in caplog.text and "Unrecognized key" in caplog.text


def test_the_plans_pinned_figure_is_what_the_pinned_allocator_takes():
    from diffsynth_qie.memory.census import DiTCensus
    from diffsynth_qie.memory.plan import PlanOptions, predict

    def census(block_params):  # the real DiT's shape (60 blocks of 0.34 B parameters), and a small one
        return DiTCensus(dim=3072, num_layers=60, params=60 * block_params + 40_000_000, block_params=block_params,
                         linear_weight_params=60 * block_params, linear_out_features=60 * 60_000,
                         lora_features=60 * 60_000, lora_token_targets=12)

    real = predict(census(340_000_000), PlanOptions(blocks_to_swap=30))
    assert real.host["swapped blocks (pinned)"] == 30 * 340_000_000 * 2  # exact: not 30 x 1024 MiB
    small = predict(census(3_000_000), PlanOptions(blocks_to_swap=30))  # 5.7 MiB blocks: rounded to 8 MiB
    assert small.host["swapped blocks (pinned)"] == 30 * 8 * 2 ** 20
