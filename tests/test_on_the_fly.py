"""`qie train --on_the_fly`: the same numbers as training from the cache, exact resume after kill -9,
augmentation that keeps target, references and mask aligned, and the encoders on their own devices."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import curve_script, fresh_accelerate, kill_and_resume  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _config(out, tiny_model_dir, demo_data_dir, on_the_fly: bool, cache_dir=None, **train):
    from diffsynth_qie.data.formats import DatasetConfig
    from diffsynth_qie.training import config as tc

    t = dict(model="tiny", model_dir=str(tiny_model_dir), device="cpu", batch_size=2, max_steps=20, seed=3,
             mixed_precision="no", gradient_checkpointing=False, cfg_dropout=0.2, save_every=0)
    t.update(train)
    return tc.RunConfig(
        train=tc.TrainConfig(cache_dir=None if on_the_fly else str(cache_dir), output_dir=str(out), **t),
        lora=tc.LoRAConfig(lora_rank=4), optim=tc.OptimConfig(learning_rate=1e-3),
        loss=tc.LossConfig(mask_loss_weights=(2.0, 0.5)),
        onthefly=tc.OnTheFlyConfig(on_the_fly=on_the_fly, max_pixels=curve_script.CACHE_MAX_PIXELS),
        dataset=DatasetConfig(dataset_metadata=str(Path(demo_data_dir) / "metadata.json") if on_the_fly else None))


def test_on_the_fly_gives_the_cached_runs_loss_curve(cache_dir, demo_data_dir, tiny_model_dir, tmp_path):
    """20 steps, batch 2, mixed shapes, masks, CFG dropout: the same curve and LoRA as from the cache."""
    from safetensors.torch import load_file

    from diffsynth_qie.training.loop import train

    cached = train(_config(tmp_path / "cached", tiny_model_dir, demo_data_dir, False, cache_dir))
    with fresh_accelerate():
        live = train(_config(tmp_path / "live", tiny_model_dir, demo_data_dir, True))
    assert len(live.losses) == 20
    diff = max(abs(a - b) / max(abs(b), 1e-8) for a, b in zip(live.losses, cached.losses))
    assert diff <= 1e-5, (diff, live.losses, cached.losses)
    a, b = load_file(str(live.lora_path)), load_file(str(cached.lora_path))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-7) for k in a)
    assert (tmp_path / "live" / "skipped.jsonl").is_file()


def test_a_killed_on_the_fly_run_resumes_exactly(demo_data_dir, tiny_model_dir, tmp_path):
    """kill -9 after the second checkpoint, resume: the loss log and LoRA of an uninterrupted run."""
    base = [sys.executable, "-m", "diffsynth_qie.cli", "train", "--on_the_fly", "--model", "tiny", "--model_dir",
            str(tiny_model_dir), "--device", "cpu", "--dataset_metadata", str(Path(demo_data_dir) / "metadata.json"),
            "--max_pixels", str(curve_script.CACHE_MAX_PIXELS), "--batch_size", "2", "--max_steps", "12",
            "--save_every", "4", "--lora_rank", "4", "--learning_rate", "1e-3", "--no-gradient_checkpointing",
            "--mixed_precision", "no", "--augment", "--seed", "5"]
    ref, out = kill_and_resume(base, tmp_path, "checkpoint-8", "lora.safetensors")

    def curve(d):
        return [(r["step"], r["loss"]) for r in map(json.loads, (d / "loss.jsonl").read_text().splitlines())]

    ref_log, got = curve(ref), curve(out)
    assert [s for s, _ in got] == [s for s, _ in ref_log] == list(range(1, 13))
    assert [v for _, v in got] == pytest.approx([v for _, v in ref_log], rel=1e-6)
    from safetensors.torch import load_file

    a, b = load_file(str(out / "lora.safetensors")), load_file(str(ref / "lora.safetensors"))
    assert all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-8) for k in b)


def test_augmentation_keeps_target_references_and_mask_aligned(tmp_path):
    """A square at one place (as fractions) in the target, a reference of another size and the mask: after
    prepare_row's crop and flip their squares' centres agree within 2 px, and both flips occur over seeds."""
    import random

    from diffsynth_qie.cache.config import CacheConfig
    from diffsynth_qie.cache.encode import prepare_row
    from diffsynth_qie.cache.live import augmenter
    from diffsynth_qie.data.rows import EditRow
    from diffsynth_qie.models.family_ops import ops_for

    def scene(w, h, colour, mode="RGB"):
        im = Image.new(mode, (w, h), 255 if mode == "L" else (255, 255, 255))
        im.paste(Image.new(mode, (w // 4, h // 4), 0 if mode == "L" else colour), (w // 8, h // 2))
        return im

    scene(128, 96, (0, 0, 255)).save(tmp_path / "t.png")
    scene(64, 48, (255, 0, 0)).save(tmp_path / "r.png")
    Image.eval(scene(128, 96, None, "L"), lambda v: 255 - v).save(tmp_path / "m.png")  # white = the square
    row = EditRow("r", ["x"], tmp_path / "t.png", [tmp_path / "r.png"], back_mask=tmp_path / "m.png")
    config, ops = CacheConfig(max_pixels=128 * 96), ops_for("qwen-image-edit")
    flips = set()
    for seed in range(8):
        prep = prepare_row(row, config, ops, augment=augmenter(random.Random(seed)))
        t = np.asarray(prep.target)[..., 0] < 128  # the blue square
        r = np.asarray(prep.edits[0].resize(prep.target.size, Image.NEAREST))[..., 1] < 128  # the red square
        m = torch.nn.functional.interpolate(prep.back_mask[None], size=t.shape, mode="nearest")[0, 0].numpy() > 0.5
        assert prep.target.size == (128, 96) and prep.edits[0].size == (64, 48) and prep.back_mask.shape == (1, 12, 16)
        centres = [np.argwhere(x).mean(0) for x in (t, r)]
        assert np.abs(centres[1] - centres[0]).max() <= 2, (seed, centres)
        assert np.abs(np.argwhere(m).mean(0) - centres[0]).max() <= 4  # the mask at latent resolution (8 px cells)
        flips.add(bool(centres[0][1] > 64))
    assert flips == {True, False}
    plain = prepare_row(row, config, ops)
    assert np.array_equal(np.asarray(prepare_row(row, config, ops).target), np.asarray(plain.target))  # no augment: as cached


def test_the_encoders_run_on_their_devices(demo_data_dir, tiny_model_dir, tmp_path, monkeypatch):
    """--text_encoder_device / --vae_device: each module lives on its device (the meta device stands in for a
    second one), and the pipeline points inputs at the component that runs (recorded inside the encoding)."""
    from types import SimpleNamespace

    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.onthefly import live_store

    cfg = _config(tmp_path / "run", tiny_model_dir, demo_data_dir, True).resolved(get_preset("tiny"))
    cfg.onthefly.text_encoder_device, cfg.onthefly.vae_device = "meta", "cpu"
    store = live_store(cfg, get_preset("tiny"), SimpleNamespace(device=torch.device("cpu"), is_main_process=True))
    assert {p.device.type for p in store.pipe.text_encoder.parameters()} == {"meta"}
    assert {p.device.type for p in store.pipe.vae.parameters()} == {"cpu"}
    from diffsynth_qie.cache import encode

    seen = {}

    class Stop(Exception):
        pass

    def vae_encode_many(pipe, images, ops):
        seen["vae"] = pipe.device
        return [torch.zeros(16, im.size[1] // 8, im.size[0] // 8) for im in images]

    def encode_prompt(self, pipe, *args):
        seen["text_encoder"] = pipe.device
        raise Stop

    monkeypatch.setattr(encode, "vae_encode_many", vae_encode_many)
    monkeypatch.setattr(type(store.ops), "encode_prompt", encode_prompt)
    with pytest.raises(Stop):
        store.load(0)
    assert seen == {"vae": torch.device("cpu"), "text_encoder": torch.device("meta")}


def test_edit_device_flags_place_each_component(tiny_model_dir):
    """qie edit's --text_encoder_device / --vae_device / --dit_device, merged with --device_map (meta stands in
    for a second device)."""
    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.inference import Editor
    from diffsynth_qie.inference.editor import device_map_with

    args = build_parser().parse_args(["edit", "--image", "a.png", "--prompt", "x", "--out", "o.png",
                                      "--text_encoder_device", "meta", "--device_map", "dit=cpu"])
    mapping = device_map_with(args.device_map, text_encoder=args.text_encoder_device, vae=args.vae_device,
                              dit=args.dit_device)
    assert mapping == {"dit": "cpu", "text_encoder": "meta"}
    editor = Editor.from_preset("tiny", model_dir=tiny_model_dir, device="cpu", device_map=mapping)
    assert {k: str(v) for k, v in editor.devices.items()} == {"text_encoder": "meta", "dit": "cpu", "vae": "cpu"}
    assert {p.device.type for p in editor.pipe.text_encoder.parameters()} == {"meta"}
    assert {p.device.type for p in editor.pipe.dit.parameters()} == {"cpu"}
    with pytest.raises(ValueError, match="--dit_device cpu and --device_map's dit=meta disagree"):
        device_map_with("dit=meta", dit="cpu")


def test_qie_cache_places_each_encoder_and_drops_the_vae_decoder(tiny_model_dir):
    from diffsynth_qie.cache.config import CacheConfig
    from diffsynth_qie.cache.settings import load_encoders
    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.commands.cache import config_from_args

    args = build_parser().parse_args(["cache", "--model", "tiny", "--model_dir", str(tiny_model_dir), "--device", "cpu",
                                      "--text_encoder_device", "meta", "--dataset_metadata", "m.json",
                                      "--cache_dir", "c"])
    config = config_from_args(args)
    assert isinstance(config, CacheConfig) and (config.text_encoder_device, config.vae_device) == ("meta", None)
    pipe = load_encoders(config, "cpu")
    assert {p.device.type for p in pipe.text_encoder.parameters()} == {"meta"}
    assert {p.device.type for p in pipe.vae.parameters()} == {"cpu"} and pipe.vae.decoder is None


def test_the_lora_starts_from_the_seed_whatever_drew_from_the_global_rng_before(cache_dir, tiny_model_dir, tmp_path):
    """A process's first model load draws from the global RNG and a later one does not: the LoRA's initial values
    must come from --seed alone (the on-the-fly encoders load before the DiT; a fresh CLI run loads nothing)."""
    from types import SimpleNamespace

    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.placement import build_module

    cfg = _config(tmp_path / "run", tiny_model_dir, None, False, cache_dir).resolved(get_preset("tiny"))
    accelerator = SimpleNamespace(device=torch.device("cpu"), mixed_precision="no", num_processes=1,
                                  local_process_index=0)
    inits = []
    for draws in (0, 1000):
        torch.manual_seed(99)
        torch.rand(draws)
        module, _ = build_module(cfg, get_preset("tiny"), accelerator, None)
        inits.append({n: p.detach().clone() for n, p in module.trainable_named_parameters()})
    assert inits[0].keys() == inits[1].keys() and all(torch.equal(inits[0][k], inits[1][k]) for k in inits[0])


def test_plan_prices_the_encoders_where_they_run():
    """qie plan --on_the_fly adds the encoders' weights to the GPU, or to the host (fp32) with --*_device cpu;
    --task edit prices each encoder on its own device."""
    from diffsynth_qie.memory.census import preset_census
    from diffsynth_qie.memory.plan import PlanOptions, predict

    c = preset_census("2511", with_encoders=True)
    base = predict(c, PlanOptions())
    live = predict(c, PlanOptions(on_the_fly=True))
    encode = live.gpu["on the fly: encode working set (one image, VAE)"]  # the encode thread's transient
    assert encode > 0
    assert live.gpu_peak - base.gpu_peak == (c.text_encoder_params + c.vae_params) * 2 + encode
    te_cpu = predict(c, PlanOptions(on_the_fly=True, text_encoder_on_gpu=False))
    assert live.gpu_peak - te_cpu.gpu_peak == c.text_encoder_params * 2
    assert te_cpu.host["on the fly: text encoder (fp32, on the CPU)"] == c.text_encoder_params * 4
    edit = predict(c, PlanOptions(task="edit", vae_on_gpu=False))
    assert "VAE" not in edit.gpu and edit.gpu["text encoder"] == c.text_encoder_params * 2
    assert edit.host["VAE (fp32, on the CPU)"] == c.vae_params * 4


def test_on_the_fly_is_refused_under_zero3_and_without_metadata(tmp_path, tiny_model_dir):
    from diffsynth_qie.models.presets import get_preset
    from diffsynth_qie.training.onthefly import check_on_the_fly

    cfg = _config(tmp_path, tiny_model_dir, tmp_path, True)
    check_on_the_fly(cfg, {"zero_optimization": {"stage": 2}})  # ZeRO-2: each rank encodes its share
    with pytest.raises(ValueError, match="--on_the_fly is refused under DeepSpeed ZeRO-3"):
        check_on_the_fly(cfg, {"zero_optimization": {"stage": 3}})
    cfg.dataset.dataset_metadata = None
    with pytest.raises(ValueError, match="--on_the_fly needs --dataset_metadata"):
        cfg.resolved(get_preset("tiny"))
    cfg.dataset.dataset_metadata, cfg.train.cache_dir = "m.json", ["c"]
    with pytest.raises(ValueError, match="drop --cache_dir"):
        cfg.resolved(get_preset("tiny"))
