"""Streaming the DiT's weights from the safetensors memory map (memory/zero3_load.py).

Under ZeRO-3 the same ``stream_into`` gathers one partitioned parameter at a time (covered end to
end by tests/test_zero3.py, whose training run loads its DiT through it); here, in a normal process,
it must give exactly DiffSynth's parameters while never holding more than one tensor at a time.
"""
from __future__ import annotations

import weakref

import pytest
import torch


def _dit(tiny_model_dir, dtype):
    from diffsynth_qie.models.load.loading import load_pipeline

    pipe = load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu", torch_dtype=dtype)
    return pipe.dit, pipe.qie_model_paths["dit"]


def _scramble(model):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


def _reader(paths, **kwargs):
    from diffsynth_qie.memory.zero3_load import DIT_MODEL_NAME, SafetensorsStream, _converter_for

    return SafetensorsStream(paths, _converter_for(paths, DIT_MODEL_NAME), **kwargs)


class CountingStream:
    """Wraps a reader; tracks the bytes of the tensors it handed out that are still alive."""

    def __init__(self, inner):
        self.inner, self.paths = inner, inner.paths
        self.live = self.peak = 0
        self.sizes: list[int] = []

    def keys(self):
        return self.inner.keys()

    def shape(self, key):
        return self.inner.shape(key)

    @property
    def bytes_read(self):
        return self.inner.bytes_read

    def read(self, key, dtype=None):
        tensor = self.inner.read(key, dtype)
        nbytes = tensor.numel() * tensor.element_size()
        self.sizes.append(nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._freed, nbytes)
        return tensor

    def _freed(self, nbytes):
        self.live -= nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_load_equals_diffsynths_load(tiny_model_dir, dtype):
    from diffsynth_qie.memory.zero3_load import stream_into

    reference, paths = _dit(tiny_model_dir, dtype)
    model, _ = _dit(tiny_model_dir, dtype)
    _scramble(model)
    assert any(not torch.equal(p, reference.get_parameter(n)) for n, p in model.named_parameters())
    nbytes = stream_into(model, _reader(paths))
    params = dict(model.named_parameters())
    assert params.keys() == dict(reference.named_parameters()).keys()
    for name, p in reference.named_parameters():
        assert params[name].dtype == p.dtype and torch.equal(params[name], p), name
    assert nbytes == sum(p.numel() * p.element_size() for p in params.values())


def test_stream_holds_one_tensor_at_a_time_and_releases_the_map(tiny_model_dir):
    from diffsynth_qie.memory.zero3_load import SafetensorsStream, stream_into

    reference, paths = _dit(tiny_model_dir, torch.float32)
    model, _ = _dit(tiny_model_dir, torch.float32)
    _scramble(model)
    sizes = sorted(p.numel() * p.element_size() for p in model.parameters())
    reopen = sizes[-1] * 2  # reopen the memory map several times during the load
    opens = []
    inner = _reader(paths, reopen_bytes=reopen)
    original_open = inner._open
    inner._open = lambda: (opens.append(inner.bytes_read), original_open())
    counting = CountingStream(inner)
    stream_into(model, counting)
    # every parameter was read once, and the reader never had two tensors alive at once
    assert sorted(counting.sizes) == sizes
    assert counting.peak == sizes[-1]
    assert counting.live == 0
    # the map was reopened each time `reopen` bytes had been read since the last opening
    assert len(opens) >= 2
    assert all(b - a >= reopen for a, b in zip([0] + opens, opens))
    assert all(torch.equal(p, reference.get_parameter(n)) for n, p in model.named_parameters())
    assert isinstance(inner, SafetensorsStream)


def test_mismatched_weights_are_refused_by_name(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from diffsynth_qie.memory.zero3_load import SafetensorsStream, stream_into

    model, paths = _dit(tiny_model_dir, torch.float32)
    state = load_file(paths[0])
    dropped = sorted(state)[0]
    del state[dropped]
    save_file(state, str(tmp_path / "dit.safetensors"))
    with pytest.raises(ValueError, match=rf"missing \['{dropped}'\]"):
        stream_into(model, SafetensorsStream(str(tmp_path / "dit.safetensors")))

    state = load_file(paths[0])
    key = next(k for k, v in state.items() if v.ndim == 2)
    state[key] = state[key][:, :-1].contiguous()
    save_file(state, str(tmp_path / "dit2.safetensors"))
    with pytest.raises(ValueError, match=rf"{key} in .* has shape"):
        stream_into(model, SafetensorsStream(str(tmp_path / "dit2.safetensors")))


def test_without_zero3_the_loader_is_diffsynths(tiny_model_dir):
    from diffsynth_qie.memory.zero3_load import load_dit_pipeline, zero3_enabled

    assert not zero3_enabled()
    reference, _ = _dit(tiny_model_dir, torch.float32)
    dit = load_dit_pipeline("tiny", model_dir=tiny_model_dir, device="cpu", torch_dtype=torch.float32).dit
    assert all(torch.equal(p, reference.get_parameter(n)) for n, p in dit.named_parameters())
