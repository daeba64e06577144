"""Tiny model on DiffSynth's real loading path, pipeline loading, fail-fast resolution, fingerprints."""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from diffsynth_qie.cache.fingerprint import weights_fingerprint
from diffsynth_qie.tiny import build as tiny
from diffsynth_qie.models.load.loading import load_pipeline, resolve_model_configs
from diffsynth_qie.models.presets import PRESETS

WEIGHT_FILES = {"dit": tiny.DIT_FILE, "text_encoder": tiny.TEXT_ENCODER_FILE, "vae": tiny.VAE_FILE}


# --- the tiny model on disk ------------------------------------------------------
def test_tiny_layout_and_registered_hashes(tiny_model_dir):
    from diffsynth.configs import MODEL_CONFIGS
    from diffsynth.core.loader import hash_model_file

    d = Path(tiny_model_dir)
    assert tiny.is_complete(d, seed=0)
    assert (d / "tokenizer" / "tokenizer_config.json").is_file()
    info = json.loads((d / tiny.INFO_FILE).read_text())
    import transformers
    assert info["seed"] == 0 and info["transformers_version"] == transformers.__version__
    assert info["dit"]["dim"] == 64 and info["vae"]["z_dim"] == 16

    tiny.register_tiny_model_configs()
    tiny.register_tiny_model_configs()  # idempotent
    names = {"dit": "qwen_image_dit", "text_encoder": "qwen_image_text_encoder", "vae": "qwen_image_vae"}
    for component, rel in WEIGHT_FILES.items():
        file_hash = hash_model_file(str(d / rel))  # DiffSynth's own detection hash
        entries = [c for c in MODEL_CONFIGS if c["model_hash"] == file_hash]
        assert len(entries) == 1, component
        assert entries[0]["model_name"] == names[component]
    # The real (7B) text-encoder hash is not ours: the tiny file is recognised as tiny.
    te = [c for c in MODEL_CONFIGS if c["model_hash"] == hash_model_file(str(d / tiny.TEXT_ENCODER_FILE))][0]
    assert te["model_class"].endswith("TinyQwenImageTextEncoder")
    assert te["state_dict_converter"].endswith("QwenImageTextEncoderStateDictConverter")


def test_text_encoder_saved_with_hugging_face_key_names(tiny_model_dir):
    from safetensors import safe_open

    with safe_open(str(Path(tiny_model_dir) / tiny.TEXT_ENCODER_FILE), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
    assert any(k.startswith("visual.blocks.") for k in keys)
    assert not any(k.startswith(("model.language_model.", "model.visual.")) for k in keys)


def test_build_is_deterministic_per_seed(tiny_model_dir, tmp_path):
    from diffsynth.core.loader import hash_model_file

    same = tiny.build_tiny(tmp_path / "same", seed=0)
    other = tiny.build_tiny(tmp_path / "other", seed=1)
    for rel in WEIGHT_FILES.values():
        assert (same / rel).read_bytes() == (Path(tiny_model_dir) / rel).read_bytes(), rel
        assert (other / rel).read_bytes() != (same / rel).read_bytes(), rel
        assert hash_model_file(str(other / rel)) == hash_model_file(str(same / rel))  # same layout
    for folder in ("tokenizer", "processor"):  # file names differ between transformers 4.x and 5.x
        files = sorted(p.relative_to(same) for p in (same / folder).rglob("*") if p.is_file())
        assert files and files == sorted(p.relative_to(tiny_model_dir) for p in (Path(tiny_model_dir) / folder).rglob("*") if p.is_file())
        for rel in files:
            assert (same / rel).read_bytes() == (Path(tiny_model_dir) / rel).read_bytes(), rel


def test_build_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny.build_tiny(tmp_path / "m", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_ensure_tiny_builds_only_when_needed(tmp_path):
    d = tmp_path / "tiny"
    assert tiny.ensure_tiny(d) == d and tiny.is_complete(d, seed=0)
    mtime = (d / tiny.DIT_FILE).stat().st_mtime_ns
    tiny.ensure_tiny(d)
    assert (d / tiny.DIT_FILE).stat().st_mtime_ns == mtime  # complete: untouched
    (d / tiny.VAE_FILE).unlink()  # incomplete -> rebuilt
    assert not tiny.is_complete(d)
    tiny.ensure_tiny(d)
    assert tiny.is_complete(d, seed=0) and (d / tiny.VAE_FILE).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="mine"):
        tiny.ensure_tiny(user_dir)
    assert (user_dir / "notes.txt").read_text() == "keep me"


def test_make_tiny_command(tmp_path):
    from diffsynth_qie.commands import make_tiny

    parser = argparse.ArgumentParser()
    make_tiny.add_arguments(parser)
    out = tmp_path / "cli-tiny"
    assert make_tiny.run(parser.parse_args(["--out", str(out), "--seed", "2"])) == 0
    assert json.loads((out / tiny.INFO_FILE).read_text())["seed"] == 2
    mtime = (out / tiny.DIT_FILE).stat().st_mtime_ns
    make_tiny.run(parser.parse_args(["--out", str(out), "--seed", "2"]))
    tiny.ensure_tiny(out)  # seed=None: any complete build will do
    assert (out / tiny.DIT_FILE).stat().st_mtime_ns == mtime
    make_tiny.run(parser.parse_args(["--out", str(out), "--seed", "2", "--force"]))
    assert (out / tiny.DIT_FILE).stat().st_mtime_ns != mtime
    tiny.ensure_tiny(out, seed=3)  # an explicit other seed rebuilds
    assert json.loads((out / tiny.INFO_FILE).read_text())["seed"] == 3
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.png").write_bytes(b"x")
    with pytest.raises(ValueError, match="data"):
        make_tiny.run(parser.parse_args(["--out", str(tmp_path / "data")]))


# --- loading ---------------------------------------------------------------------
def test_diffsynth_from_pretrained_loads_the_tiny_classes(tiny_model_dir):
    """DiffSynth's own entry point, no helper of ours except the registration."""
    from diffsynth.core import ModelConfig
    from diffsynth.core.loader import load_state_dict
    from diffsynth.models.qwen_image_vae import QwenImageVAE
    from diffsynth.pipelines.qwen_image import QwenImagePipeline
    from transformers import Qwen2Tokenizer, Qwen2VLProcessor

    tiny.register_tiny_model_configs()
    d = Path(tiny_model_dir)
    pipe = QwenImagePipeline.from_pretrained(
        torch_dtype=torch.float32, device="cpu",
        model_configs=[ModelConfig(path=str(d / rel)) for rel in WEIGHT_FILES.values()],
        tokenizer_config=ModelConfig(path=str(d / "tokenizer")),
        processor_config=ModelConfig(path=str(d / "processor")),
    )
    assert type(pipe.dit) is tiny.TinyQwenImageDiT
    assert type(pipe.text_encoder) is tiny.TinyQwenImageTextEncoder
    assert type(pipe.vae) is QwenImageVAE
    assert isinstance(pipe.tokenizer, Qwen2Tokenizer) and isinstance(pipe.processor, Qwen2VLProcessor)
    # The converter ran: the HF-named file maps onto the module's keys with equal values.
    saved = load_state_dict(str(d / tiny.TEXT_ENCODER_FILE))
    loaded = pipe.text_encoder.state_dict()
    assert len(saved) == len(loaded)
    assert torch.equal(loaded["model.language_model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    vis = next(k for k in saved if k.startswith("visual.blocks."))
    assert torch.equal(loaded["model." + vis], saved[vis])


def test_load_pipeline_full(tiny_pipe):
    assert tiny_pipe.qie_preset.name == "tiny"
    assert tiny_pipe.qie_preset.zero_cond_t is False
    assert type(tiny_pipe.dit) is tiny.TinyQwenImageDiT
    assert type(tiny_pipe.text_encoder) is tiny.TinyQwenImageTextEncoder
    assert tiny_pipe.vae is not None and tiny_pipe.tokenizer is not None and tiny_pipe.processor is not None
    assert {p.dtype for p in tiny_pipe.dit.parameters()} == {torch.float32}
    assert set(tiny_pipe.qie_model_paths) == {"dit", "text_encoder", "vae", "tokenizer", "processor"}


def test_load_pipeline_dit_only_and_auto_dtype(tiny_model_dir):
    pipe = load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu", zero_cond_t=True)
    assert type(pipe.dit) is tiny.TinyQwenImageDiT
    assert pipe.text_encoder is None and pipe.vae is None
    assert pipe.tokenizer is None and pipe.processor is None
    assert pipe.qie_preset.zero_cond_t is True and PRESETS["tiny"].zero_cond_t is False
    assert pipe.torch_dtype == torch.float32  # auto: fp32 on CPU
    assert {p.dtype for p in pipe.dit.parameters()} == {torch.float32}


def test_load_pipeline_tiny_default_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("QIE_HOME", str(tmp_path / "home"))
    pipe = load_pipeline("tiny", components=("vae",), device="cpu")
    assert pipe.vae is not None and pipe.dit is None
    assert tiny.is_complete(tmp_path / "home" / "models" / "Qwen-Image-Edit-tiny", seed=0)


def test_bad_component_names():
    with pytest.raises(ValueError, match="unet"):
        resolve_model_configs("2511", model_dir="/nonexistent", components=("dit", "unet"))


# --- real presets: up to where a download would start ---------------------------
def test_real_preset_local_dir_missing_files_names_them(tiny_model_dir, tmp_path):
    d = tmp_path / "Qwen-Image-Edit-2511"
    (d / "transformer").mkdir(parents=True)
    shutil.copy(Path(tiny_model_dir) / tiny.DIT_FILE, d / "transformer" / "diffusion_pytorch_model-00001-of-00001.safetensors")
    t0 = time.perf_counter()
    with pytest.raises(FileNotFoundError) as err:
        load_pipeline("2511", model_dir=d, device="cpu")
    assert time.perf_counter() - t0 < 5
    msg = str(err.value)
    assert "text_encoder/model*.safetensors" in msg and "vae/diffusion_pytorch_model.safetensors" in msg
    assert str(d / "tokenizer") in msg and str(d / "processor") in msg
    assert "transformer/" not in msg  # present, so not reported
    assert f"modelscope download --model Qwen/Qwen-Image-Edit-2511 --local_dir {d}" in msg
    # DiT-only asks for nothing else: resolution succeeds and points at the local shard.
    resolved = resolve_model_configs("2511", model_dir=d, components=("dit",))
    assert [c.path for c in resolved.model_configs] == [str(next((d / "transformer").iterdir()))]
    assert resolved.tokenizer_config is None and resolved.processor_config is None


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """A hub that refuses connections and empty download folders, whatever the machine's network."""
    monkeypatch.delenv("DIFFSYNTH_SKIP_DOWNLOAD", raising=False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "DIFFSYNTH_DOWNLOAD_SOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("DIFFSYNTH_MODEL_BASE_PATH", str(tmp_path / "dl"))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_hub_id_without_network_fails_fast(offline_hub):
    import diffsynth.pipelines.qwen_image  # noqa: F401  (import time is not what we measure)

    t0 = time.perf_counter()
    with pytest.raises(FileNotFoundError) as err:
        load_pipeline("2511", device="cpu")
    assert time.perf_counter() - t0 < 5
    msg = str(err.value)
    assert "unreachable" in msg
    assert "modelscope download --model Qwen/Qwen-Image-Edit-2511" in msg
    for pattern in ("transformer/diffusion_pytorch_model*.safetensors", "text_encoder/model*.safetensors",
                    "vae/diffusion_pytorch_model.safetensors", "tokenizer/", "processor/"):
        assert pattern in msg
    # Nothing was created on the way (DiffSynth would make ./models and credentials).
    assert sorted(p.name for p in offline_hub.iterdir()) == []


def test_skip_download_env_fails_fast(offline_hub, monkeypatch):
    monkeypatch.setenv("DIFFSYNTH_SKIP_DOWNLOAD", "True")
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", "http://10.255.255.1:81")  # would hang; must not be tried
    t0 = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="DIFFSYNTH_SKIP_DOWNLOAD"):
        resolve_model_configs("edit", components=("dit",))
    assert time.perf_counter() - t0 < 1


def test_hub_files_already_downloaded_are_used_by_path(offline_hub, tiny_model_dir):
    """Files in DiffSynth's download folder are found without the hub; sharded sets must be complete."""
    shard_dir = offline_hub / "dl" / "Qwen" / "Qwen-Image-Edit-2509" / "transformer"
    shard_dir.mkdir(parents=True)
    shards = [f"diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    (shard_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    shutil.copy(Path(tiny_model_dir) / tiny.DIT_FILE, shard_dir / shards[0])
    with pytest.raises(FileNotFoundError, match="transformer/diffusion_pytorch_model"):
        resolve_model_configs("2509", components=("dit",))  # shard 2 missing: not complete
    shutil.copy(Path(tiny_model_dir) / tiny.DIT_FILE, shard_dir / shards[1])
    resolved = resolve_model_configs("2509", components=("dit",))
    assert resolved.model_configs[0].path == [str(shard_dir / s) for s in shards]
    assert resolved.model_configs[0].model_id is None  # DiffSynth won't try to download
    assert resolved.paths() == {"dit": [str(shard_dir / s) for s in shards]}


def test_shared_components_found_in_the_presets_own_repo_folder(offline_hub, tiny_model_dir):
    """The text encoder's model id is Qwen/Qwen-Image, but a downloaded Edit repo holds one too."""
    repo = offline_hub / "dl" / "Qwen" / "Qwen-Image-Edit-2511"
    shutil.copytree(tiny_model_dir, repo)
    resolved = resolve_model_configs("2511", components=("text_encoder",))
    assert resolved.paths() == {
        "text_encoder": [str(repo / tiny.TEXT_ENCODER_FILE)],
        "tokenizer": [str(repo / "tokenizer")], "processor": [str(repo / "processor")],
    }
    assert resolved.model_components == ["text_encoder"]


def test_modelscope_cache_found_through_modelscope(offline_hub, tiny_model_dir):
    """A repo in ModelScope's own cache layout (models/<owner>--<name>/snapshots/<rev>, as `modelscope download`
    writes it) is found by asking ModelScope, without the hub and without creating anything."""
    snapshot = offline_hub / "ms-cache" / "models" / "Qwen--Qwen-Image-Edit-2509" / "snapshots" / "0123abcd"
    (snapshot / "transformer").mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "master").write_text("0123abcd")
    shard = snapshot / "transformer" / "diffusion_pytorch_model-00001-of-00001.safetensors"
    shutil.copy(Path(tiny_model_dir) / tiny.DIT_FILE, shard)
    before = sorted(str(p) for p in offline_hub.rglob("*"))
    resolved = resolve_model_configs("2509", components=("dit",))
    assert resolved.paths() == {"dit": [str(shard)]}
    assert sorted(str(p) for p in offline_hub.rglob("*")) == before


def test_diffsynth_loader_prints_become_debug_logs(tiny_model_dir, capfd, caplog):
    """DiffSynth prints each loaded model's config and a line per optional model it lacks: they must not reach
    the terminal by default, and must be in the DEBUG log (what --verbose shows)."""
    import logging

    with caplog.at_level(logging.DEBUG, logger="diffsynth"):
        load_pipeline("tiny", model_dir=tiny_model_dir, components=("vae",), device="cpu")
    out, err = capfd.readouterr()
    assert "Loaded model" not in out + err and "This is not an error" not in out + err
    debug = [r.getMessage() for r in caplog.records if r.name == "diffsynth" and r.levelno == logging.DEBUG]
    assert any("Loaded model" in m for m in debug) and any("This is not an error" in m for m in debug)


def test_transformers_config_warnings_shown_at_most_once(tiny_model_dir):
    """What transformers' own handler writes while two text encoders load: each warning at most once, and the
    RoPE-config warnings DiffSynth's Qwen2.5-VL config triggers (harmless) not at all."""
    import io

    import transformers.utils.logging as tlog

    handler = tlog._get_library_root_logger().handlers[0]
    stream = io.StringIO()
    old = handler.setStream(stream)
    try:
        for _ in range(2):
            load_pipeline("tiny", model_dir=tiny_model_dir, components=("text_encoder",), device="cpu")
        tlog.get_logger("transformers.some_module").warning("another warning")
        tlog.get_logger("transformers.some_module").warning("another warning")
    finally:
        handler.setStream(old)
    text = stream.getvalue()
    assert "rope_scaling" not in text and "Unrecognized keys" not in text
    assert text.count("another warning") == 1


def test_cli_verbose_flag_before_or_after_the_subcommand():
    from diffsynth_qie.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["--verbose", "make-tiny", "--out", "x"]).verbose is True
    assert parser.parse_args(["make-tiny", "--out", "x", "--verbose"]).verbose is True
    assert parser.parse_args(["make-tiny", "--out", "x"]).verbose is False


# --- fingerprints ----------------------------------------------------------------
def test_weights_fingerprint(tiny_model_dir, tmp_path):
    d = Path(tiny_model_dir)
    files = [d / rel for rel in WEIGHT_FILES.values()]
    fp = weights_fingerprint(files)
    assert len(fp) == 64 and fp == weights_fingerprint([str(f) for f in reversed(files)])
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    assert weights_fingerprint([copy / rel for rel in WEIGHT_FILES.values()]) == fp  # location-independent
    other = tiny.build_tiny(tmp_path / "seed1", seed=1)  # same layout, other values
    assert weights_fingerprint([other / rel for rel in WEIGHT_FILES.values()]) != fp
    assert weights_fingerprint(files[:2]) != fp
    assert weights_fingerprint(d / "tokenizer") == weights_fingerprint(copy / "tokenizer")
    with pytest.raises(FileNotFoundError, match="nope"):
        weights_fingerprint(tmp_path / "nope.safetensors")


# --- the tiny model on DiffSynth's real compute path -----------------------------
def test_lora_targets_exist_in_the_real_dit():
    from diffsynth.models.qwen_image_dit import QwenImageDiT

    with torch.device("meta"):
        real = QwenImageDiT(num_layers=1)
    for preset in ("edit", "2511"):
        for target in PRESETS[preset].lora_target_modules:
            hits = [n for n, m in real.named_modules()
                    if (n == target or n.endswith("." + target)) and isinstance(m, torch.nn.Linear)]
            assert hits, target


def test_tiny_dit_has_the_real_dit_module_names():
    from diffsynth.models.qwen_image_dit import QwenImageDiT

    with torch.device("meta"):
        real = QwenImageDiT(num_layers=2)
    assert [n for n, _ in tiny.TinyQwenImageDiT().named_parameters()] == [n for n, _ in real.named_parameters()]


def _dit_inputs(seed=0, h=64, w=64, text_len=7):
    g = torch.Generator().manual_seed(seed)
    return dict(
        latents=torch.randn(1, 16, h // 8, w // 8, generator=g),
        edit_latents=[torch.randn(1, 16, 8, 8, generator=g), torch.randn(1, 16, 6, 10, generator=g)],
        prompt_emb=torch.randn(1, text_len, 32, generator=g),
        prompt_emb_mask=torch.ones(1, text_len, dtype=torch.long),
        timestep=torch.tensor([600.0]),
        height=h, width=w,
    )


def test_model_fn_with_edit_latents_and_zero_cond_t(tiny_pipe):
    from diffsynth.pipelines.qwen_image import model_fn_qwen_image

    dit = tiny_pipe.dit
    inputs = _dit_inputs()
    with torch.no_grad():
        plain = model_fn_qwen_image(dit=dit, **inputs)
        zero = model_fn_qwen_image(dit=dit, zero_cond_t=True, **inputs)
        no_edit = model_fn_qwen_image(dit=dit, **{**inputs, "edit_latents": None})
        no_edit_zero = model_fn_qwen_image(dit=dit, zero_cond_t=True, **{**inputs, "edit_latents": None})
    assert plain.shape == inputs["latents"].shape and torch.isfinite(plain).all()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(plain, no_edit) > 1e-4  # the reference images are attended to
    assert rel(zero, plain) > 1e-5  # zero_cond_t changes the DiT output...
    # ...only through the reference tokens: with none, the modulation index is all 0.
    assert rel(no_edit_zero, no_edit) < 1e-5


@pytest.mark.parametrize("edit", ["none", "single", "list"])
def test_prompt_embeddings_survive_drop_idx(tiny_pipe, edit):
    """Each of DiffSynth's three prompt templates keeps tokens after dropping drop_idx (34/64)."""
    from diffsynth.pipelines.qwen_image import QwenImageUnit_PromptEmbedder
    from PIL import Image

    img = Image.new("RGB", (64, 48), (200, 30, 30))
    edit_image = {"none": None, "single": img, "list": [img, img]}[edit]
    unit = QwenImageUnit_PromptEmbedder()
    short = unit.process(tiny_pipe, "blue", edit_image=edit_image)
    long = unit.process(tiny_pipe, "make the red circle blue and the square green", edit_image=edit_image)
    assert short["prompt_emb"].shape[0] == 1 and short["prompt_emb"].shape[2] == 32
    assert short["prompt_emb"].shape[1] > 0
    assert long["prompt_emb"].shape[1] > short["prompt_emb"].shape[1]
    assert int(short["prompt_emb_mask"].sum()) == short["prompt_emb"].shape[1]
