"""`qie train --on_the_fly` and `--compile` under the fake-device check.

--on_the_fly: the family's text encoder and VAE are built on the fake device and one sample is encoded through
the real on-the-fly path (`LiveStore.load`), its transient counted; a bug in that path is caught at its line.
--compile: dynamo really compiles the blocks under the fake device (graphs counted with a counting backend) and
a bug inside a compiled block is caught at its line.
"""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from diffsynth_qie.models.presets import get_preset

from test_verify_train_options import run_config, step

GiB = 1024 ** 3


def on_the_fly(cfg, **onthefly):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, cache_dir=None),
                               dataset=dataclasses.replace(cfg.dataset, dataset_metadata="-"),
                               onthefly=dataclasses.replace(cfg.onthefly, on_the_fly=True, **onthefly))


def _line_of(module, text: str) -> int:
    lines, start = inspect.getsourcelines(module)
    return max(start, 1) + next(i for i, line in enumerate(lines) if text in line)  # (a module starts at 0)


@pytest.mark.parametrize("model", ["2511", "2.1"])
def test_on_the_fly_builds_the_encoders_and_counts_one_encode(model):
    plain = step(run_config(model=model, mask=(1.0, 0.1)), model=model)
    report = step(on_the_fly(run_config(model=model, mask=(1.0, 0.1)), augment=True), model=model)
    # the family's whole text encoder (7-8 B parameters, bf16) and the VAE encoder sit beside the DiT
    assert 14 * GiB < report.encoder_weights < 20 * GiB
    assert report.weights - plain.weights == pytest.approx(report.encoder_weights, abs=1 << 20)
    assert report.encode_transient > 0  # the language model's and the VAE's working set of one sample
    assert report.peak == pytest.approx(plain.peak + report.encoder_weights + report.encode_transient, rel=0.02)


def test_encoders_on_another_device_are_not_built_and_said_so():
    report = step(on_the_fly(run_config(), text_encoder_device="cpu"))
    assert report.encoder_weights == 0 and any("--text_encoder_device cpu" in n for n in report.notes)


def test_a_cpu_tensor_in_the_on_the_fly_vae_input_is_caught_at_its_line(monkeypatch):
    from diffsynth_qie.cache import encode
    from diffsynth_qie.models.qwen_image_edit.edit_ops import EditOps

    real = EditOps.vae_pixels
    monkeypatch.setattr(EditOps, "vae_pixels", lambda self, pipe, image: real(self, pipe, image).cpu())  # planted
    step(run_config())  # from a cache the encode path is not reached
    line = _line_of(encode, "lat = pipe.vae.encode(pixels)")
    with pytest.raises(ValueError, match=rf"preflight.*device mismatch.*diffsynth_qie/cache/encode\.py:{line} "
                                         r"\(vae_encode_many\).*--no_preflight"):
        from diffsynth_qie.preflight.train import preflight

        preflight(on_the_fly(run_config(), max_pixels=512 * 512), get_preset("2511"))


# --- --compile ---------------------------------------------------------------------------------------------------
def _counting(monkeypatch) -> list:
    from diffsynth_qie.models.load import compile as compile_mod

    graphs: list = []

    def counter(gm, inputs):
        graphs.append(gm)
        return gm.forward

    real = compile_mod.compile_blocks
    monkeypatch.setattr(compile_mod, "compile_blocks", lambda dit, **kw: real(dit, **{**kw, "backend": counter}))
    return graphs


def test_compile_compiles_the_blocks_and_runs_the_graphs_on_the_fake_device(monkeypatch):
    eager = step(run_config(gradient_checkpointing=False))
    graphs = _counting(monkeypatch)
    compiled = step(run_config(compile=True, gradient_checkpointing=False))
    assert len(graphs) >= 1  # dynamo traced the block (it skips every frame under a non-ignoring dispatch mode)
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("linear" in o or "matmul" in o for o in ops)
    # the graph ran on the fake device: its tensors are counted like the eager run's
    assert compiled.forward_backward_peak == pytest.approx(eager.forward_backward_peak, rel=0.05)


def test_compile_compiles_the_21_blocks_under_their_host_bookkeeping_stand_in(monkeypatch):
    graphs = _counting(monkeypatch)
    step(run_config(model="2.1", compile=True), model="2.1")
    assert len(graphs) >= 1


def test_a_device_mismatch_inside_a_compiled_block_is_caught_at_its_line(monkeypatch):
    from diffsynth.models import qwen_image_dit

    _counting(monkeypatch)
    real = qwen_image_dit.QwenImageTransformerBlock.forward

    def planted(self, image, *args, **kwargs):
        image = image + torch.zeros(image.shape[-1])  # a CPU tensor in the compiled block
        return real(self, image, *args, **kwargs)

    monkeypatch.setattr(qwen_image_dit.QwenImageTransformerBlock, "forward", planted)
    line = inspect.getsourcelines(planted)[1] + 1
    with pytest.raises(Exception, match=r"device mismatch in aten\.add\.Tensor at .*:\d+"):
        step(run_config())  # without --compile: caught by the eager check
    with pytest.raises(Exception, match=rf"device mismatch at .*test_verify_onthefly_compile\.py:{line} "
                                        r"\(planted\) \(found by torch\.compile"):
        step(run_config(compile=True))
