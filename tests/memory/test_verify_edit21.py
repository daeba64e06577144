"""A Qwen-Image-2.1 edit on the fake CUDA device through the one ``verify_edit``: the real 2.1 DiT, Qwen3-VL's
language model and the 2.1 VAE, the prefix KV cache (one per prompt, two with CFG), and ``qie edit --model 2.1``'s
preflight with its memory verdict. The check must catch the host timesteps of the first 2.1 release at
``models/qwen_image_21/qwen21.py``."""
from __future__ import annotations

import logging
import re

import pytest
from PIL import Image

from edit_planting import plant, qwen21_verified

GiB = 1024 ** 3
log = logging.getLogger(__name__)


@pytest.fixture
def preset21():
    from diffsynth_qie.models.presets import get_preset

    with qwen21_verified():
        yield get_preset("2.1")


def request21(size=512, refs=1, cfg=1.0, steps=2, **fields):
    from diffsynth_qie.inference.editor import EditRequest

    return EditRequest(images=[Image.new("RGB", (size, size))] * refs, prompt="edit", steps=steps, cfg=cfg,
                       height=size, width=size, max_prompt_tokens=None, **fields)


def prefix_tokens(size: int, refs: int, prompt_tokens: int) -> int:
    """The prefix of a 2.1 prompt: its text tokens and, per reference slot, 4 latents (2x2)."""
    from diffsynth_qie.fakegpu.standin21 import slot_mask21

    pad = slot_mask21([(size // 16, size // 16)] * refs, prompt_tokens)
    return int((~pad).sum()) + 4 * int(pad.sum())


def test_a_21_edit_keeps_one_prefix_kv_cache_per_prompt(preset21):
    from diffsynth_qie.preflight.edit_step import EditLoad, verify_edit
    from diffsynth_qie.memory.census import preset_census

    load = EditLoad(lora_ranks=(32,))
    one = verify_edit(preset21, num_layers=2, request=request21(refs=2), load=load, prompt_tokens=300)
    two = verify_edit(preset21, num_layers=2, request=request21(refs=2, cfg=4.0), load=load, prompt_tokens=300)
    per_token = 2 * 2 * 4096 * 2  # keys and values of 2 blocks at the DiT's width in bf16
    assert one.kv_cache == prefix_tokens(512, 2, 300) * per_token  # the whole prefix, nothing of the target
    assert two.kv_cache - one.kv_cache == prefix_tokens(512, 2, 0) * per_token  # the negative: no prompt text
    census = preset_census("2.1")  # the text encoder and VAE are real, built on the fake device
    encoders = (census.text_encoder_params + census.vae_params) * 2
    assert encoders < one.weights < encoders + 2 * one.block_bytes + 1.5 * GiB
    assert one.denoise_peak > one.weights + one.kv_cache and one.lora_branches > 0


def test_the_check_catches_the_samplers_host_timesteps_at_our_line(preset21, monkeypatch):
    import diffsynth_qie.models.qwen_image_21.qwen21 as qwen21
    from diffsynth_qie.preflight.edit import preflight

    plant(monkeypatch, qwen21, "forward21", "timesteps.reshape(-1)[group].to(device=x.device, dtype=dtype)",
          "timesteps.reshape(-1)[group].to(dtype=dtype)")
    with pytest.raises(ValueError, match=r"preflight .*device mismatch in aten\.\w+.* at "
                                         r"diffsynth_qie/models/qwen_image_21/qwen21\.py:\d+ \((forward21|velocity)\)"):
        preflight("2.1", request21(steps=40, mask=Image.new("L", (512, 512), 255)))


def test_qie_edit_model_21_preflight_judges_the_scaled_peak(preset21, tmp_path, capfd):
    from diffsynth_qie.cli import main

    image = tmp_path / "in.png"
    Image.new("RGB", (1024, 1024)).save(image)
    argv = ["edit", "--model", "2.1", "--image", str(image), "--prompt", "make the sky pink",
            "--out", str(tmp_path / "out.png"), "--gpu_memory_gb", "16"]
    assert main(argv) != 0
    text = "".join(capfd.readouterr())
    assert re.search(r"fake-device peak [\d.]+ GiB \(2 of 32 blocks run, scaled to 32\): the peak [\d.]+ GiB "
                     r"exceeds the GPU's 16.00 GiB", text), text


def test_a_21_lbm_edit_runs_both_streams_through_the_prefix(preset21):
    """``--lbm_steps`` on 2.1: the main and the white-prior stream as one batch of the repeated conditioning,
    which share one prefix KV cache (the same prompt and references), and the white image's VAE encoding."""
    from diffsynth_qie.preflight.edit_step import EditLoad, verify_edit

    load = EditLoad(lora_ranks=(32,))
    flow = verify_edit(preset21, num_layers=2, request=request21(steps=1), load=load, prompt_tokens=300)
    lbm = verify_edit(preset21, num_layers=2, request=request21(lbm_steps=1), load=load, prompt_tokens=300)
    assert lbm.kv_cache == flow.kv_cache > 0  # one prefix cache for both streams
    assert lbm.denoise_peak > flow.denoise_peak
