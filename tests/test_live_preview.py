"""Live previews while an edit denoises: the samplers hand each step's predicted clean latents (x0 = x − σ·v) to an
optional ``preview`` hook, the editor decodes one every ``preview_every`` steps, and the result is bit-identical with
previews on and off (a preview reads the sampling state, never changes it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffsynth_qie.inference import EditRequest, Editor
from diffsynth_qie.models.family_ops import ops_for
from diffsynth_qie.models.samplers.sampling import predicted_clean, sample_bridge, sample_flow_match
from diffsynth_qie.models.samplers.schedules import ScheduleSpec

PROMPT = "make the red circle blue"


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)).resize((w, h), Image.BILINEAR)


@pytest.fixture(scope="module")
def editor(tiny_model_dir):
    from diffsynth_qie.models.load.loading import load_pipeline

    return Editor(load_pipeline("tiny", model_dir=tiny_model_dir, device="cpu", torch_dtype=torch.float32))


def test_x0_of_a_straight_path_is_its_end_at_every_step():
    """A constant velocity is a straight path: the clean latents every step predicts are the sampler's result."""
    spec, seen = ScheduleSpec(4, (4, 6)), []
    noise = torch.randn(1, 16, 4, 6, generator=torch.Generator().manual_seed(0))
    v = torch.randn(1, 16, 4, 6, generator=torch.Generator().manual_seed(1))
    out = sample_flow_match(lambda x, t: v, noise, spec, ops_for("qwen-image-edit").schedule,
                            preview=lambda step, total, x0: seen.append((step, total, x0)))
    assert [(s, t) for s, t, _ in seen] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    for _, _, x0 in seen:
        assert torch.allclose(x0, out, atol=1e-5)
    # the kept region: reset to what keep(x0, 0) gives
    keep = lambda x, sigma: torch.where(torch.arange(6) < 3, torch.zeros_like(x), x)  # noqa: E731
    assert (predicted_clean(noise, v, 0.5, keep)[..., :3] == 0).all()


def test_bridge_previews_predict_the_target():
    """LBM: one step's x0 from the prior with the bridge's own velocity is the target, for both streams."""
    prior, target = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4)
    seen = []
    sample_bridge(lambda x, t: prior - target, prior, 3, bridge_noise=0.0,
                  preview=lambda step, total, x0: seen.append((step, total, x0)))
    assert [(s, t) for s, t, _ in seen] == [(1, 3), (2, 3), (3, 3)]
    assert all(torch.allclose(x0, target, atol=1e-5) for _, _, x0 in seen)


def _edit(editor, every: int, **kw):
    previews = []
    result = editor.edit(EditRequest(
        [_image(64, 48, 3)], PROMPT, seed=5, preview_every=every,
        preview=lambda step, total, image: previews.append((step, total, image)), **kw))
    return result, previews


@pytest.mark.parametrize("kw", [dict(steps=7, cfg=2.0), dict(lbm_steps=4, lbm_noise=0.05)], ids=["flow", "lbm"])
def test_previews_come_every_n_steps_and_leave_the_result_bit_identical(editor, kw):
    mask = Image.new("L", (64, 48), 0)
    mask.paste(255, (8, 8, 40, 32))
    off, none = _edit(editor, 0, mask=mask, **kw)
    on, previews = _edit(editor, 2 if "steps" in kw else 1, mask=mask, **kw)
    total = kw.get("steps") or kw["lbm_steps"]
    every = 2 if "steps" in kw else 1
    assert none == []
    # every N steps, never the last (that is the result itself)
    assert [s for s, _, _ in previews] == [s for s in range(every, total, every)]
    assert all(t == total and isinstance(im, Image.Image) and im.size == on.image.size for _, t, im in previews)
    assert torch.equal(on.latents, off.latents)
    assert np.array_equal(np.asarray(on.image), np.asarray(off.image))
    if on.sub_image is not None:
        assert np.array_equal(np.asarray(on.sub_image), np.asarray(off.sub_image))
    # the preview is the decoded x0 of a step: later previews move toward the result
    final = np.asarray(on.image, dtype=np.float32)
    gaps = [np.abs(np.asarray(im, dtype=np.float32) - final).mean() for _, _, im in previews]
    assert gaps[-1] <= gaps[0] + 1e-6


def test_preview_every_is_checked(editor):
    with pytest.raises(ValueError, match="preview_every"):
        editor.edit(EditRequest([_image(32, 32, 1)], PROMPT, steps=2, preview_every=-1))
    # without a preview hook nothing is decoded (previews cost nothing unless asked for)
    calls = []
    editor._decode, real = (lambda x: calls.append(x) or real(x)), editor._decode
    try:
        editor.edit(EditRequest([_image(32, 32, 1)], PROMPT, steps=3, preview_every=1))
    finally:
        del editor._decode
    assert len(calls) == 1  # the result only


def test_large_previews_are_decoded_small():
    """A preview's decode costs about its pixels: latents of a large output are averaged down to the preview cap."""
    from diffsynth_qie.inference.editor import PREVIEW_MAX_PIXELS, preview_latents

    small = torch.randn(16, 8, 6)
    assert preview_latents(small, 8) is small
    big = torch.ones(16, 128, 96) * torch.arange(16.0)[:, None, None]  # a 1024x768 output
    out = preview_latents(big, 8)
    assert out.shape[0] == 16 and out.shape[1] * out.shape[2] * 64 <= PREVIEW_MAX_PIXELS
    assert out.shape[1] / out.shape[2] == pytest.approx(128 / 96, rel=0.1)
    assert torch.allclose(out, torch.arange(16.0)[:, None, None].expand_as(out))  # an average, channel by channel
