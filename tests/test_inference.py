"""Inference: Editor (flow matching, CFG, masks, LBM, LoRA switching), samplers, `qie edit`.

Parity targets: our batched-CFG velocity equals DiffSynth's two-pass
``cfg_guided_model_fn`` (1e-4 relative, fp32), and a whole flow-matching edit equals
``QwenImagePipeline.__call__`` (``edit_image_auto_resize=False``, same seed). The match
is not bitwise because the positive and negative prompts have different lengths, so
our batch of 2 pads the shorter prompt and masks it in attention (a different
summation order than two unpadded batch-1 passes); the bound is 1e-4 relative.
Everything asserts on latents as well as pixels: the random tiny VAE squashes
pixel differences (docs/DIFFSYNTH_NOTES.md).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffsynth_qie.inference import EditRequest, Editor, parse_device_map
from diffsynth_qie.models.samplers import sampling as samplers
from diffsynth_qie.inference.masking import blend_pixels, latent_keep_weight
from diffsynth_qie.models.samplers.sampling import (Conditioning, bridge_interpolate, bridge_sigmas, bridge_step,
                                              bridge_target, predict_velocity, sample_bridge)

PROMPT = "make the red circle blue"
NEGATIVE = "blurry"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def smooth_image(w: int, h: int, seed: int) -> Image.Image:
    """A random low-frequency RGB image (upsampled noise)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(h // 8, 2), max(w // 8, 2), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.BILINEAR)


@pytest.fixture(scope="module")
def pipe(tiny_model_dir):
    """Our own fp32 tiny pipeline: tests here run DiffSynth's __call__ and merge LoRAs."""
    from diffsynth_qie.models.load.loading import load_pipeline

    return load_pipeline("tiny", model_dir=tiny_model_dir, device="cpu", torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def editor(pipe):
    return Editor(pipe)


@pytest.fixture(scope="module")
def img_a():
    return smooth_image(64, 64, 1)


@pytest.fixture(scope="module")
def img_b():
    return smooth_image(48, 32, 2)


# --- basic editing ------------------------------------------------------------------
def test_edit_one_reference_default_size_and_progress(editor):
    calls = []
    img = smooth_image(56, 72, 3)  # 56x72 fits the budget; trimmed to multiples of 16 -> 48x64
    result = editor.edit(EditRequest([img], PROMPT, steps=3, cfg=2.0, progress=lambda i, n: calls.append((i, n))))
    assert result.image.size == (48, 64) and (result.width, result.height) == (48, 64)
    assert result.sub_image is None
    assert result.latents.shape == (1, 16, 8, 6) and torch.isfinite(result.latents).all()
    assert calls == [(1, 3), (2, 3), (3, 3)]


def test_edit_two_references_requested_size(editor, img_a, img_b):
    result = editor.edit(EditRequest([img_a, img_b], PROMPT, steps=2, height=32, width=80))
    assert result.image.size == (80, 32)
    assert result.latents.shape == (1, 16, 4, 10)
    one = editor.edit(EditRequest([img_a], PROMPT, steps=2, height=32, width=80))
    assert rel_err(result.latents, one.latents) > 1e-3  # the second reference is seen


def test_budget_and_bad_sizes(editor, img_a):
    result = editor.edit(EditRequest([smooth_image(128, 64, 4)], PROMPT, steps=1, cfg=1.0, max_pixels=32 * 32))
    assert result.image.size[0] * result.image.size[1] <= 32 * 32 and result.image.size == (32, 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        editor.edit(EditRequest([img_a], PROMPT, steps=1, height=40, width=64))
    with pytest.raises(ValueError, match="both height and width"):
        editor.edit(EditRequest([img_a], PROMPT, steps=1, height=64))
    with pytest.raises(ValueError, match="at least one reference image"):
        editor.edit(EditRequest([], PROMPT))


def test_zero_cond_t_changes_latents(pipe, editor, img_a, img_b, monkeypatch):
    import dataclasses

    assert editor.zero_cond_t is False  # tiny preset default
    on = Editor(pipe, zero_cond_t=True)
    assert on.zero_cond_t is True
    with monkeypatch.context() as m:  # a preset with the flag on (like 2511) turns it on, an override wins
        m.setattr(pipe, "qie_preset", dataclasses.replace(pipe.qie_preset, zero_cond_t=True))
        assert Editor(pipe).zero_cond_t is True and Editor(pipe, zero_cond_t=False).zero_cond_t is False
    req = EditRequest([img_a, img_b], PROMPT, steps=2, cfg=1.0, seed=5)
    a, b = editor.edit(req).latents, on.edit(req).latents
    assert rel_err(a, b) > 1e-4


def test_cfg_scale_changes_latents_and_seed_is_deterministic(editor, img_a):
    base = EditRequest([img_a], PROMPT, negative_prompt=NEGATIVE, steps=2, cfg=1.0, seed=7)
    r1 = editor.edit(base)
    r4 = editor.edit(EditRequest([img_a], PROMPT, negative_prompt=NEGATIVE, steps=2, cfg=4.0, seed=7))
    assert rel_err(r1.latents, r4.latents) > 1e-3
    assert torch.equal(editor.edit(base).latents, r1.latents)
    other_seed = editor.edit(EditRequest([img_a], PROMPT, negative_prompt=NEGATIVE, steps=2, cfg=1.0, seed=8))
    assert rel_err(other_seed.latents, r1.latents) > 1e-2


# --- parity with DiffSynth ----------------------------------------------------------
@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_batched_cfg_matches_diffsynth_two_pass(pipe, img_a, img_b, zero_cond_t):
    from diffsynth.pipelines.qwen_image import model_fn_qwen_image
    from diffsynth_qie.models.qwen_image_edit.encoding import encode_image, encode_prompt

    refs = [img_a, img_b]
    pos = encode_prompt(pipe, PROMPT, refs, multi_image=True)
    neg = encode_prompt(pipe, "", refs, multi_image=True)
    assert pos.shape[0] != neg.shape[0]  # exercises padding + attention mask in the batch of 2
    edits = [encode_image(pipe, im) for im in refs]
    x = torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([812.5])
    cfg = 4.0
    cond = Conditioning([pos], [edits], [neg], zero_cond_t=zero_cond_t)
    with torch.no_grad():
        ours = predict_velocity(pipe.dit, x, t, cond, cfg)
        ref = pipe.cfg_guided_model_fn(
            model_fn_qwen_image, cfg,
            {"latents": x, "height": 48, "width": 64, "edit_latents": [e[None] for e in edits],
             "zero_cond_t": zero_cond_t},
            {"prompt_emb": pos[None], "prompt_emb_mask": torch.ones(1, pos.shape[0], dtype=torch.long)},
            {"prompt_emb": neg[None], "prompt_emb_mask": torch.ones(1, neg.shape[0], dtype=torch.long)},
            dit=pipe.dit, timestep=t,
        )
    assert ours.shape == ref.shape == x.shape
    assert rel_err(ours, ref) < 1e-4
    # and CFG really mixes two different predictions
    with torch.no_grad():
        only_pos = predict_velocity(pipe.dit, x, t, cond, 1.0)
    assert rel_err(only_pos, ref) > 1e-3


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_flow_matching_edit_matches_diffsynth_pipeline(pipe, img_a, img_b, zero_cond_t, monkeypatch):
    """Same prompt/negative/references/seed/steps: our latents equal QwenImagePipeline.__call__'s."""
    captured = {}
    decode = pipe.vae.decode

    def spy(latents, *args, **kwargs):
        captured["latents"] = latents.detach().clone()
        return decode(latents, *args, **kwargs)

    monkeypatch.setattr(pipe.vae, "decode", spy)
    kw = dict(height=48, width=64, seed=11, cfg=4.0, steps=3)
    theirs_img = pipe(PROMPT, negative_prompt=NEGATIVE, cfg_scale=kw["cfg"], height=kw["height"], width=kw["width"],
                      seed=kw["seed"], num_inference_steps=kw["steps"], edit_image=[img_a, img_b],
                      edit_image_auto_resize=False, zero_cond_t=zero_cond_t, progress_bar_cmd=lambda x: x)
    theirs = captured["latents"]
    ours = Editor(pipe, zero_cond_t=zero_cond_t).edit(
        EditRequest([img_a, img_b], PROMPT, negative_prompt=NEGATIVE, **kw))
    assert ours.latents.shape == theirs.shape == (1, 16, 6, 8)
    assert rel_err(ours.latents, theirs) < 1e-4
    diff = np.abs(np.asarray(ours.image, dtype=np.int16) - np.asarray(theirs_img, dtype=np.int16))
    assert diff.max() <= 1


# --- masks --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rect_mask():
    """64x64 mask: white (editable) rectangle x in [16, 40), y in [8, 48)."""
    arr = np.zeros((64, 64), dtype=np.uint8)
    arr[8:48, 16:40] = 255
    return Image.fromarray(arr, mode="L")


def test_mask_keeps_outside_pixels_and_latents_exactly(pipe, editor, img_a, rect_mask):
    from diffsynth_qie.models.qwen_image_edit.encoding import encode_image

    result = editor.edit(EditRequest([img_a], PROMPT, mask=rect_mask, steps=3, seed=1))
    out, src = np.asarray(result.image), np.asarray(img_a)
    outside = np.asarray(rect_mask) < 128
    # tolerance 0: with mask_blend=1 and no feather the pixel blend is hard
    assert np.array_equal(out[outside], src[outside])
    assert np.abs(out[~outside].astype(int) - src[~outside].astype(int)).mean() > 1.0  # the inside was edited
    # latents: every latent cell without a painted pixel ends exactly at the source latents
    keep = latent_keep_weight(rect_mask, (8, 8))[0, 0] == 1
    assert keep.sum() == 64 - 3 * 5  # cells x 2..4, y 1..5 are editable
    z_src = encode_image(pipe, img_a)
    assert torch.equal(result.latents[0][:, keep], z_src[:, keep])
    unmasked = editor.edit(EditRequest([img_a], PROMPT, steps=3, seed=1))
    assert rel_err(unmasked.latents[0][:, keep], z_src[:, keep]) > 1e-2  # without the mask they'd differ


def test_mask_blend_zero_is_the_plain_edit_and_feather_stays_inside(editor, img_a, rect_mask):
    plain = editor.edit(EditRequest([img_a], PROMPT, steps=2, seed=2))
    off = editor.edit(EditRequest([img_a], PROMPT, steps=2, seed=2, mask=rect_mask, mask_blend=0.0))
    assert torch.equal(plain.latents, off.latents)
    assert np.array_equal(np.asarray(plain.image), np.asarray(off.image))
    # an RGB mask at another resolution means the same; feathering changes only inside pixels
    big_rgb = rect_mask.resize((128, 128), Image.NEAREST).convert("RGB")
    hard = editor.edit(EditRequest([img_a], PROMPT, steps=2, seed=2, mask=big_rgb))
    soft = editor.edit(EditRequest([img_a], PROMPT, steps=2, seed=2, mask=rect_mask, mask_feather=2.0))
    assert torch.equal(hard.latents, soft.latents)
    outside = np.asarray(rect_mask) < 128
    src = np.asarray(img_a)
    assert np.array_equal(np.asarray(soft.image)[outside], src[outside])
    assert np.array_equal(np.asarray(hard.image)[outside], src[outside])
    assert not np.array_equal(np.asarray(soft.image), np.asarray(hard.image))


def test_mask_blend_math():
    dec = Image.fromarray(np.full((16, 16, 3), 200, np.uint8))
    src = Image.fromarray(np.full((16, 16, 3), 100, np.uint8))
    mask = Image.fromarray(np.pad(np.full((8, 8), 255, np.uint8), 4), mode="L")
    half = np.asarray(blend_pixels(dec, src, mask, strength=0.5))
    assert (half[4:12, 4:12] == 200).all() and (half[:4] == 150).all()  # inside decoded; outside the midpoint
    full = np.asarray(blend_pixels(dec, src, mask, strength=1.0))
    assert (full[:4] == 100).all() and (full[4:12, 4:12] == 200).all()
    # one painted pixel makes its whole 8x8 latent cell editable
    dot = np.zeros((16, 16), np.uint8)
    dot[9, 2] = 255
    w = latent_keep_weight(Image.fromarray(dot, mode="L"), (2, 2), strength=0.75)[0, 0]
    assert torch.equal(w, torch.tensor([[0.75, 0.75], [0.0, 0.75]]))
    with pytest.raises(ValueError, match="mask_blend"):
        blend_pixels(dec, src, mask, strength=1.5)


# --- bridge (LBM) math --------------------------------------------------------------
def test_bridge_sigmas_exact():
    assert bridge_sigmas(1).tolist() == [1.0]
    assert bridge_sigmas(2).tolist() == [1.0, 0.5]
    assert bridge_sigmas(4).tolist() == [1.0, 0.75, 0.5, 0.25]
    assert torch.allclose(bridge_sigmas(3), torch.tensor([1.0, 2 / 3, 1 / 3]))
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            bridge_sigmas(bad)


def test_bridge_interpolate_endpoints_and_target_sign():
    g = torch.Generator().manual_seed(0)
    z_t, z_p, eps = (torch.randn(2, 16, 4, 4, generator=g) for _ in range(3))
    assert torch.equal(bridge_interpolate(z_t, z_p, 1.0, 0.0, eps), z_p)
    assert torch.equal(bridge_interpolate(z_t, z_p, 0.0, 0.3, eps), z_t)  # no noise at the ends
    # per-sample sigma
    x = bridge_interpolate(z_t, z_p, torch.tensor([0.0, 1.0]))
    assert torch.equal(x[0], z_t[0]) and torch.equal(x[1], z_p[1])
    # v* = dx/dσ: a step of +h along σ moves by h·v*
    h = 0.25
    step = bridge_interpolate(z_t, z_p, 0.5 + h) - bridge_interpolate(z_t, z_p, 0.5)
    assert torch.allclose(step, h * bridge_target(z_t, z_p), atol=1e-6)
    assert torch.allclose(bridge_interpolate(z_t, z_p, 0.5, 0.1, eps), 0.5 * (z_t + z_p) + 0.05 * eps, atol=1e-6)


def test_bridge_step_and_sampler():
    g = torch.Generator().manual_seed(1)
    z_t, z_p, eps = (torch.randn(2, 16, 4, 4, generator=g) for _ in range(3))
    zero = lambda x, t: torch.zeros_like(x)  # noqa: E731
    # one step with zero velocity returns the prior (the last step injects no noise)
    assert torch.equal(sample_bridge(zero, z_p, 1, bridge_noise=0.005), z_p)
    # the exact velocity lands on the target in any number of steps (s = 0)
    exact = lambda x, t: bridge_target(z_t, z_p)  # noqa: E731
    for n in (1, 2, 4):
        assert torch.allclose(sample_bridge(exact, z_p, n, bridge_noise=0.0), z_t, atol=1e-5)
    # noise re-injection: s·sqrt(σ'(1−σ'))·ε
    assert torch.allclose(bridge_step(z_p, torch.zeros_like(z_p), 1.0, 0.5, 0.2, eps), z_p + 0.2 * 0.5 * eps)
    assert torch.equal(bridge_step(z_p, z_t, 0.25, 0.0, 0.2, eps), z_p - 0.25 * z_t)
    # timesteps seen by the model: 1000·σ_k, one per sample
    seen = []
    sample_bridge(lambda x, t: (seen.append(t.tolist()), torch.zeros_like(x))[1], z_p, 4, bridge_noise=0.0)
    assert seen == [[1000.0, 1000.0], [750.0, 750.0], [500.0, 500.0], [250.0, 250.0]]


def test_lbm_edit_returns_two_images_and_sub_stream_starts_at_white(pipe, editor, img_a, monkeypatch):
    from diffsynth_qie.models.qwen_image_edit.encoding import encode_image, white_latents

    calls = []
    original = samplers.predict_velocity

    def record(dit, x, timesteps, cond, cfg=1.0):
        v = original(dit, x, timesteps, cond, cfg)
        calls.append((x.clone(), timesteps.clone(), v.clone(), cfg))
        return v

    monkeypatch.setattr(samplers, "predict_velocity", record)
    result = editor.edit(EditRequest([img_a], PROMPT, lbm_steps=1, height=32, width=48, seed=3))
    assert result.image.size == result.sub_image.size == (48, 32)
    assert result.latents.shape == (2, 16, 4, 6)
    assert len(calls) == 1
    x, t, v, cfg = calls[0]
    assert cfg == 1.0 and t.tolist() == [1000.0, 1000.0]
    assert torch.equal(x[1], white_latents(pipe, 48, 32))             # sub-stream prior: exactly z_W
    assert torch.equal(x[0], encode_image(pipe, img_a.resize((48, 32), Image.LANCZOS)))  # main: z_S at target size
    assert torch.equal(result.latents, x - v)                            # one Euler step from σ=1 to 0
    assert rel_err(result.latents[0], result.latents[1]) > 1e-2
    calls.clear()
    editor.edit(EditRequest([img_a], PROMPT, lbm_steps=2, height=32, width=48))
    assert [c[1].tolist() for c in calls] == [[1000.0, 1000.0], [500.0, 500.0]]


# --- LoRA, devices ------------------------------------------------------------------
def test_lora_switch_without_reload(pipe, img_a, tmp_path):
    from diffsynth_qie.lora import save_lora

    g = torch.Generator().manual_seed(0)
    state = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 64, generator=g),
             "transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(64, 4, generator=g),
             "proj_out.lora_A.weight": torch.randn(4, 64, generator=g),
             "proj_out.lora_B.weight": torch.randn(64, 4, generator=g) * 0.1}
    path = save_lora(tmp_path / "l.safetensors", state)
    ed = Editor(pipe)
    req = EditRequest([img_a], PROMPT, steps=2, cfg=1.0, height=32, width=32)
    base = ed.edit(req).latents
    try:
        ed.set_loras([(path, 1.0)])
        assert ed.active_loras == [(path.resolve(), 1.0)]
        with_lora = ed.edit(req).latents
        ed.set_loras([(path, 0.5)])
        half = ed.edit(req).latents
    finally:
        ed.set_loras([])
    assert rel_err(with_lora, base) > 1e-3 and rel_err(half, with_lora) > 1e-4
    assert torch.equal(ed.edit(req).latents, base)  # base weights restored bit-exactly
    with pytest.raises(ValueError, match="missing.safetensors"):
        ed.set_loras([(tmp_path / "missing.safetensors", 1.0)])


def test_device_map_parsing_and_offload_path(pipe, img_a):
    assert parse_device_map("text_encoder=cpu, dit=cpu,vae=cpu") == {"text_encoder": "cpu", "dit": "cpu", "vae": "cpu"}
    assert parse_device_map({"dit": "cpu"}) == {"dit": "cpu"} and parse_device_map(None) == {}
    with pytest.raises(ValueError, match="unknown component 'unet'"):
        parse_device_map("unet=cpu")
    with pytest.raises(ValueError, match="component=device"):
        parse_device_map("dit")
    with pytest.raises(ValueError, match="cuda:7"):
        parse_device_map("dit=cuda:7")
    req = EditRequest([img_a], PROMPT, steps=2, height=32, width=32)
    base = Editor(pipe).edit(req).latents
    mapped = Editor(pipe, device_map="text_encoder=cpu,dit=cpu,vae=cpu", cpu_offload=True).edit(req).latents
    assert torch.equal(base, mapped)


# --- CLI ----------------------------------------------------------------------------
def _save(img: Image.Image, path):
    img.save(path)
    return str(path)


def _parse(argv):
    from diffsynth_qie.cli import build_parser

    return build_parser().parse_args(argv)


def test_cli_errors_name_the_path_before_loading(tmp_path, img_a):
    good = _save(img_a, tmp_path / "a.png")
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    # --model_dir does not exist: had the model loaded first, the error would name it instead
    base = ["edit", "--model", "tiny", "--model_dir", str(tmp_path / "no-model"), "--prompt", "p",
            "--out", str(tmp_path / "o.png")]
    cases = [
        (["--image", str(tmp_path / "missing.png")], FileNotFoundError, "missing.png"),
        (["--image", good, "--image", str(corrupt)], ValueError, "corrupt.png"),
        (["--image", good, "--mask", str(corrupt)], ValueError, "corrupt.png"),
        (["--image", good, "--lora", str(tmp_path / "nolora.safetensors")], FileNotFoundError, "nolora.safetensors"),
        (["--image", good, "--lora", good, "--lora_scale", "1", "--lora_scale", "2"], ValueError, "--lora_scale"),
    ]
    for extra, exc, needle in cases:
        args = _parse(base + extra)
        with pytest.raises(exc, match=needle):
            args._run(args)


def test_cli_edit_end_to_end_matches_editor(tiny_model_dir, editor, tmp_path, img_a, img_b, rect_mask):
    from diffsynth_qie.cli import main

    a, b = _save(img_a, tmp_path / "a.png"), _save(img_b, tmp_path / "b.png")
    m = _save(rect_mask, tmp_path / "m.png")
    out = tmp_path / "out" / "edited.png"
    common = ["edit", "--model", "tiny", "--model_dir", str(tiny_model_dir), "--device", "cpu",
              "--image", a, "--image", b, "--prompt", PROMPT, "--seed", "4"]
    assert main(common + ["--steps", "2", "--cfg", "3", "--mask", m, "--out", str(out)]) == 0
    written = np.asarray(Image.open(out))
    expected = editor.edit(EditRequest([img_a, img_b], PROMPT, mask=rect_mask, steps=2, cfg=3.0, seed=4))
    assert np.array_equal(written, np.asarray(expected.image))
    assert not (tmp_path / "out" / "edited_sub.png").exists()

    lbm_out = tmp_path / "lbm.png"
    assert main(common + ["--lbm_steps", "1", "--out", str(lbm_out)]) == 0
    main_img, sub_img = Image.open(lbm_out), Image.open(tmp_path / "lbm_sub.png")
    expected = editor.edit(EditRequest([img_a, img_b], PROMPT, lbm_steps=1, seed=4))
    assert np.array_equal(np.asarray(main_img), np.asarray(expected.image))
    assert np.array_equal(np.asarray(sub_img), np.asarray(expected.sub_image))


def test_rope_cache_stays_bounded_over_many_sizes(editor, img_a):
    """DiffSynth's RoPE table cache never evicts; the editor keeps it under ROPE_CACHE_ENTRIES."""
    from diffsynth_qie.models.qwen_image_edit.forward import ROPE_CACHE_ENTRIES

    cache = editor.pipe.dit.pos_embed.rope_cache
    sizes = []
    for i in range(ROPE_CACHE_ENTRIES // 2 + 4):  # every edit adds at least two (target, reference) tables
        w = 64 + 16 * (i % 9)
        h = 64 + 16 * (i // 9)
        editor.edit(EditRequest(images=[img_a.resize((w, h))], prompt="edit", steps=1, cfg=1, height=h, width=w))
        sizes.append(len(cache))
    assert max(sizes) <= ROPE_CACHE_ENTRIES + 4 and len(cache) > 0
