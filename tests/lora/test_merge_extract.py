"""`qie merge-lora` / `qie extract-lora` on the tiny DiT split into 3 shards.

Tolerances (fp32 on CPU): merged weights equal base + scale * alpha/rank * B @ A (computed
here in float64) to 1e-5 absolute; the DiT loaded from the merged files equals the base DiT
with the LoRA applied in memory to 1e-6; extracting at the LoRA's rank recovers each
module's delta to 1e-4 relative (Frobenius) and the DiT output to 1e-4 relative.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffsynth_qie.cli import main
from diffsynth_qie.lora.apply import apply_lora
from diffsynth_qie.lora.export import save_lora
from diffsynth_qie.lora.extract import extract_lora
from diffsynth_qie.lora.formats import load_lora_state
from diffsynth_qie.lora.merge import merge_loras, parse_lora_spec
from diffsynth_qie.lora.state import LoraModule, LoraState

RANK, ALPHA = 4, 2.0


def _read_dir(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("diffusion_pytorch_model*.safetensors")):
        out.update(load_file(str(path)))
    return out


@pytest.fixture(scope="module")
def sharded_base(tiny_model_dir, tmp_path_factory):
    """The tiny model with its DiT split into 3 shards + index (other components symlinked)."""
    root = tmp_path_factory.mktemp("sharded") / "base"
    folder = root / "transformer"
    folder.mkdir(parents=True)
    state = load_file(str(Path(tiny_model_dir) / "transformer/diffusion_pytorch_model.safetensors"))
    keys = sorted(state)
    weight_map = {}
    for i in range(3):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-00003.safetensors"
        part = {k: state[k] for k in keys[i::3]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
         "weight_map": weight_map}))
    for entry in Path(tiny_model_dir).iterdir():
        if entry.name != "transformer":
            (root / entry.name).symlink_to(entry.resolve())
    return root, state


def _lora(state: dict[str, torch.Tensor], seed: int, blocks=("transformer_blocks.0.",)) -> LoraState:
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for key, w in sorted(state.items()):
        if w.ndim == 2 and key.endswith(".weight") and key.startswith(blocks):
            a = torch.randn(RANK, w.shape[1], generator=g) * 0.1
            b = torch.randn(w.shape[0], RANK, generator=g) * 0.1
            modules[key[: -len(".weight")]] = LoraModule(A=a, B=b, alpha=ALPHA)
    assert modules
    return LoraState(modules=modules)


def _expected(state, loras):
    out = {k: v.double() for k, v in state.items()}
    for lora, scale in loras:
        for name, mod in lora.modules.items():
            out[f"{name}.weight"] += scale * (ALPHA / RANK) * (mod.B.double() @ mod.A.double())
    return out


def test_merge_equals_base_plus_lora_and_keeps_layout(sharded_base, tmp_path):
    root, state = sharded_base
    l1, l2 = _lora(state, 1), _lora(state, 2, blocks=("transformer_blocks.0.attn", "transformer_blocks.1."))
    p1, p2 = save_lora(tmp_path / "a.safetensors", l1), save_lora(tmp_path / "b.safetensors", l2)
    out = tmp_path / "merged"
    main(["merge-lora", str(root), "--lora", f"{p1}:0.5", "--lora", str(p2), "--out", str(out), "--dtype", "fp32"])
    src, dst = root / "transformer", out / "transformer"
    assert sorted(p.name for p in dst.glob("*.safetensors")) == sorted(p.name for p in src.glob("*.safetensors"))
    index = json.loads((dst / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((src / "diffusion_pytorch_model.safetensors.index.json")
                                             .read_text())["weight_map"]
    merged = _read_dir(dst)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    expected = _expected(state, [(l1, 0.5), (l2, 1.0)])
    assert set(merged) == set(state)
    changed = {f"{n}.weight" for n in list(l1.modules) + list(l2.modules)}
    for key, tensor in merged.items():
        assert tensor.shape == state[key].shape
        if key in changed:
            assert (tensor.double() - expected[key]).abs().max() < 1e-5, key
            assert not torch.equal(tensor, state[key])
        else:
            assert torch.equal(tensor, state[key]), key


def test_merged_model_loads_through_load_pipeline(sharded_base, tiny_pipe, tmp_path):
    from diffsynth_qie.models.load.loading import load_pipeline

    root, state = sharded_base
    lora = _lora(state, 3)
    path = save_lora(tmp_path / "l.safetensors", lora)
    merge_loras(root, [(path, 0.8)], tmp_path / "m", dtype="fp32")
    pipe = load_pipeline("tiny", model_dir=tmp_path / "m", components=("dit",), device="cpu",
                         torch_dtype=torch.float32)
    reference = {k: v.clone() for k, v in tiny_pipe.dit.state_dict().items()}
    try:
        apply_lora(tiny_pipe.dit, load_lora_state(path), 0.8)
        want = tiny_pipe.dit.state_dict()
        got = pipe.dit.state_dict()
        assert set(got) == set(want)
        worst = max(float((got[k] - want[k]).abs().max()) for k in want)
        assert worst < 1e-6
    finally:
        tiny_pipe.dit.load_state_dict(reference)


def test_fp8_output_keeps_keys_and_rounds_within_e4m3(sharded_base, tmp_path):
    from diffsynth_qie.models.load.loading import load_pipeline

    root, state = sharded_base
    path = save_lora(tmp_path / "l.safetensors", _lora(state, 4))
    merge_loras(root, [(path, 1.0)], tmp_path / "m8", dtype="fp8")
    merged = _read_dir(tmp_path / "m8" / "transformer")
    ref = merge_loras(root, [(path, 1.0)], tmp_path / "m32", dtype="fp32")
    exact = _read_dir(ref.out_dir / "transformer")
    for key, tensor in merged.items():
        assert tensor.shape == state[key].shape
        if tensor.ndim == 2 and key.endswith(".weight"):
            assert tensor.dtype == torch.float8_e4m3fn
            w = exact[key]
            # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4 for normal numbers;
            # subnormals (|w| < 2^-6) have absolute error <= 2^-10.
            err = (tensor.float() - w).abs()
            assert bool((err <= w.abs() * 2 ** -4 + 2 ** -10).all()), key
        else:
            assert tensor.dtype == torch.bfloat16
    pipe = load_pipeline("tiny", model_dir=tmp_path / "m8", components=("dit",), device="cpu",
                         torch_dtype=torch.float32)
    assert sum(p.numel() for p in pipe.dit.parameters()) == sum(t.numel() for t in state.values())


@torch.no_grad()
def test_extract_of_merge_recovers_the_lora(sharded_base, tiny_pipe, tmp_path):
    root, state = sharded_base
    lora = _lora(state, 5, blocks=("transformer_blocks.0.", "transformer_blocks.1."))
    path = save_lora(tmp_path / "l.safetensors", lora)
    merge_loras(root, [(path, 1.0)], tmp_path / "m", dtype="fp32")
    out = tmp_path / "x.safetensors"
    assert main(["extract-lora", "--base", str(root), "--tuned", str(tmp_path / "m"), "--out", str(out),
                 "--rank", str(RANK)]) == 0
    extracted = load_lora_state(out)
    assert set(extracted.modules) == set(lora.modules)
    assert extracted.ranks == {RANK}
    worst = 0.0
    for name, mod in lora.modules.items():
        want = mod.delta()
        worst = max(worst, float((extracted.modules[name].delta() - want).norm() / want.norm()))
    assert worst < 1e-4

    # The DiT's output with the extracted LoRA matches the original LoRA's.
    g = torch.Generator().manual_seed(0)
    dit = tiny_pipe.dit
    x = torch.randn(1, 16, 4, 4, generator=g)
    prompt = [torch.randn(5, dit.txt_in.in_features, generator=g)]
    from diffsynth_qie.models.qwen_image_edit.forward import dit_forward

    reference = {k: v.clone() for k, v in dit.state_dict().items()}
    try:
        base_out = dit_forward(dit, x, torch.tensor([500.0]), prompt)[0]
        apply_lora(dit, lora, 1.0)
        want = dit_forward(dit, x, torch.tensor([500.0]), prompt)[0]
        dit.load_state_dict(reference)
        apply_lora(dit, extracted, 1.0)
        got = dit_forward(dit, x, torch.tensor([500.0]), prompt)[0]
    finally:
        dit.load_state_dict(reference)
    assert float((want - base_out).norm() / base_out.norm()) > 1e-3  # the LoRA does change the output
    assert float((got - want).norm() / want.norm()) < 1e-4

    # A lower rank loses part of the delta; the energy rule picks at most the true rank.
    low, report = extract_lora(root, tmp_path / "m", rank=1)
    assert low.ranks == {1} and min(report.rel_errors.values()) > 1e-2
    by_energy, report = extract_lora(root, tmp_path / "m", energy=0.999999)
    assert max(by_energy.ranks) <= RANK and max(report.rel_errors.values()) < 1e-2


def test_bad_inputs_name_the_problem(sharded_base, tmp_path):
    root, state = sharded_base
    key = next(k for k, v in sorted(state.items()) if v.ndim == 2 and k.startswith("transformer_blocks.0."))
    w = state[key]
    bad = LoraState(modules={key[:-7]: LoraModule(A=torch.zeros(2, w.shape[1] + 1), B=torch.zeros(w.shape[0], 2))})
    path = save_lora(tmp_path / "bad.safetensors", bad)
    with pytest.raises(ValueError, match="bad.safetensors.*shape mismatch"):
        merge_loras(root, [(path, 1.0)], tmp_path / "o")
    good = save_lora(tmp_path / "good.safetensors", _lora(state, 6))
    with pytest.raises(ValueError, match="base model's own directory"):
        merge_loras(root, [(good, 1.0)], root)
    with pytest.raises(ValueError, match="--dtype"):
        merge_loras(root, [(good, 1.0)], tmp_path / "o", dtype="int8")
    with pytest.raises(ValueError, match="holds no DiT weights"):
        merge_loras(tmp_path, [(good, 1.0)], tmp_path / "o")
    with pytest.raises(ValueError, match="--rank R or --energy"):
        extract_lora(root, root)
    with pytest.raises(ValueError, match="no 2-D weight that differs"):
        extract_lora(root, root, rank=2)
    assert parse_lora_spec("dir:x/a.safetensors:0.25") == ("dir:x/a.safetensors", 0.25)
    assert parse_lora_spec("a.safetensors") == ("a.safetensors", 1.0)
    assert main(["merge-lora", str(root), "--lora", str(path), "--out", str(tmp_path / "o2")]) == 2


def test_help_exits_cleanly():
    for command in ("merge-lora", "extract-lora"):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0


def test_a_killed_merge_reruns_into_the_same_directory_and_finishes_it(sharded_base, tmp_path, monkeypatch):
    """Killed after the first shard (and with a killed shard write's temp left behind), the same command
    finishes the merge: the result equals an uninterrupted one; other inputs are refused by name."""
    from diffsynth_qie.lora import merge as merge_mod
    from diffsynth_qie.utils.atomic import temp_leftovers

    root, state = sharded_base
    path = save_lora(tmp_path / "a.safetensors", _lora(state, 1))
    argv = ["merge-lora", str(root), "--lora", str(path), "--dtype", "fp32", "--out"]
    main(argv + [str(tmp_path / "clean")])
    out = tmp_path / "killed"
    real, calls = merge_mod.atomic_save, []

    def dies_on_the_second_shard(target, fn):
        calls.append(target)
        if len(calls) == 2:  # a dead process's half-written temp directory, then the kill
            (target.parent / ".diffusion_pytorch_model.999999-x1.tmp").mkdir()
            raise KeyboardInterrupt
        real(target, fn)

    monkeypatch.setattr(merge_mod, "atomic_save", dies_on_the_second_shard)
    assert main(argv + [str(out)]) == 130
    monkeypatch.setattr(merge_mod, "atomic_save", real)
    assert len(list((out / "transformer").glob("*.safetensors"))) == 1 and temp_leftovers(out / "transformer")
    other = save_lora(tmp_path / "b.safetensors", _lora(state, 2))
    with pytest.raises(ValueError, match="unfinished merge of other inputs"):
        merge_mod.merge_loras(root, [(other, 1.0)], out, dtype="fp32")
    assert main(argv + [str(out)]) == 0
    assert not temp_leftovers(out / "transformer") and not (out / merge_mod.PROGRESS_NAME).exists()
    finished, clean = _read_dir(out / "transformer"), _read_dir(tmp_path / "clean" / "transformer")
    assert finished.keys() == clean.keys() and all(torch.equal(finished[k], clean[k]) for k in clean)
    with pytest.raises(ValueError, match="already holds DiT weights"):  # a finished merge is never overwritten
        merge_mod.merge_loras(root, [(path, 1.0)], out, dtype="fp32")
