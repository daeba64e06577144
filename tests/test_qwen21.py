"""Qwen-Image-2.1 as a second model family: the tiny 2.1 on DiffSynth's real classes and loader, the family
seam, and editing (parity with DiffSynth's own pipeline, the prefix KV cache, the Turbo grid)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image


@pytest.fixture(scope="module")
def pipe21(tiny21_dir):
    from diffsynth_qie.models.load.loading import load_pipeline

    return load_pipeline("tiny-2.1", model_dir=tiny21_dir, device="cpu", torch_dtype=torch.float32)


def _image(w: int, h: int, colour) -> Image.Image:
    im = Image.new("RGB", (w, h), (240, 240, 240))
    im.paste(Image.new("RGB", (w // 2, h // 2), colour), (w // 4, h // 4))
    return im


# --- the tiny 2.1 on DiffSynth's own path ----------------------------------------------------------------
def test_tiny21_is_detected_by_diffsynths_hashes_and_loads_its_real_classes(tiny21_dir, pipe21):
    from diffsynth.core.loader import hash_model_file
    from diffsynth.models.qwen_image_21_dit import QwenImage21DiT
    from diffsynth.models.qwen_image_21_text_encoder import QwenImage21TextEncoder
    from diffsynth.models.qwen_image_21_vae import QwenImage21VAE
    from diffsynth.pipelines.qwen_image_21 import QwenImage21Pipeline

    from diffsynth_qie.tiny import qwen21

    names = {c["model_name"]: c["model_hash"] for c in qwen21.tiny21_model_configs()}
    for name, rel in (("qwen_image_21_dit", qwen21.DIT_FILE), ("qwen_image_21_text_encoder", qwen21.TEXT_ENCODER_FILE),
                      ("qwen_image_21_vae", qwen21.VAE_FILE)):
        assert hash_model_file(str(tiny21_dir / rel)) == names[name]
    assert isinstance(pipe21, QwenImage21Pipeline) and type(pipe21.dit) is QwenImage21DiT
    assert type(pipe21.vae) is QwenImage21VAE and isinstance(pipe21.text_encoder, QwenImage21TextEncoder)
    assert pipe21.qie_preset.name == "tiny-2.1" and len(pipe21.dit.transformer_blocks) == 2
    assert qwen21.is_complete21(tiny21_dir, seed=0) and not qwen21.is_complete21(tiny21_dir, seed=1)


def test_the_family_seam_answers_per_preset():
    from diffsynth_qie.models.family import QWEN21
    from diffsynth_qie.models.presets import family_of
    from diffsynth_qie.models.presets import TURBO_SIGMAS, get_preset

    assert {p: family_of(p).name for p in ("edit", "2509", "2511", "tiny")} == dict.fromkeys(
        ("edit", "2509", "2511", "tiny"), "qwen-image-edit")
    assert {p: family_of(p) for p in ("2.1", "2.1-turbo", "tiny-2.1")} == dict.fromkeys(("2.1", "2.1-turbo", "tiny-2.1"),
                                                                                       QWEN21)
    assert get_preset("qwen/qwen-image-2.1").name == "2.1" and get_preset("2.1-turbo").sigmas == TURBO_SIGMAS
    assert "non-commercial" in get_preset("2.1").licence and get_preset("2511").licence == "Apache-2.0"
    assert QWEN21.latent_size(1024, 768) == (64, 48) and QWEN21.image_tokens(1024, 768) == 64 * 48


def test_the_21_lora_targets_name_linears_of_every_block(pipe21):
    from diffsynth_qie.models.family import QWEN21

    linears = [n for n, m in pipe21.dit.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in QWEN21.lora_targets:
        hits = [n for n in linears if n.endswith("." + target)]
        assert len(hits) == len(pipe21.dit.transformer_blocks), (target, hits)


def test_a_missing_21_model_names_the_files_and_the_command(tmp_path):
    from diffsynth_qie.models.load.loading import resolve_model_configs

    with pytest.raises(FileNotFoundError) as e:
        resolve_model_configs("2.1", model_dir=tmp_path)
    message = str(e.value)
    assert "processor: " in message and "tokenizer" not in message  # 2.1's processor holds its tokenizer
    assert "modelscope download --model Qwen/Qwen-Image-2.1" in message


# --- editing -------------------------------------------------------------------------------------------------
def _stock_latents(pipe, **kwargs) -> torch.Tensor:
    """The latents ``QwenImage21Pipeline.__call__`` decodes (captured at the VAE)."""
    seen = {}
    decode = pipe.vae.decode

    def grab(z, **kw):
        seen["z"] = z.detach().clone()
        return decode(z, **kw)

    pipe.vae.decode = grab
    try:
        pipe(**kwargs)
    finally:
        pipe.vae.decode = decode
    return seen["z"]


@pytest.mark.parametrize("cfg, refs", [(1.0, 1), (3.0, 2)])
def test_editor_matches_diffsynths_21_pipeline(pipe21, cfg, refs):
    from diffsynth_qie.inference import EditRequest, Editor

    images = [_image(64, 96, (200, 30, 30)), _image(96, 64, (30, 30, 200))][:refs]
    prompt = "make the red square blue"
    result = Editor(pipe21).edit(EditRequest(images=images, prompt=prompt, steps=4, seed=7, cfg=cfg))
    assert (result.width, result.height) == (64, 96)  # fitted to the first image, multiples of 32
    stock = _stock_latents(pipe21, prompt=prompt, negative_prompt=" ", edit_image=images, height=96, width=64,
                           num_inference_steps=4, seed=7, cfg_scale=cfg)
    assert result.latents.shape == stock.shape == (1, 64, 6, 4)
    assert (result.latents - stock).abs().max() <= 1e-5 * stock.abs().max()


def test_the_prefix_kv_cache_gives_the_same_latents_and_skips_the_prefix(pipe21):
    """With the cache the prefix (prompt + reference tokens) goes through the blocks on the first step only."""
    from diffsynth_qie.models.qwen_image_21 import qwen21
    from diffsynth_qie.models.family_ops import ops_for
    from diffsynth_qie.models.samplers.sampling import sample_flow_match, seeded_noise
    from diffsynth_qie.models.samplers.schedules import ScheduleSpec

    refs = qwen21.reference_images21(pipe21, [_image(64, 64, (200, 30, 30))], 64, 64)
    ref_latents = [qwen21.encode_image21(pipe21, im) for im in refs]
    prompt = qwen21.encode_prompt21(pipe21, "make it blue", refs, ref_latents)
    noise = seeded_noise((1, 64, 4, 4), 0, torch.float32)
    tokens, results = {}, {}
    for use_cache in (False, True):
        seen = []
        hook = pipe21.dit.transformer_blocks[0].register_forward_hook(
            lambda m, a, kw, out: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True)
        try:
            cond = qwen21.Cond21(prompts=[prompt], ref_latents=[ref_latents], kv_cache=use_cache)
            results[use_cache] = sample_flow_match(qwen21.velocity21(pipe21.dit, cond), noise, ScheduleSpec(5, (4, 4)),
                                                   ops_for("qwen-image-2.1").schedule)
        finally:
            hook.remove()
        tokens[use_cache] = seen
    full, cached = tokens[False], tokens[True]
    target = 4 * 4
    prefix = full[0] - target
    assert prefix == prompt.emb.shape[0] - int(prompt.pad_mask.sum()) + sum(z[0].numel() for z in ref_latents)
    assert full == [prefix + target] * 5 and cached == [prefix + target] + [target] * 4
    assert (results[True] - results[False]).abs().max() <= 1e-5 * results[False].abs().max()


def test_turbo_samples_on_its_fixed_grid(pipe21, monkeypatch):
    from diffsynth_qie.inference import EditRequest, Editor
    from diffsynth_qie.models.presets import TURBO_SIGMAS
    from diffsynth_qie.models.qwen_image_21 import qwen21_ops

    turbo = dataclasses.replace(pipe21.qie_preset, sigmas=TURBO_SIGMAS)
    monkeypatch.setattr(pipe21, "qie_preset", turbo)
    used = []
    real = qwen21_ops.flow_match_scheduler  # what the family's schedule(spec) builds with
    monkeypatch.setattr(qwen21_ops, "flow_match_scheduler", lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    editor = Editor(pipe21)
    assert editor.default_steps() == 8
    editor.edit(EditRequest(images=[_image(64, 64, (200, 30, 30))], prompt="make it blue", seed=0))
    assert torch.allclose(used[0].sigmas.float(), torch.tensor(TURBO_SIGMAS)) and len(used[0].timesteps) == 8
    with pytest.raises(ValueError, match="fixed grid of 8 steps; pass --steps 8"):
        editor.edit(EditRequest(images=[_image(64, 64, (200, 30, 30))], prompt="make it blue", steps=20))


@pytest.mark.parametrize("request_kwargs, message", [
    ({"width": 48, "height": 64}, "width=48 must be a positive multiple of 32"),
    ({"scheduler": "lightning"}, "Lightning LoRAs; Qwen-Image-2.1 samples with its own schedule"),
])
def test_what_21_cannot_do_is_refused_by_name(pipe21, request_kwargs, message):
    from diffsynth_qie.inference import EditRequest, Editor

    with pytest.raises(ValueError, match=message):
        Editor(pipe21).edit(EditRequest(images=[_image(64, 64, (200, 30, 30))], prompt="x", steps=2, **request_kwargs))


def test_qie_edit_and_make_tiny_run_the_21_model(tiny21_dir, tmp_path, capsys):
    from diffsynth_qie.cli import main

    _image(64, 64, (200, 30, 30)).save(tmp_path / "in.png")
    out = tmp_path / "out.png"
    assert main(["edit", "--model", "tiny-2.1", "--model_dir", str(tiny21_dir), "--image", str(tmp_path / "in.png"),
                 "--prompt", "make it blue", "--out", str(out), "--steps", "2", "--device", "cpu"]) == 0
    assert Image.open(out).size == (64, 64) and "2 steps, cfg 1" in capsys.readouterr().err
    assert main(["make-tiny", "--model", "tiny-2.1", "--out", str(tmp_path / "m")]) == 0
    from diffsynth_qie.tiny.qwen21 import is_complete21

    assert is_complete21(tmp_path / "m", seed=0)


def test_the_web_ui_edits_with_the_21_model_and_keeps_the_unmasked_pixels(tiny21_dir, tmp_path):
    import numpy as np

    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.handlers import GenerateInputs, UIHandlers

    handlers = UIHandlers(UIConfig(model="tiny-2.1", model_dir=str(tiny21_dir), device="cpu", lora_dir=str(tmp_path),
                                    outputs_dir=str(tmp_path / "ui-edits")))
    image = np.full((64, 96, 3), 230, np.uint8)
    image[16:48, 24:72, 0] = 200
    layer = np.zeros((64, 96, 4), np.uint8)
    layer[16:48, 24:72] = 255
    out = handlers.generate(GenerateInputs(editor={"background": image, "layers": [layer], "composite": image},
                                           prompt="make it blue", steps=3, cfg=1.0))
    result = np.asarray(out.result.image)
    assert result.shape == image.shape and "3 steps, CFG 1" in out.status
    outside = np.ones(image.shape[:2], bool)
    outside[16:48, 24:72] = False
    assert (result[outside] == image[outside]).all() and (result[~outside] != image[~outside]).any()
