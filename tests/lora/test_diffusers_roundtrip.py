"""Round trips through the real diffusers and PEFT, on diffusers' own Qwen-Image transformers.

diffusers' ``QwenImageTransformer2DModel`` (Qwen-Image-Edit) and ``QwenImage21Transformer2DModel`` are built at
the tiny DiTs' sizes; their linears have DiffSynth's names and shapes (checked first). Our exports are loaded
the way ``QwenImagePipeline.load_lora_weights`` loads a file (``lora_state_dict``, its "lora" key check,
``load_lora_into_transformer``), fused with diffusers' ``fuse_lora``, and the fused weights compared with the
delta our ``lora.apply`` merges. The linears' weights are zeroed, so a fused weight *is* the LoRA's delta.
The reverse: a LoRA trained on diffusers' transformer with PEFT and saved by diffusers is read by
``load_lora_state`` and gives diffusers' own fused delta.
"""
from __future__ import annotations

import copy
import logging
import warnings
from contextlib import contextmanager

import pytest
import torch
from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel, QwenImagePipeline, QwenImageTransformer2DModel
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict

from diffsynth_qie.lora.apply import apply_lora
from diffsynth_qie.lora.export_targets import EDIT, QWEN21
from diffsynth_qie.lora.formats import load_lora_state
from diffsynth_qie.lora.state import LoraModule, LoraState

PIPELINES = {EDIT: QwenImagePipeline, QWEN21: QwenImage21Pipeline}
ALPHA = 2.5  # not the rank: the export must fold it


def diffusers_dit(family: str) -> torch.nn.Module:
    """diffusers' transformer at the tiny DiT's sizes, its linear weights zeroed (biases kept)."""
    from diffsynth_qie.tiny.build import DIT_SIZES
    from diffsynth_qie.tiny.qwen21 import DIT_KWARGS

    torch.manual_seed(0)
    if family == EDIT:
        s, patch = DIT_SIZES, 2
        model = QwenImageTransformer2DModel(
            patch_size=patch, in_channels=s["in_channels"], out_channels=s["in_channels"] // patch ** 2,
            num_layers=s["num_layers"], attention_head_dim=s["head_dim"], num_attention_heads=s["num_heads"],
            joint_attention_dim=s["text_dim"], axes_dims_rope=tuple(s["axes_dim"]))
    else:
        model = QwenImage21Transformer2DModel(**DIT_KWARGS)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.zeros_(module.weight)
    return model.eval()


@pytest.fixture(scope="module")
def dits():
    return {family: diffusers_dit(family) for family in (EDIT, QWEN21)}


def linears(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    return {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def lora_on(names: dict[str, tuple[int, int]], alpha: float | None = ALPHA, seed: int = 0) -> LoraState:
    """A LoRA on ``names`` (module -> (out, in)): ranks 4 and 2 mixed, ``alpha`` on every module."""
    g = torch.Generator().manual_seed(seed)
    return LoraState(modules={n: LoraModule(A=torch.randn(r, i, generator=g) * 0.1, B=torch.randn(o, r, generator=g) * 0.1,
                                            alpha=alpha)
                              for k, (n, (o, i)) in enumerate(sorted(names.items())) for r in [2 if k % 3 == 0 else 4]})


@contextmanager
def diffusers_warnings():
    """diffusers' logged warnings (its loggers do not propagate) and Python warnings about keys."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, root = Keep(level=logging.WARNING), logging.getLogger("diffusers")
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield records
        records += [str(w.message) for w in caught if "key" in str(w.message).lower()]
    finally:
        root.removeHandler(handler)


def diffusers_fused(path, base: torch.nn.Module, family: str) -> tuple[dict[str, torch.Tensor], int, list[str]]:
    """``load_lora_weights``' steps on a copy of ``base``, then ``fuse_lora``: the fused weights by module, the
    number of LoRA layers diffusers made, and the warnings it gave."""
    pipeline, model = PIPELINES[family], copy.deepcopy(base)
    with diffusers_warnings() as said:
        state_dict, metadata = pipeline.lora_state_dict(str(path), return_lora_metadata=True)
        assert all("lora" in k for k in state_dict), "load_lora_weights: Invalid LoRA checkpoint"
        pipeline.load_lora_into_transformer(state_dict, transformer=model, adapter_name="ours", metadata=metadata)
        layers = sum(isinstance(m, BaseTunerLayer) and "ours" in m.lora_A for m in model.modules())
        model.fuse_lora(adapter_names=["ours"])
    weights = {n.replace(".base_layer", "")[: -len(".weight")]: p.detach()
               for n, p in model.named_parameters() if n.endswith(".weight") and "lora_" not in n}
    return weights, layers, said


def our_deltas(base: torch.nn.Module, state: LoraState) -> dict[str, torch.Tensor]:
    """The weights after our ``apply_lora`` on a copy of ``base`` (zero weights: the deltas)."""
    model = copy.deepcopy(base)
    report = apply_lora(model, state)
    modules = dict(model.named_modules())
    return {n: modules[n].weight.detach() for n in report.lora_modules}


def max_rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[n].double() - w.double()).norm() / w.double().norm()) for n, w in want.items())


def test_the_tiny_dits_have_diffusers_module_names(dits):
    """The premise: DiffSynth's tiny DiTs and diffusers' transformers name and size every linear alike."""
    from diffsynth_qie.tiny.build import tiny_dit
    from diffsynth_qie.tiny.qwen21 import tiny_dit as tiny_dit21

    assert linears(tiny_dit()) == linears(dits[EDIT])
    assert linears(tiny_dit21()) == linears(dits[QWEN21])


@pytest.mark.parametrize("family", [EDIT, QWEN21])
def test_the_diffusers_export_loads_fully_in_diffusers(dits, tmp_path, family):
    """qie export-lora --format diffusers of a LoRA on every linear (mixed ranks, alpha 2.5): diffusers makes a
    LoRA layer for each module, warns about no key, and fuses exactly our delta."""
    from diffsynth_qie.cli import main
    from diffsynth_qie.lora.export import save_lora

    state = lora_on(linears(dits[family]))
    src = save_lora(tmp_path / "lora.safetensors", state)
    out = tmp_path / "lora_diffusers.safetensors"
    assert main(["export-lora", str(src), str(out), "--format", "diffusers"]) == 0
    fused, layers, said = diffusers_fused(out, dits[family], family)
    assert said == [] and layers == len(state.modules)
    assert max_rel_error(fused, our_deltas(dits[family], load_lora_state(src))) < 1e-6


@pytest.mark.parametrize("family", [EDIT, QWEN21])
@pytest.mark.parametrize("fmt", ["ours", "ours, no alpha", "comfyui", "kohya", "diffusers"])
def test_what_inspect_calls_as_is_for_diffusers_loads_fully(dits, tmp_path, family, fmt):
    """Each file ``qie inspect-lora`` says diffusers loads as-is does load fully and exactly, and each it does not
    is one diffusers really mangles (ours without alpha: bare keys it does not take; 2.1 kohya:
    img_mlp_gate_layer read as gate.layer). Our ComfyUI export loads fully in both families."""
    from diffsynth_qie.lora.export import export_lora, save_lora
    from diffsynth_qie.lora.inspect import describe

    names = linears(dits[family])
    if fmt == "kohya":  # musubi's modules: those inside the blocks
        names = {n: s for n, s in names.items() if n.startswith("transformer_blocks.")}
    state = lora_on(names, alpha=None if fmt == "ours, no alpha" else ALPHA)
    out = save_lora(tmp_path / "lora.safetensors", state)
    if not fmt.startswith("ours"):
        out = export_lora(out, tmp_path / f"lora_{fmt}.safetensors", fmt)
    row = next(r for r in describe(out)["runtimes"] if r["format"] == "diffusers")
    fused, layers, said = diffusers_fused(out, dits[family], family)
    loads = said == [] and layers == len(state.modules) and max_rel_error(fused, our_deltas(dits[family], state)) < 1e-6
    assert row["status"] in ("as-is", "export")
    assert loads == (row["status"] == "as-is"), (row, said, layers)
    if fmt in ("diffusers", "comfyui", "ours") or family == EDIT:
        assert loads == (fmt != "ours, no alpha")


@pytest.mark.parametrize("family", [EDIT, QWEN21])
@pytest.mark.parametrize("config", ["plain", "patterns_rslora"])
def test_a_lora_saved_by_diffusers_reads_back_with_its_delta(dits, tmp_path, family, config):
    """PEFT adapter on diffusers' transformer, saved with ``save_lora_weights`` (alpha only in the metadata):
    ``load_lora_state`` gives the delta diffusers itself fuses; ``qie inspect-lora`` sends it to ComfyUI through
    ``--format comfyui`` (ComfyUI reads no metadata)."""
    from diffsynth_qie.lora.inspect import describe

    model = copy.deepcopy(dits[family])
    names = sorted(linears(model))
    options = dict(r=4, lora_alpha=10, target_modules=names, init_lora_weights="gaussian")
    if config == "patterns_rslora":
        block_module = next(n for n in names if n.endswith("attn.to_q"))
        options.update(rank_pattern={block_module: 2, "proj_out": 8}, alpha_pattern={"proj_out": 3},
                       use_rslora=True)
    model.add_adapter(LoraConfig(**options), adapter_name="default")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:  # PEFT starts lora_B at zero
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    PIPELINES[family].save_lora_weights(tmp_path, transformer_lora_layers=get_peft_model_state_dict(model),
                                        transformer_lora_adapter_metadata=model.peft_config["default"].to_dict())
    state = load_lora_state(tmp_path / "pytorch_lora_weights.safetensors")
    assert state.format == "diffusers" and set(state.modules) == set(names)
    rows = {r["format"]: r for r in describe(tmp_path / "pytorch_lora_weights.safetensors")["runtimes"]}
    assert rows["diffusers"]["status"] == "as-is"  # ComfyUI ignores the metadata alpha (10 / 4): export
    assert rows["comfyui"]["status"] == "export" and "only in the file's metadata" in rows["comfyui"]["why"]
    if config == "patterns_rslora":
        assert state.modules["proj_out"].rank == 8 and state.modules[block_module].rank == 2
    model.fuse_lora(adapter_names=["default"])
    theirs = {n.replace(".base_layer", "")[: -len(".weight")]: p.detach()
              for n, p in model.named_parameters() if n.endswith(".weight") and "lora_" not in n}
    assert max_rel_error(theirs, our_deltas(dits[family], state)) < 1e-6
