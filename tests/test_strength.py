"""Edit strength (`qie edit --strength S`, `EditRequest.strength`): S = 1 is the plain edit bit for bit, S = 0
the source, and the output moves away from the source as S rises (flow matching and LBM)."""
from __future__ import annotations

import pytest
import torch
from PIL import Image


@pytest.fixture(scope="module")
def editor(tiny_pipe):
    from diffsynth_qie.inference import Editor

    return Editor(tiny_pipe)


def _image() -> Image.Image:
    im = Image.new("RGB", (64, 64), (240, 240, 240))
    im.paste(Image.new("RGB", (32, 32), (220, 30, 30)), (16, 16))
    return im


def _source_latents(editor, image) -> torch.Tensor:
    return editor._encode_images([image])[0].float()


@pytest.mark.parametrize("lbm", [False, True])
def test_strength_one_is_the_plain_edit_and_zero_is_the_source(editor, lbm):
    from diffsynth_qie.inference import EditRequest

    kw = dict(images=[_image()], prompt="make it blue", steps=3, seed=4, cfg=1.0,
              lbm_steps=2 if lbm else None)
    plain = editor.edit(EditRequest(**kw)).latents
    assert torch.equal(editor.edit(EditRequest(**kw, strength=1.0)).latents, plain)
    zero = editor.edit(EditRequest(**kw, strength=0.0)).latents
    assert torch.equal(zero[0], _source_latents(editor, _image()))


@pytest.mark.parametrize("lbm", [False, True])
def test_the_output_moves_away_from_the_source_as_strength_rises(editor, lbm):
    from diffsynth_qie.inference import EditRequest

    source = _source_latents(editor, _image())
    distances = []
    for s in (0.0, 0.25, 0.5, 0.75, 1.0):
        d = 0.0
        for seed in (0, 1):  # (averaged over two seeds)
            out = editor.edit(EditRequest(images=[_image()], prompt="make it blue", steps=4, seed=seed, cfg=1.0,
                                          lbm_steps=2 if lbm else None, strength=s)).latents[0]
            d += float((out - source).pow(2).mean())
        distances.append(d / 2)
    assert distances[0] == 0.0 and all(a < b for a, b in zip(distances, distances[1:])), distances


def test_strength_is_checked_and_refused_on_a_fixed_grid(editor, capsys):
    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.inference import EditRequest
    from diffsynth_qie.models.samplers.schedules import flow_match_scheduler

    with pytest.raises(ValueError, match=r"strength must be in \[0, 1\]"):
        editor.edit(EditRequest(images=[_image()], prompt="x", strength=1.5))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["edit", "--strength", "2"])
    assert "--strength: 2 is out of range" in capsys.readouterr().err
    with pytest.raises(ValueError, match="a fixed grid .* has no other starting points"):
        flow_match_scheduler(2, 16, sigmas=(1.0, 0.5), strength=0.5)


def test_the_web_ui_passes_the_strength_slider(tiny_model_dir, tmp_path):
    import numpy as np

    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.handlers import GenerateInputs, UIHandlers

    handlers = UIHandlers(UIConfig(model="tiny", model_dir=str(tiny_model_dir), device="cpu", lora_dir=str(tmp_path),
                                    outputs_dir=str(tmp_path / "ui-edits")))
    image = np.asarray(_image())
    out = handlers.generate(GenerateInputs(editor={"background": image, "layers": [], "composite": image},
                                           prompt="make it blue", steps=2, cfg=1.0, strength=0.0))
    source = handlers.editor()._encode_images([Image.fromarray(image)])[0].float()
    assert torch.equal(out.result.latents[0], source) and "strength 0" in out.status


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_a_one_step_schedule_starts_where_two_steps_start_and_denoises_fully(strength):
    """DiffSynth's terminal stretch divides by 1 - σ_last, 0 for one step: the schedule was NaN (an empty edit)."""
    import torch

    from diffsynth_qie.models.samplers.schedules import flow_match_scheduler

    one, two = flow_match_scheduler(1, 4096, strength), flow_match_scheduler(2, 4096, strength)
    assert one.sigmas.shape == (1,) and torch.isfinite(one.sigmas).all()
    assert float(one.sigmas[0]) == float(two.sigmas[0]) and float(one.timesteps[0]) == float(two.timesteps[0])
    x, v = torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2)
    out = one.step(v, one.timesteps[0], x)  # the only step reaches σ = 0
    torch.testing.assert_close(out, x - float(one.sigmas[0]) * v)
