"""A file that is no LoRA, or a LoRA part of which a runtime cannot take: one line that says so.

``qie inspect-lora`` on a text file, a truncated file or a damaged safetensors header says "not a LoRA file" in
one line (``--json``: one JSON object with the error); an export refused for full weights counts the fully trained
modules (a weight and its bias are one module) and gives no share of the LoRA's delta for them.
"""
from __future__ import annotations

import json

import pytest
import torch

from diffsynth_qie.lora.state import LoraModule, LoraState


@pytest.mark.parametrize("content, name", [(b"101\n", "notes.txt"), (b"abcdefg", "lora.bin"),
                                           (b"hello", "lora.safetensors"), (b"\x80\x02}q\x00.", "lora.pt")])
def test_inspect_lora_says_not_a_lora_file_in_one_line(tmp_path, capsys, content, name):
    from diffsynth_qie.cli import main

    path = tmp_path / name
    path.write_bytes(content)
    for args in ([str(path)], [str(path), "--json"]):
        assert main(["inspect-lora", *args]) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and " ERROR " in lines[0], captured.err
        error = lines[0].split(": ", 1)[1]
        assert "not a LoRA file" in error and "weights_only" not in error and str(path) in error
        if "--json" in args:
            assert json.loads(captured.out) == {"file": str(path), "error": error}
        else:
            assert captured.out == ""


def _lora_with_full_weights() -> LoraState:
    g = torch.Generator().manual_seed(0)
    return LoraState(
        modules={"transformer_blocks.0.attn.to_q": LoraModule(A=torch.randn(4, 64, generator=g),
                                                              B=torch.randn(64, 4, generator=g)),
                 "transformer_blocks.0.img_mod.1": LoraModule(A=torch.randn(4, 64, generator=g),
                                                              B=torch.randn(384, 4, generator=g))},
        full={"img_in.weight": torch.randn(64, 64, generator=g), "img_in.bias": torch.randn(64, generator=g),
              "proj_out.weight": torch.randn(64, 64, generator=g)}, source="lora.safetensors")


@pytest.mark.parametrize("fmt", ["diffusers", "vllm-omni"])
def test_a_full_weight_refusal_counts_modules_not_tensors(tmp_path, fmt):
    """img_in (weight and bias) and proj_out: 2 fully trained modules, no "0.0 %" of the delta; vLLM-Omni's
    refused img_mod.1 keeps its share of the LoRA's delta, apart from the full weights."""
    from diffsynth_qie.lora.export_check import export_checked
    from diffsynth_qie.lora.inspect import runtime_row
    from diffsynth_qie.lora.runtime_reads import FileKeys

    state = _lora_with_full_weights()
    with pytest.raises(ValueError) as e:
        export_checked(state, tmp_path / "out.safetensors", fmt)
    message = str(e.value)
    assert "2 fully trained module(s)" in message and "img_in, proj_out" in message and "0.0%" not in message
    if fmt == "vllm-omni":
        assert "1 of LoRA lora.safetensors's 2 modules" in message and "transformer_blocks.0.img_mod.1 (" in message
    else:
        assert "% of its delta" not in message
    row = runtime_row(state, fmt, FileKeys({}, {}, {}))
    assert row["status"] == "cannot" and "2 fully trained module(s)" in row["why"] and "0.0%" not in row["why"]
