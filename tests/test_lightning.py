"""Lightning few-step editing: the schedule they were distilled with, their LoRA key format,
`qie edit --scheduler`, CFG 1, stacking with a user's LoRA, and the UI's Lightning sampler."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from diffsynth_qie.models.samplers.lightning import (is_lightning_lora, lightning_scheduler, lightning_steps,
                                            sampling_plan)
from diffsynth_qie.lora.apply import apply_lora
from diffsynth_qie.lora.formats import load_lora_state
from diffsynth_qie.models.family_ops import ops_for
from diffsynth_qie.models.samplers.sampling import sample_flow_match
from diffsynth_qie.models.samplers.schedules import ScheduleSpec, flow_match_scheduler

# The scheduler configuration of ModelTC/Qwen-Image-Lightning's generate_with_diffusers.py
# (github.com/ModelTC/Qwen-Image-Lightning, the README's "Run Evaluation and Test with Diffusers"
# section runs 4 and 8 steps with --cfg 1.0), copied as published.
PUBLISHED_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": math.log(3),  # "We use shift=3 in distillation"
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": math.log(3),
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": None,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}


def diffusers_reference(config: dict, steps: int, image_seq_len: int) -> tuple[list[float], list[float]]:
    """What diffusers' FlowMatchEulerDiscreteScheduler does with ``config`` in the Qwen-Image
    pipelines: sigmas = linspace(1, 1/N, N), mu = calculate_shift(seq_len), exponential
    time shift exp(mu) / (exp(mu) + (1/t - 1)^1), no terminal stretch, timesteps = 1000 σ."""
    assert config["use_dynamic_shifting"] and config["time_shift_type"] == "exponential"
    assert config["shift_terminal"] is None and not config["invert_sigmas"]
    m = (config["max_shift"] - config["base_shift"]) / (config["max_image_seq_len"] - config["base_image_seq_len"])
    mu = image_seq_len * m + config["base_shift"] - m * config["base_image_seq_len"]
    ts = np.linspace(1.0, 1.0 / steps, steps)
    sigmas = [math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0) for t in ts]
    return sigmas, [s * config["num_train_timesteps"] for s in sigmas]


@pytest.mark.parametrize("steps", [4, 8])
@pytest.mark.parametrize("latent_hw", [(8, 8), (128, 96)])
def test_schedule_matches_the_published_configuration(steps, latent_hw):
    seq_len = (latent_hw[0] * 8 // 16) * (latent_hw[1] * 8 // 16)
    want_sigmas, want_timesteps = diffusers_reference(PUBLISHED_CONFIG, steps, seq_len)
    scheduler = lightning_scheduler(steps, *latent_hw)
    assert len(scheduler.sigmas) == steps
    np.testing.assert_allclose(scheduler.sigmas.double().numpy(), want_sigmas, rtol=0, atol=1e-6)
    np.testing.assert_allclose(scheduler.timesteps.double().numpy(), want_timesteps, rtol=0, atol=1e-3)
    # Not the default Qwen-Image schedule (resolution-dependent shift + terminal stretch).
    default = flow_match_scheduler(steps, (latent_hw[0] // 2) * (latent_hw[1] // 2))
    assert float((default.sigmas - scheduler.sigmas).abs().max()) > 1e-2


def test_sampler_visits_the_lightning_timesteps():
    seen = []

    def velocity(x, t):
        seen.append(t.clone())
        return torch.ones_like(x)

    noise = torch.zeros(2, 16, 8, 8)
    edit = ops_for("qwen-image-edit")
    out = sample_flow_match(velocity, noise, ScheduleSpec(4, (8, 8), "lightning"), edit.schedule)
    _, want = diffusers_reference(PUBLISHED_CONFIG, 4, 16)
    assert [t.shape for t in seen] == [torch.Size([2])] * 4  # per-sample timesteps
    np.testing.assert_allclose([float(t[0]) for t in seen], want, atol=1e-3)
    # v = 1 integrated from σ = 1 to σ = 0 moves x by -1 whatever the schedule.
    assert torch.allclose(out, torch.full_like(out, -1.0), atol=1e-6)
    with pytest.raises(ValueError, match="scheduler 'turbo'"):
        sample_flow_match(velocity, noise, ScheduleSpec(4, (8, 8), "turbo"), edit.schedule)


# The 12 linear layers per block the lightx2v Lightning files patch (720 modules for the
# 60-block DiT), with kohya-style factor names, a per-module .alpha and, in some files, a
# diffusion_model. prefix; the format diffusers' _convert_non_diffusers_qwen_lora_to_diffusers reads.
LIGHTNING_MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj",
                     "attn.add_v_proj", "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj",
                     "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")


def write_lightning_lora(path, dit_state: dict, prefix: str = "", rank: int = 8, alpha: float = 1.0,
                         seed: int = 0, dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    blocks = sorted({int(k.split(".")[1]) for k in dit_state if k.startswith("transformer_blocks.")})
    for i in blocks:
        for module in LIGHTNING_MODULES:
            out_f, in_f = dit_state[f"transformer_blocks.{i}.{module}.weight"].shape
            base = f"{prefix}transformer_blocks.{i}.{module}"
            tensors[f"{base}.lora_down.weight"] = (torch.randn(rank, in_f, generator=g) * 0.1).to(dtype)
            tensors[f"{base}.lora_up.weight"] = (torch.randn(out_f, rank, generator=g) * 0.1).to(dtype)
            tensors[f"{base}.alpha"] = torch.tensor(alpha, dtype=dtype)
    save_file(tensors, str(path))
    return tensors


@pytest.mark.parametrize("prefix", ["", "diffusion_model."])
def test_lightning_key_format_is_read_and_applied(tiny_model_dir, tiny_pipe, tmp_path, prefix):
    dit_state = load_file(str(tiny_model_dir / "transformer/diffusion_pytorch_model.safetensors"))
    path = tmp_path / "Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16.safetensors"
    rank, alpha = 8, 1.0
    tensors = write_lightning_lora(path, dit_state, prefix=prefix, rank=rank, alpha=alpha)
    state = load_lora_state(path)
    blocks = sorted({int(k.split(".")[1]) for k in dit_state if k.startswith("transformer_blocks.")})
    assert len(state.modules) == len(blocks) * len(LIGHTNING_MODULES)
    dit = tiny_pipe.dit
    reference = {k: v.clone() for k, v in dit.state_dict().items()}
    try:
        apply_lora(dit, state, 1.0)
        for i in blocks:
            for module in LIGHTNING_MODULES:
                base = f"{prefix}transformer_blocks.{i}.{module}"
                delta = (alpha / rank) * tensors[f"{base}.lora_up.weight"].float() @ \
                    tensors[f"{base}.lora_down.weight"].float()
                key = f"transformer_blocks.{i}.{module}.weight"
                assert torch.allclose(dit.state_dict()[key], reference[key] + delta, atol=1e-6), key
        untouched = f"transformer_blocks.{blocks[0]}.img_mod.1.weight"
        assert torch.equal(dit.state_dict()[untouched], reference[untouched])
    finally:
        dit.load_state_dict(reference)


def test_detection_steps_and_cfg(tmp_path, caplog):
    user = tmp_path / "my_style.safetensors"
    save_file({"a.lora_A.weight": torch.zeros(1, 2), "a.lora_B.weight": torch.zeros(2, 1)}, str(user))
    tagged = tmp_path / "distilled.safetensors"
    save_file({"a.lora_A.weight": torch.zeros(1, 2), "a.lora_B.weight": torch.zeros(2, 1)}, str(tagged),
              metadata={"name": "Qwen-Image-Edit-2511-Lightning"})
    named = tmp_path / "Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16.safetensors"
    named.write_bytes(user.read_bytes())
    assert not is_lightning_lora(user) and is_lightning_lora(tagged) and is_lightning_lora(named)
    assert lightning_steps([user, named]) == 4 and lightning_steps([tagged]) == 8
    assert sampling_plan("auto", None, None, [user]) == ("default", 40, 4.0)
    assert sampling_plan("auto", 12, 2.5, [user]) == ("default", 12, 2.5)
    with caplog.at_level(logging.INFO, logger="diffsynth_qie"):
        assert sampling_plan("auto", None, 4.0, [user, named]) == ("lightning", 4, 1.0)
    assert "using cfg 1 instead of 4" in caplog.text
    assert sampling_plan("lightning", None, None, [user]) == ("lightning", 8, 1.0)
    assert sampling_plan("default", None, None, [named]) == ("default", 40, 4.0)


def test_edit_command_stacks_user_and_lightning_lora(tiny_model_dir, tiny_pipe, tmp_path, caplog):
    import logging

    from diffsynth_qie.cli import main
    from diffsynth_qie.inference import EditRequest, Editor
    from diffsynth_qie.lora.export import save_lora
    from diffsynth_qie.lora.state import LoraModule, LoraState

    dit_state = load_file(str(tiny_model_dir / "transformer/diffusion_pytorch_model.safetensors"))
    lightning = tmp_path / "Qwen-Image-Edit-2511-Lightning-4steps-V1.0-bf16.safetensors"
    write_lightning_lora(lightning, dit_state, seed=1, dtype=torch.float32)
    w = dit_state["transformer_blocks.0.attn.to_q.weight"]
    g = torch.Generator().manual_seed(2)
    user = save_lora(tmp_path / "user.safetensors", LoraState(modules={"transformer_blocks.0.attn.to_q": LoraModule(
        A=torch.randn(2, w.shape[1], generator=g) * 0.1, B=torch.randn(w.shape[0], 2, generator=g) * 0.1)}))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    src = tmp_path / "src.png"
    image.save(src)
    out = tmp_path / "out.png"
    caplog.set_level(logging.INFO, logger="diffsynth_qie")
    ours = logging.getLogger("diffsynth_qie")
    ours.addHandler(caplog.handler)  # `qie` replaces the root logger's handlers on its first run in a process
    try:
        assert main(["edit", "--model", "tiny", "--model_dir", str(tiny_model_dir), "--image", str(src),
                     "--prompt", "make it red", "--lora", str(user), "--lora", str(lightning), "--cfg", "4",
                     "--out", str(out), "--device", "cpu", "--dtype", "fp32"]) == 0
    finally:
        ours.removeHandler(caplog.handler)
    logged = caplog.text
    assert "using the Lightning scheduler" in logged and "(4 steps, cfg 1)" in logged

    editor = Editor(tiny_pipe)
    try:
        request = dict(images=[Image.open(src)], prompt="make it red", steps=4, seed=0)
        editor.set_loras([(str(user), 1.0), (str(lightning), 1.0)])
        stacked = editor.edit(EditRequest(**request, cfg=1.0, scheduler="lightning"))
        forced = editor.edit(EditRequest(**request, cfg=4.0, scheduler="lightning"))  # CFG forced to 1
        assert torch.equal(stacked.latents, forced.latents)
        default = editor.edit(EditRequest(**request, cfg=1.0))
        assert float((default.latents - stacked.latents).norm() / stacked.latents.norm()) > 1e-3
        editor.set_loras([(str(lightning), 1.0)])
        alone = editor.edit(EditRequest(**request, cfg=1.0, scheduler="lightning"))
        assert float((alone.latents - stacked.latents).norm() / stacked.latents.norm()) > 1e-4
    finally:
        editor.set_loras([])
    written = np.asarray(Image.open(out).convert("RGB"), dtype=np.float32)
    assert np.abs(written - np.asarray(stacked.image, dtype=np.float32)).max() <= 1.0


def test_ui_lightning_sampler_stacks_and_refuses_without_lightning_lora(tmp_path):
    from diffsynth_qie.ui.handlers import lightning_loras
    from diffsynth_qie.ui.uploads import UIError

    user = tmp_path / "style.safetensors"
    light = tmp_path / "Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16.safetensors"
    for p in (user, light):
        save_file({"a.lora_A.weight": torch.zeros(1, 2), "a.lora_B.weight": torch.zeros(2, 1)}, str(p))
    loras, steps, cfg = lightning_loras([(user, 0.7)], str(light), 40)
    assert loras == [(user, 0.7), (light, 1.0)] and (steps, cfg) == (4, 1.0)
    assert lightning_loras([(user, 0.7)], str(light), 8)[1] == 8
    assert lightning_loras([(light, 1.0)], None, 40) == ([(light, 1.0)], 4, 1.0)
    with pytest.raises(UIError, match="needs a Lightning LoRA"):
        lightning_loras([(user, 1.0)], None, 8)
    with pytest.raises(UIError, match="not found"):
        lightning_loras([], str(tmp_path / "missing-Lightning.safetensors"), 8)
