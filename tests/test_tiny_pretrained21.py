"""The pretrained tiny Qwen-Image-2.1 base: shipped weights, recipe fingerprint, DiffSynth's loader, base skill,
and a LoRA on it that learns the demo edit (held-out PSNR, as ``Qwen-Image-2.1.sh`` prints it).

Rebuilding the base from its recipe takes minutes, so that check is opt-in:
``QIE_REBUILD_PRETRAINED=1 pytest tests/test_tiny_pretrained21.py``.
"""
from __future__ import annotations

import copy
import os
import random

import numpy as np
import pytest
import torch

from conftest import fresh_accelerate

MODEL = "tiny-2.1"
STEPS = 150          # LoRA optimizer steps (batch 4, rank 16, lr 1e-3), as the demo's first 150
SAMPLER_STEPS = 8
# Measured on the 4 held-out pairs below: base 14.4 dB, LoRA 20.9 dB (+6.5 dB); the demo's 400 steps on its 8
# held-out pairs: 14.6 -> 20.4 dB. Half the measured gain is the bar.
MIN_GAIN_DB = 3.0


@pytest.fixture(scope="module")
def pretrained21(tmp_path_factory):
    from diffsynth_qie.tiny import pretrained as tiny_pretrained
    from diffsynth_qie.training.pretrain_tiny import recipe_fingerprint

    out = tmp_path_factory.mktemp("pretrained21") / "base"
    if not tiny_pretrained.install_shipped(out, recipe_fingerprint(model=MODEL), tiny_pretrained.QWEN21_BASE):
        pytest.fail("the shipped pretrained tiny 2.1 base does not match its recipe here; rebuild it with `qie "
                    "make-tiny --model tiny-2.1 --pretrained --retrain --write_shipped "
                    "diffsynth_qie/tiny/assets/tiny_pretrained21`")
    return out


def test_shipped_weights_match_the_recipe_fingerprint():
    from diffsynth_qie.tiny import pretrained as tiny_pretrained
    from diffsynth_qie.training import pretrain_tiny

    record = tiny_pretrained.shipped_info(tiny_pretrained.QWEN21_BASE)
    assert record["fingerprint"] == pretrain_tiny.recipe_fingerprint(model=MODEL)
    assert record["recipe"] == pretrain_tiny.RECIPE21
    assert record["fingerprint"] != pretrain_tiny.recipe_fingerprint()  # not the Edit base's
    shipped = sum(p.stat().st_size for p in tiny_pretrained.QWEN21_BASE.shipped_dir.iterdir())
    assert shipped < 4 * 1024 ** 2  # small enough to ship in the package


def test_fingerprint_follows_the_recipe_and_not_the_process(monkeypatch):
    """Building a text encoder must not move it (transformers writes into the config dicts it is given)."""
    from diffsynth_qie.tiny.qwen21 import TinyQwenImage21TextEncoder
    from diffsynth_qie.training import pretrain_tiny

    before = pretrain_tiny.recipe_fingerprint(model=MODEL)
    TinyQwenImage21TextEncoder()
    assert pretrain_tiny.recipe_fingerprint(model=MODEL) == before
    changed = copy.deepcopy(pretrain_tiny.RECIPE21)
    changed["dit_steps"] += 1
    monkeypatch.setattr(pretrain_tiny, "RECIPE21", changed)
    assert pretrain_tiny.recipe_fingerprint(model=MODEL) != before


def test_a_preset_without_a_base_is_refused_by_name():
    from diffsynth_qie.training.pretrain_tiny import recipe_fingerprint

    with pytest.raises(ValueError, match="--model 2511 has no pretrained tiny base; choose one of tiny, tiny-2.1"):
        recipe_fingerprint(model="2511")


def test_loaded_by_diffsynths_loader_and_reproduces_images(pretrained21):
    from diffsynth_qie.data.demo import random_shapes_image
    from diffsynth_qie.inference import EditRequest, Editor
    from diffsynth_qie.inference.evaluate import psnr
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.models.qwen_image_21.qwen21 import decode21, encode_image21
    from diffsynth_qie.tiny.vae21 import TinyConvQwenImage21VAE

    pipe = load_pipeline(MODEL, model_dir=pretrained21, device="cpu", torch_dtype=torch.float32)
    assert type(pipe.vae) is TinyConvQwenImage21VAE
    rng = random.Random("test")
    images = [random_shapes_image(rng) for _ in range(3)]
    # Measured on these images: the pretrained VAE reconstructs at 15.5-19.8 dB (mean 18.1), its DiT reproduces the
    # reference at 15.8-20.3 dB (mean 18.4).
    recon = [psnr(decode21(pipe, encode_image21(pipe, im)), im) for im in images]
    assert np.mean(recon) > 15, recon
    editor = Editor(pipe)
    out = [editor.edit(EditRequest(images=[im], prompt="keep the image as it is", steps=8, cfg=1.0)).image
           for im in images]
    scores = [psnr(o, im) for o, im in zip(out, images)]
    assert np.mean(scores) > 15, scores


def test_a_lora_on_the_base_learns_the_demo_edit(pretrained21, tmp_path_factory):
    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.demo import make_recolour_demo
    from diffsynth_qie.data.formats import DatasetConfig
    from diffsynth_qie.inference import Editor
    from diffsynth_qie.inference.evaluate import evaluate, load_cases
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.training import config as tc
    from diffsynth_qie.training.loop import train

    demo = make_recolour_demo(tmp_path_factory.mktemp("recolour21"), num_pairs=32, num_heldout=4, seed=0)
    pipe = load_pipeline(MODEL, model_dir=pretrained21, device="cpu", torch_dtype=torch.float32)
    cache = tmp_path_factory.mktemp("recolour21-cache")
    write_cache(CacheConfig(cache_dir=str(cache), model=MODEL, max_pixels=16384, num_workers=1,
                            dataset=DatasetConfig(dataset_metadata=str(demo / "metadata.json"))),
                pipe=pipe, rank=0, world_size=1)
    with fresh_accelerate():
        lora = train(tc.RunConfig(
            train=tc.TrainConfig(cache_dir=str(cache), output_dir=str(tmp_path_factory.mktemp("recolour21-run")),
                                 model=MODEL, model_dir=str(pretrained21), batch_size=4, max_steps=STEPS,
                                 mixed_precision="no", gradient_checkpointing=False, cfg_dropout=0.0, save_every=0,
                                 seed=0, device="cpu"),
            lora=tc.LoRAConfig(lora_rank=16), optim=tc.OptimConfig(learning_rate=1e-3))).lora_path
    editor, cases = Editor(pipe), load_cases(str(demo / "heldout.json"))
    base = evaluate(editor, cases, steps=SAMPLER_STEPS, cfg=1.0, seed=0)
    editor.set_loras([(lora, 1.0)])
    tuned = evaluate(editor, cases, steps=SAMPLER_STEPS, cfg=1.0, seed=0)
    gain = tuned.mean_psnr - base.mean_psnr
    assert gain >= MIN_GAIN_DB, f"held-out PSNR base {base.mean_psnr:.2f} dB -> LoRA {tuned.mean_psnr:.2f} dB"
    for case, before, after in zip(cases, base.outputs, tuned.outputs):  # inside the mask: bluer, not red
        inside = np.asarray(case.mask) > 127
        b, a = np.asarray(before, dtype=float)[inside], np.asarray(after, dtype=float)[inside]
        assert (a[:, 2] - a[:, 0]).mean() > (b[:, 2] - b[:, 0]).mean() + 20


@pytest.mark.skipif(os.environ.get("QIE_REBUILD_PRETRAINED") != "1",
                    reason="rebuilds the pretrained 2.1 base (minutes); set QIE_REBUILD_PRETRAINED=1")
def test_rebuild_reproduces_the_shipped_weights(tmp_path):
    from safetensors.torch import load_file

    from diffsynth_qie.tiny import pretrained as tiny_pretrained
    from diffsynth_qie.training.pretrain_tiny import pretrain_tiny

    torch.set_num_threads(1)
    base = tiny_pretrained.QWEN21_BASE
    out = pretrain_tiny(tmp_path / "base", model=MODEL)
    for rel, name in base.files.values():
        built, shipped = load_file(str(out / rel)), load_file(str(base.shipped_dir / name))
        assert built.keys() == shipped.keys()
        for k in built:
            torch.testing.assert_close(built[k], shipped[k], rtol=0, atol=1e-5, msg=k)


def test_every_shipped_base_is_package_data():
    """An installed package (not only a checkout) carries every base's shipped weights."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from diffsynth_qie.tiny import pretrained as tiny_pretrained

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = globs["diffsynth_qie.tiny"]
    package = root / "diffsynth_qie" / "tiny"
    for base in tiny_pretrained.BASES.values():
        files = [p.relative_to(package).as_posix() for p in base.shipped_dir.iterdir()]
        assert files and all(any(fnmatch.fnmatch(f, g) for g in patterns) for f in files), (base.preset, files)
