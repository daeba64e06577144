"""Host loads (``--fp8_base``, ``--blocks_to_swap``): no private copy of the weights, each layer straight to
its final form, the processes on a machine in turns."""
import hashlib
import threading
import time

import pytest
import torch


def _file_mappings() -> list[tuple[int, int, str]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].endswith(".safetensors"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, parts[5]))
    return out


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_a_host_load_leaves_the_dit_in_its_files_memory_map(tiny_model_dir):
    """DiffSynth's reader cloned every tensor into private memory (41 GB per process for the real DiT)."""
    from diffsynth_qie.models.load.loading import load_pipeline

    dit = load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu",
                        torch_dtype=torch.float32, map_weights=True).dit
    maps = _file_mappings()
    params = list(dit.parameters())
    mapped = [p for p in params if any(a <= p.data_ptr() < b and "transformer" in path for a, b, path in maps)]
    assert len(mapped) == len(params) > 10


def test_a_load_that_computes_on_the_cpu_keeps_aligned_copies(tiny_model_dir):
    from diffsynth_qie.models.load.loading import load_pipeline

    dit = load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu",
                        torch_dtype=torch.float32).dit
    maps = _file_mappings()
    assert not any(a <= p.data_ptr() < b for p in dit.parameters() for a, b, _ in maps)


def test_writing_a_mapped_weight_leaves_the_file_alone(tiny_model_dir):
    from diffsynth_qie.models.load.loading import load_pipeline

    pipe = load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu",
                         torch_dtype=torch.float32, map_weights=True)
    path = pipe.qie_model_paths["dit"][0]
    before = hashlib.sha256(open(path, "rb").read()).hexdigest()
    weight = next(pipe.dit.parameters())
    with torch.no_grad():
        weight.add_(1.0)  # what merging a LoRA into the base does
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == before
    reloaded = load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu",
                             torch_dtype=torch.float32, map_weights=True).dit
    assert torch.equal(next(reloaded.parameters()) + 1.0, weight)


def test_mapped_tensors_convert_only_what_is_stored_in_another_dtype(tmp_path):
    from safetensors.torch import save_file

    from diffsynth_qie.models.load.host_weights import mapped_tensors

    save_file({"w": torch.randn(8, 8, dtype=torch.bfloat16), "i": torch.arange(4)}, str(tmp_path / "m.safetensors"))
    same = mapped_tensors([str(tmp_path / "m.safetensors")], torch.bfloat16)
    other = mapped_tensors([str(tmp_path / "m.safetensors")], torch.float32)
    assert same["w"].dtype == torch.bfloat16 and other["w"].dtype == torch.float32
    assert other["i"].dtype == torch.int64 and torch.equal(other["w"], same["w"].float())


def test_fp8_layers_of_swapped_blocks_are_quantised_on_the_device_and_kept_on_the_host(tiny_model_dir):
    """Quantised where the GPU would be (here: the CPU), then moved to the host device one layer at a time
    (``meta`` stands for the host so the two places differ)."""
    from diffsynth_qie.memory import fp8
    from diffsynth_qie.memory.block_swap import swapped_blocks
    from diffsynth_qie.models.load.loading import load_pipeline

    dit = load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu",
                        torch_dtype=torch.float32).dit.requires_grad_(False)
    host = swapped_blocks(dit, 1)
    assert host == [f"transformer_blocks.{len(dit.transformer_blocks) - 1}"]
    quantised_on = []
    real = fp8.quantize_weight
    fp8.quantize_weight = lambda w: (quantised_on.append(w.device.type), real(w))[1]
    try:
        report = fp8.quantize_linears(dit, device="cpu", host=host, host_device="meta")
    finally:
        fp8.quantize_weight = real
    assert set(quantised_on) == {"cpu"} and len(quantised_on) == len(report.layers)
    for name in report.layers:
        layer = dit.get_submodule(name)
        expected = "meta" if name.startswith(host[0] + ".") else "cpu"
        assert layer.weight_bits.device.type == expected, name


def _thread_exchange(n):
    """``in_turns``'s exchange among ``n`` threads: a barrier that hands every thread all failures."""
    barrier, slots = threading.Barrier(n), [None] * n

    def for_rank(r):
        def exchange(failure):
            slots[r] = failure
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out
        return exchange
    return for_rank


def test_processes_on_a_machine_load_in_turns():
    from diffsynth_qie.training.placement import in_turns

    n, spans, lock = 3, {}, threading.Lock()
    exchange = _thread_exchange(n)

    def rank(r):
        def load():
            start = time.perf_counter()
            time.sleep(0.05)
            with lock:
                spans[r] = (start, time.perf_counter())
            return r
        assert in_turns(load, r, n, exchange(r)) == r

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ordered = [spans[r] for r in range(n)]
    assert all(ordered[k][1] <= ordered[k + 1][0] for k in range(n - 1))  # no two loads overlap, in rank order


def test_a_failed_turn_stops_every_process_at_that_turn():
    from diffsynth_qie.training.placement import TurnFailed, in_turns

    n, calls, raised = 3, [], {}
    exchange = _thread_exchange(n)

    def rank(r):
        def load():
            calls.append(r)
            if r == 1:
                raise OSError("disk gone")
            return r
        try:
            in_turns(load, r, n, exchange(r))
        except Exception as e:  # noqa: BLE001
            raised[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert calls == [0, 1]  # process 2 never started its turn
    assert isinstance(raised[1], OSError)
    for r in (0, 2):
        assert isinstance(raised[r], TurnFailed)
        assert "process 1 failed while loading the DiT in its turn: OSError: disk gone" in str(raised[r])
