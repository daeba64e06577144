"""The web UI's handler layer (no gradio, no browser): masks, LoRA picker, limits, generate."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from diffsynth_qie.ui.config import UIConfig
from diffsynth_qie.ui.handlers import (MODE_LBM, NO_LORA, GenerateInputs, Stopped, UIError, UIHandlers, list_loras,
                                       resolve_lora, user_message)
from diffsynth_qie.ui.uploads import (check_upload_size, image_from_editor, mask_from_editor, prune_temp_files,
                                      reference_images)

W, H = 96, 64  # multiples of 16: the editor keeps the size of such an image


# --- helpers ------------------------------------------------------------------------
def _layer(size, boxes, alpha=255, colour=(255, 0, 255), under=(0, 0, 0)):
    """RGBA layer: ``boxes`` painted with ``colour``/``alpha``; elsewhere alpha 0 over ``under``."""
    arr = np.zeros((size[1], size[0], 4), np.uint8)
    arr[..., :3] = under
    for x0, y0, x1, y1 in boxes:
        arr[y0:y1, x0:x1, :3] = colour
        arr[y0:y1, x0:x1, 3] = alpha
    return Image.fromarray(arr, "RGBA")


def _expected(size, boxes):
    out = np.zeros((size[1], size[0]), bool)
    for x0, y0, x1, y1 in boxes:
        out[y0:y1, x0:x1] = True
    return out


def _photo(seed=0, size=(W, H)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def _write_lora(path: Path, dit_file: Path, seed: int, rank: int = 4, targets=("to_q", "to_v")) -> Path:
    """A real LoRA on the tiny DiT's module names (shapes read from its weights' header)."""
    from safetensors import safe_open

    from diffsynth_qie.lora import save_lora

    g = torch.Generator().manual_seed(seed)
    sd = {}
    with safe_open(str(dit_file), "pt") as f:
        for key in f.keys():
            module = key[: -len(".weight")]
            if key.endswith(".weight") and module.rsplit(".", 1)[-1] in targets:
                out_f, in_f = f.get_slice(key).get_shape()
                sd[f"{module}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.5
                sd[f"{module}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.5
    assert sd, "tiny DiT has no to_q/to_v modules"
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_lora(path, sd)


# --- masks from the image editor --------------------------------------------------------
def test_mask_unites_layers_by_alpha_whatever_colour(tmp_path):
    boxes_a, boxes_b = [(4, 4, 20, 12)], [(50, 30, 90, 60)]
    # Layer A: opaque magenta; layer B: faint (alpha 40) dark paint; both hold colour under alpha 0.
    a = _layer((W, H), boxes_a, under=(200, 200, 200))
    b = _layer((W, H), boxes_b, alpha=40, colour=(10, 10, 10), under=(255, 255, 255))
    b_path = tmp_path / "layer_b.png"
    b.save(b_path)
    value = {"background": _photo(), "layers": [np.asarray(a), str(b_path)], "composite": None}
    mask = mask_from_editor(value, size=(W, H))
    assert mask.mode == "L" and mask.size == (W, H)
    arr = np.asarray(mask)
    assert set(np.unique(arr)) == {0, 255}
    np.testing.assert_array_equal(arr == 255, _expected((W, H), boxes_a + boxes_b))


def test_mask_is_none_without_paint():
    assert mask_from_editor(None) is None
    assert mask_from_editor({"background": _photo(), "layers": [], "composite": None}) is None
    empty = _layer((W, H), [], under=(255, 0, 0))  # colour but alpha 0 everywhere
    assert mask_from_editor({"background": _photo(), "layers": [empty], "composite": None}) is None


def test_mask_layer_of_other_size_is_scaled_to_the_image():
    big = _layer((2 * W, 2 * H), [(0, 0, W, H)])  # top-left quarter at 2x
    mask = np.asarray(mask_from_editor({"background": _photo(), "layers": [big]}, size=(W, H)))
    np.testing.assert_array_equal(mask == 255, _expected((W, H), [(0, 0, W // 2, H // 2)]))


def test_mask_from_layer_without_alpha_uses_non_black_pixels():
    rgb = _layer((W, H), [(10, 10, 30, 20)]).convert("RGB")  # alpha dropped upstream: paint = non-black
    mask = np.asarray(mask_from_editor({"background": _photo(), "layers": [rgb]}, size=(W, H)))
    np.testing.assert_array_equal(mask == 255, _expected((W, H), [(10, 10, 30, 20)]))


def test_image_from_editor_flattens_transparency_on_white_and_falls_back_to_composite():
    arr = np.zeros((H, W, 4), np.uint8)
    arr[:, : W // 2] = (10, 20, 30, 255)  # left half opaque, right half transparent
    image = image_from_editor({"background": Image.fromarray(arr, "RGBA"), "layers": [], "composite": None})
    assert image.mode == "RGB" and image.size == (W, H)
    out = np.asarray(image)
    assert (out[:, : W // 2] == (10, 20, 30)).all() and (out[:, W // 2:] == 255).all()
    photo = _photo(1)
    assert np.array_equal(np.asarray(image_from_editor({"background": None, "layers": [], "composite": photo})),
                          np.asarray(photo))
    with pytest.raises(UIError, match="upload an image"):
        image_from_editor({"background": None, "layers": [], "composite": None})


# --- upload limit ---------------------------------------------------------------------------
def test_upload_over_the_limit_is_refused(tmp_path):
    path = tmp_path / "big.png"
    _photo(size=(256, 256)).save(path)  # ~197 kB of noise
    size = path.stat().st_size
    check_upload_size(str(path), size)  # exactly at the limit: fine
    with pytest.raises(UIError, match=r"limit is .* MB \(--max_upload_mb\)"):
        check_upload_size(str(path), size - 1)
    with pytest.raises(UIError):
        check_upload_size({"path": str(path)}, size - 1)  # FileData-like dicts too
    check_upload_size(_photo(), 1)  # in-memory images have no file size


def test_generate_refuses_oversized_upload_before_loading_the_model(tmp_path):
    path = tmp_path / "big.png"
    _photo(size=(256, 256)).save(path)
    ref = tmp_path / "ref.png"
    _photo(3, size=(256, 256)).save(ref)

    def no_model():
        raise AssertionError("the model must not load for a refused upload")

    handlers = UIHandlers(UIConfig(max_upload_mb=0.05, lora_dir=str(tmp_path)), editor_factory=no_model)
    with pytest.raises(UIError, match=r"uploaded image is 0\.1\d+ MB; the limit is 0\.05 MB"):
        handlers.generate(GenerateInputs(editor={"background": str(path), "layers": []}, prompt="x"))
    small = tmp_path / "small.png"
    _photo(size=(32, 32)).save(small)
    with pytest.raises(UIError, match="reference image 1"):
        handlers.generate(GenerateInputs(editor={"background": str(small), "layers": []}, prompt="x",
                                         references=[(str(ref), None)]))
    assert handlers.load_count == 0


# --- one image loader, uploads that cost resources, temp files -------------------------------
def test_16bit_png_upload_is_scaled_not_white(tmp_path):
    """The UI decodes files like the cache and `qie edit` (data.images): 16-bit is scaled to 8 bit."""
    vals = np.tile(np.array([0, 257 * 60, 257 * 128, 65535], np.uint16), (16, 4))  # 16 x 16
    path = tmp_path / "g16.png"
    Image.fromarray(vals).save(path)
    assert Image.open(path).mode in ("I;16", "I")
    want = [0, 60, 128, 255]
    image = image_from_editor({"background": str(path), "layers": []}, max_bytes=2**20)
    assert image.mode == "RGB" and np.asarray(image)[0, :4, 0].tolist() == want
    (ref,) = reference_images([(str(path), None)], max_bytes=2**20)
    assert np.asarray(ref)[0, :4, 1].tolist() == want
    # the same pixels as the cache's loader
    from diffsynth_qie.data.images import load_rgb
    assert np.array_equal(np.asarray(image), np.asarray(load_rgb(path)))


def test_non_image_and_huge_uploads_get_our_messages(tmp_path):
    from tests.test_input_limits import png_header_only

    junk = tmp_path / "notes.png"
    junk.write_text("not an image")
    with pytest.raises(UIError, match="uploaded image is not a readable image; upload a PNG"):
        image_from_editor({"background": str(junk), "layers": []}, max_bytes=2**20)
    with pytest.raises(UIError, match="uploaded reference image 1 is not a readable image"):
        reference_images([str(junk)], max_bytes=2**20)
    bomb = png_header_only(tmp_path / "bomb.png", 12000, 12000)
    with pytest.raises(UIError, match=r"uploaded image is 12000x12000 = 144\.0 MP, more than the limit"):
        image_from_editor({"background": str(bomb), "layers": []}, max_bytes=2**20)
    with pytest.raises(UIError, match="uploaded image is 12000x12000"):  # without a byte limit too
        image_from_editor({"background": str(bomb), "layers": []})
    with pytest.raises(UIError, match="mask layer 1 is 12000x12000"):
        mask_from_editor({"background": None, "layers": [str(bomb)]}, max_bytes=2**20)


def test_upload_guard_turns_gradio_decoding_failures_into_our_message(tmp_path):
    gr = pytest.importorskip("gradio")
    from gradio.data_classes import FileData

    from diffsynth_qie.ui.app import guard_uploads

    handlers = UIHandlers(UIConfig(lora_dir=str(tmp_path)), editor_factory=lambda: None)
    editor = gr.ImageEditor(type="filepath", image_mode="RGBA", format="png")  # as in ui/app.py
    guard_uploads(editor, handlers)
    junk = tmp_path / "notes.png"
    junk.write_text("not an image")
    payload = editor.data_model(background=FileData(path=str(junk)), layers=[], composite=None)
    with pytest.raises(gr.Error, match="uploaded image is not a readable image"):
        editor.preprocess(payload)
    from tests.test_input_limits import png_header_only
    bomb = png_header_only(tmp_path / "bomb.png", 12000, 12000)
    payload = editor.data_model(background=FileData(path=str(bomb)), layers=[], composite=None)
    with pytest.raises(gr.Error, match="12000x12000"):
        editor.preprocess(payload)
    # a 16-bit PNG reaches the handler scaled, not clipped to white by gradio's own conversion
    vals = np.tile(np.array([0, 257 * 60, 257 * 128, 65535], np.uint16), (16, 4))
    Image.fromarray(vals).save(tmp_path / "g16.png")
    payload = editor.data_model(background=FileData(path=str(tmp_path / "g16.png")), layers=[], composite=None)
    value = editor.preprocess(payload)
    image = image_from_editor(value, max_bytes=2**20)
    assert np.asarray(image)[0, :4, 0].tolist() == [0, 60, 128, 255]


def test_temp_files_are_bounded_oldest_first(tmp_path):
    root = tmp_path / "ui-temp"
    (root / "a").mkdir(parents=True)
    now = time.time()
    files = []
    for i in range(6):  # 6 x 1000 bytes, the oldest first
        path = root / ("a" if i % 2 else "") / f"f{i}.png"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (now - 1000 + i, now - 1000 + i))
        files.append(path)
    recent = root / "in_flight.png"
    recent.write_bytes(b"x" * 1000)
    removed = prune_temp_files(root, max_bytes=3500)
    assert removed == files[:4]  # 7000 bytes -> 3000: the four oldest go
    assert [p.exists() for p in files] == [False] * 4 + [True] * 2 and recent.exists()
    assert prune_temp_files(root, max_bytes=0) == files[4:]  # files younger than a minute stay
    assert recent.exists()
    assert prune_temp_files(root, max_bytes=0, keep_seconds=0) == [recent]
    assert prune_temp_files(tmp_path / "absent", 0) == []


def test_ui_temp_dir_is_its_own_subfolder(tmp_path):
    config = UIConfig(temp_dir=str(tmp_path), port=8123, max_temp_mb=2)
    assert config.resolved_temp_dir == tmp_path / "diffsynth-qie-ui-8123" and config.max_temp_bytes == 2 * 2**20
    with pytest.raises(ValueError, match="--max_temp_mb"):
        UIConfig(max_temp_mb=0)


# --- LoRA picker ---------------------------------------------------------------------------
@pytest.fixture
def lora_tree(tmp_path):
    """A LoRA folder with nested files, decoys and symlinks (inside and escaping)."""
    root = tmp_path / "outputs"
    outside = tmp_path / "secret"
    outside.mkdir()
    lora = {"blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 4),
            "blocks.0.attn.to_q.lora_B.weight": torch.zeros(4, 2)}
    save_file(lora, str(outside / "stolen.safetensors"))
    for rel in ("run_a/epoch-1.safetensors", "run_a/epoch-2.safetensors", "run_b/deep/x/lora.safetensors",
                "top.safetensors", "run_a/notes.txt", "run_a/.epoch-3.abc.tmp.safetensors",
                ".hidden/h.safetensors", "run_a/checkpoint-4/lora.safetensors",
                "run_a/checkpoint-4/trainable.safetensors"):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        save_file(lora, str(p))
    # not LoRAs: a cache shard, a file that is not safetensors at all
    (root / "cache" / "shards").mkdir(parents=True)
    save_file({"latents": torch.zeros(1, 4), "prompt_emb": torch.zeros(2, 3)},
              str(root / "cache" / "shards" / "s0.safetensors"))
    (root / "broken.safetensors").write_bytes(b"x")
    os.symlink(root / "top.safetensors", root / "run_b" / "alias.safetensors")   # stays inside
    os.symlink(outside / "stolen.safetensors", root / "escape.safetensors")     # leaves the folder
    os.symlink(outside, root / "linked_dir")                                     # directory leaving it
    os.symlink(root / "missing.safetensors", root / "dangling.safetensors")
    return root, outside


def test_list_loras_is_recursive_relative_and_contained(lora_tree):
    root, _ = lora_tree
    assert list_loras(root) == ["run_a/checkpoint-4/lora.safetensors", "run_a/epoch-1.safetensors",
                                "run_a/epoch-2.safetensors", "run_b/alias.safetensors", "run_b/deep/x/lora.safetensors",
                                "top.safetensors"]
    assert list_loras(root / "does-not-exist") == []
    handlers = UIHandlers(UIConfig(lora_dir=str(root)))
    assert handlers.lora_choices()[0] == NO_LORA and handlers.lora_choices()[1:] == list_loras(root)


def test_resolve_lora_accepts_listed_names(lora_tree):
    root, _ = lora_tree
    for name in list_loras(root):
        path = resolve_lora(root, name)
        assert path.is_file() and path.is_relative_to(root.resolve())
    assert resolve_lora(root, "run_b/alias.safetensors") == (root / "top.safetensors").resolve()
    assert resolve_lora(root, NO_LORA) is None and resolve_lora(root, "") is None and resolve_lora(root, None) is None


@pytest.mark.parametrize("name, message", [
    ("../secret/stolen.safetensors", r"'\.\.'"),
    ("run_a/../../secret/stolen.safetensors", r"'\.\.'"),
    ("..\\secret\\stolen.safetensors", r"'\.\.'"),
    ("ABSOLUTE", "not a name inside the LoRA folder"),
    ("C:\\loras\\x.safetensors", "not a name inside the LoRA folder"),
    ("escape.safetensors", "links outside the LoRA folder"),
    ("linked_dir/stolen.safetensors", "links outside the LoRA folder"),
    ("run_a/notes.txt", "not a .safetensors file"),
    ("run_a/nope.safetensors", "no longer exists"),
    ("dangling.safetensors", "no longer exists"),
    ("run_a", "not a .safetensors file"),
])
def test_resolve_lora_refuses_traversal(lora_tree, name, message):
    root, outside = lora_tree
    if name == "ABSOLUTE":
        name = str(outside / "stolen.safetensors")
    with pytest.raises(UIError, match=message):
        resolve_lora(root, name)


# --- errors -------------------------------------------------------------------------------
def test_user_message_shows_user_errors_and_hides_internal_ones(caplog):
    assert user_message(ValueError("steps must be >= 1, got 0")) == "steps must be >= 1, got 0"
    try:
        raise RuntimeError("internal detail at /srv/secret/path.py")
    except RuntimeError as caught:
        exc = caught
    with caplog.at_level(logging.ERROR, logger="diffsynth_qie.ui.handlers"):
        msg = user_message(exc)
    assert "RuntimeError" in msg and "server log" in msg
    assert "/srv/secret" not in msg and "Traceback" not in msg
    logged = [r for r in caplog.records if r.exc_info and r.exc_info[1] is exc]
    assert len(logged) == 1  # the traceback goes to the server log
    assert "out of memory" in user_message(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))


# --- generate on the tiny model -------------------------------------------------------------
@pytest.fixture(scope="module")
def ui(tiny_model_dir, tmp_path_factory):
    """One UI state over the tiny model (loaded lazily on first generate) and a LoRA folder."""
    lora_dir = tmp_path_factory.mktemp("loras")
    dit_file = Path(tiny_model_dir) / "transformer" / "diffusion_pytorch_model.safetensors"
    _write_lora(lora_dir / "run1" / "a.safetensors", dit_file, seed=1)
    _write_lora(lora_dir / "run2" / "b.safetensors", dit_file, seed=2, targets=("to_k", "to_out.0"))
    (lora_dir / "bad.safetensors").parent.mkdir(exist_ok=True)
    from safetensors.torch import save_file
    save_file({"not_a_module.lora_A.weight": torch.zeros(2, 3), "not_a_module.lora_B.weight": torch.zeros(3, 2)},
              str(lora_dir / "bad.safetensors"))
    config = UIConfig(model="tiny", model_dir=str(tiny_model_dir), lora_dir=str(lora_dir), device="cpu",
                      outputs_dir=str(tmp_path_factory.mktemp("outputs")))
    return UIHandlers(config)


def _inputs(**kw):
    painted = (8, 8, 40, 40)
    base = dict(editor={"background": _photo(5), "layers": [_layer((W, H), [painted])], "composite": None},
                prompt="make the square blue", steps=3, cfg=2.0, seed=7)
    base.update(kw)
    return GenerateInputs(**base)


def test_generate_edits_only_the_painted_region_with_progress(ui):
    calls = []
    out = ui.generate(_inputs(), progress=lambda done, total, desc: calls.append((done, total, desc)))
    assert out.image.size == (W, H) and out.sub_image is None
    src, res = np.asarray(_photo(5)), np.asarray(out.image.convert("RGB"))
    painted = _expected((W, H), [(8, 8, 40, 40)])
    # mask_blend 1: outside the mask the input is kept exactly; inside the model repainted it.
    np.testing.assert_array_equal(res[~painted], src[~painted])
    assert np.abs(res[painted].astype(int) - src[painted].astype(int)).mean() > 5
    denoise = [(d, t) for d, t, desc in calls if "denoising" in desc]
    assert denoise[-1] == (3, 3) and [d for d, _ in denoise] == sorted(d for d, _ in denoise)
    assert "seed 7" in out.status and "mask covers 17%" in out.status
    assert "loaded" in ui.model_status()


def test_generate_lbm_returns_main_and_sub_stream(ui):
    out = ui.generate(_inputs(mode=MODE_LBM, lbm_steps=2, editor={"background": _photo(5), "layers": []}))
    assert out.image.size == (W, H) and out.sub_image is not None and out.sub_image.size == (W, H)
    assert out.result.latents.shape[0] == 2  # main + sub stream in one batch
    assert not np.array_equal(np.asarray(out.image), np.asarray(out.sub_image))
    assert "LBM, 2 steps" in out.status and "no mask painted" in out.status


def test_switching_lora_keeps_the_base_model_loaded(ui):
    runs = {}
    for name in (NO_LORA, "run1/a.safetensors", "run2/b.safetensors", NO_LORA + "again"):
        lora = NO_LORA if name.startswith(NO_LORA) else name
        runs[name] = ui.generate(_inputs(lora=lora, lora_scale=1.0)).result.latents
        if name == NO_LORA:
            pipe, dit = ui.editor().pipe, ui.editor().pipe.dit
    assert ui.load_count == 1
    assert ui.editor().pipe is pipe and ui.editor().pipe.dit is dit
    base = runs[NO_LORA]
    assert (runs["run1/a.safetensors"] - base).abs().max() > 1e-3
    assert (runs["run2/b.safetensors"] - runs["run1/a.safetensors"]).abs().max() > 1e-3
    torch.testing.assert_close(runs[NO_LORA + "again"], base, rtol=0, atol=0)  # base weights restored
    ui.generate(_inputs(lora="run1/a.safetensors", lora_scale=0.5))
    assert [(p.name, s) for p, s in ui.editor().active_loras] == [("a.safetensors", 0.5)]


def test_a_lora_branch_off_its_layers_device_is_refused_after_the_switch(ui, monkeypatch):
    """The UI's LoRA switch (`Editor.set_loras`, as `qie edit`'s preflight runs it on the fake GPU) is checked on the
    real model: a branch left off its layer's device (planted: on the meta device, standing in for the host beside a
    GPU weight on this CPU-only machine) stops the generation before the edit, as a bug, with the module named."""
    import sys

    from diffsynth_qie.lora import branch, manager

    sys.path.insert(0, str(Path(__file__).parent / "memory"))
    from edit_planting import plant

    ui.generate(_inputs(lora=NO_LORA))  # loaded, no LoRA
    plant(monkeypatch, branch, "attach", "lora.A.to(device=weight.device, dtype=dtype)",
          "lora.A.to(device='meta', dtype=dtype)", also=(manager,))
    try:
        with pytest.raises(RuntimeError, match=r"LoRA branch off its layer's device: Editor\.set_loras left the "
                                               r"branch of transformer_blocks\.\d+\.\S+ \(\(\d+, \d+\), float32\) on "
                                               r"meta while the layer's weight is on cpu"):
            ui.generate(_inputs(lora="run1/a.safetensors", lora_scale=1.0))
    finally:
        ui.editor().set_loras([])


def test_generate_errors_are_user_messages(ui):
    with pytest.raises(UIError, match="type a prompt"):
        ui.generate(_inputs(prompt="  "))
    with pytest.raises(UIError, match="steps must be a whole number in 1..1000"):
        ui.generate(_inputs(steps=0))
    with pytest.raises(UIError, match="LBM steps"):
        ui.generate(_inputs(mode=MODE_LBM, lbm_steps=5))
    with pytest.raises(UIError, match="outside the LoRA folder"):
        ui.generate(_inputs(lora="../../etc/passwd.safetensors"))
    with pytest.raises(ValueError) as info:  # a LoRA that does not fit the model: named, not ignored
        ui.generate(_inputs(lora="bad.safetensors"))
    msg = user_message(info.value)
    assert "not_a_module" in msg and "Traceback" not in msg
    assert ui.load_count == 1


def test_generate_refuses_long_prompt(ui):
    with pytest.raises(ValueError, match=r"tokens .*limit of 1024.*--max_prompt_tokens"):
        ui.generate(_inputs(prompt="make it blue " * 2000))


def test_background_load_loads_once_and_reports_status():
    import threading

    calls, gate = [], threading.Event()

    def factory():
        calls.append(1)
        gate.wait(5)
        return object()

    handlers = UIHandlers(UIConfig(), editor_factory=factory)
    assert "loads on the first Generate" in handlers.model_status()
    thread = handlers.start_background_load()
    assert "loading in the background" in handlers.model_status()
    got = []
    waiter = threading.Thread(target=lambda: got.append(handlers.editor()))  # a Generate arriving meanwhile
    waiter.start()
    gate.set()
    thread.join(5)
    waiter.join(5)
    assert len(calls) == 1 and handlers.load_count == 1 and got == [handlers.editor()]
    assert "loaded in" in handlers.model_status()

    def broken():
        raise RuntimeError("weights missing")

    failing = UIHandlers(UIConfig(), editor_factory=broken)
    failing.start_background_load().join(5)
    status = failing.model_status()
    assert not failing.loaded and "failed to load" in status and "internal error (RuntimeError)" in status


def test_ui_flags_defaults_and_validation():
    import argparse
    import subprocess
    import sys

    from diffsynth_qie.utils.config_cli import add_dataclass_args, dataclass_from_args

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, UIConfig)
    default = dataclass_from_args(UIConfig, parser.parse_args([]))
    assert (default.host, default.port, default.share, default.model, default.lora_dir) == \
        ("127.0.0.1", 7999, False, "tiny", "./outputs")
    cfg = dataclass_from_args(UIConfig, parser.parse_args(
        ["--port", "8123", "--share", "--model", "2511", "--max_upload_mb", "2", "--no-preload"]))
    assert (cfg.port, cfg.share, cfg.model, cfg.max_upload_bytes, cfg.preload) == (8123, True, "2511", 2 * 2**20, False)
    assert cfg.transport_cap_bytes > cfg.max_upload_bytes
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        UIConfig(model="nope")
    with pytest.raises(ValueError, match="--port 0"):
        UIConfig(port=0)
    for flag in ("device", "text_encoder_device", "vae_device", "dit_device"):  # checked before anything loads
        with pytest.raises(ValueError, match=f"--{flag} tpu:7 is not a device of this machine; choose one of cpu"):
            UIConfig(**{flag: "tpu:7"})
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "app_gradio.py"), "--model", "nope"], cwd=repo,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown model preset 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_variations_use_consecutive_seeds_and_save_reproducible_pngs(ui):
    from diffsynth_qie.ui.results import read_settings

    out = ui.generate(_inputs(seed=11, variations=2, lora="run1/a.safetensors", lora_scale=0.5))
    assert [e.settings.seed for e in out.entries] == [11, 12] and "seeds 11–12" in out.status
    first, second = (np.asarray(Image.open(e.image)) for e in out.entries)
    assert first.shape == (H, W, 3) and not np.array_equal(first, second)
    np.testing.assert_array_equal(first, np.asarray(out.image))
    settings = read_settings(out.entries[1].image)
    assert (settings.seed, settings.lora, settings.lora_scale, settings.steps) == (12, "run1/a.safetensors", 0.5, 3)
    assert Path(out.entries[0].image).name == "edit_seed11_run1-a.png"
    before = Image.open(out.entries[0].before)
    assert before.size == (W, H)
    mask = np.asarray(Image.open(out.entries[0].mask))
    np.testing.assert_array_equal(mask == 255, _expected((W, H), [(8, 8, 40, 40)]))
    assert "--seed 12" in out.entries[1].command and "--mask " + out.entries[1].mask in out.entries[1].command


def test_stop_ends_a_generation_at_its_next_step(ui):
    from diffsynth_qie.ui.handlers import Stopped

    steps_seen = []

    def progress(done, total, desc):
        steps_seen.append(done)
        if done == 2:
            ui.request_stop()  # as the Stop button does, from another thread

    with pytest.raises(Stopped, match="Stopped at step 3 of variation 1/3"):
        ui.generate(_inputs(steps=20, variations=3), progress=progress, session="tab-a")
    assert max(steps_seen) <= 3, steps_seen  # 3 variations x 20 steps were asked for
    out = ui.generate(_inputs(steps=2))  # the next Generate runs normally
    assert "2 steps" in out.status

    # Another tab's Stop leaves this tab's generation alone.
    steps_seen.clear()

    def other_tab_stops(done, total, desc):
        steps_seen.append(done)
        if done == 1:
            ui.request_stop("tab-b")

    out = ui.generate(_inputs(steps=3), progress=other_tab_stops, session="tab-a")
    assert "3 steps" in out.status and max(steps_seen) == 3

    # A Stop for a generation still queued stops it as it starts; one that found nothing to stop is forgotten.
    steps_seen.clear()
    with pytest.raises(Stopped):
        ui.generate(_inputs(steps=3), progress=lambda done, total, desc: steps_seen.append(done), session="tab-b")
    assert [d for d in steps_seen if d > 0] == []
    ui.request_stop("tab-c")
    ui.forget_stop("tab-c")
    assert "3 steps" in ui.generate(_inputs(steps=3), session="tab-c").status


# --- runs that fail, stop or go away; results kept on disk -------------------------------------------
def test_prompt_tokens_are_refused_before_queueing_once_the_model_is_loaded(ui):
    """The token limit is a precheck (a toast before the queue), not an error inside the run."""
    ui.editor()
    with pytest.raises(UIError, match=r"tokens .*limit of 1024"):
        ui.check(_inputs(prompt="make it blue " * 2000))


def test_a_failed_run_keeps_the_result_and_says_so(ui, monkeypatch):
    """An error inside the run was raised as gr.Error, which blanked the result ("Error") and left
    Generate locked. Now the run answers with a status (and a toast), and the outputs on screen are left as they are."""
    import gradio as gr

    from diffsynth_qie.ui.events import Callbacks

    cb = Callbacks(ui)
    monkeypatch.setattr(cb, "named", lambda values: {"history": [], "queued_at": None})
    monkeypatch.setattr(cb, "inputs", lambda values: _inputs(lora="bad.safetensors"))  # fails inside the run
    *_, out = cb.run({}, None, progress=lambda *a, **k: None)  # a generator: its last yield is the outcome
    shown = out[:6]
    assert all(isinstance(v, dict) and v.get("__type__") == "update" and len(v) == 1 for v in shown), shown
    assert out[6].startswith("Failed: ") and "not_a_module" in out[6]
    assert cb.finished(None)[0] == gr.update(interactive=True)


def test_stop_keeps_the_finished_variations(ui):
    """Stop threw away the variations that had finished."""
    def progress(done, total, desc):
        if desc.startswith("variation 2/3") and done == 1:
            ui.request_stop()

    out = ui.generate(_inputs(steps=3, variations=3), progress=progress, session="tab-s")
    assert [e.settings.seed for e in out.entries] == [7]
    assert out.status.startswith("Stopped at step 2 of variation 2/3; kept the 1 finished"), out.status
    assert "seed 7 ·" in out.status


def test_progress_names_the_variation_and_the_time_left(ui):
    descs = []
    ui.generate(_inputs(steps=2, variations=2), progress=lambda d, t, desc: descs.append(desc))
    assert descs[0].startswith("variation 1/2") and any(d.startswith("variation 2/2") for d in descs)
    assert any("s left" in d for d in descs), descs


def test_a_closed_tab_stops_its_generation(ui):
    """A closed tab's job ran to its end while everyone else waited."""
    from types import SimpleNamespace

    from diffsynth_qie.ui.events import Callbacks

    cb = Callbacks(ui)
    gone = SimpleNamespace(session_hash="closed-tab")
    cb._pending.add("closed-tab")  # as the precheck records a queued generation
    cb.disconnect(gone)
    with pytest.raises(Stopped, match="Stopped before it started"):
        ui.generate(_inputs(), session="closed-tab")
    cb.disconnect(SimpleNamespace(session_hash="idle-tab"))  # nothing queued: the next Generate runs
    assert "3 steps" in ui.generate(_inputs(), session="idle-tab").status


def test_results_are_kept_on_disk_and_come_back(ui, tmp_path):
    """Results, inputs, mask and references kept in --outputs_dir, the history rebuilt from
    it, the command with every file (references included) by absolute path, the PNG text naming the references."""
    import shlex

    from diffsynth_qie.commands.edit import add_arguments
    from diffsynth_qie.ui import history as hist
    from diffsynth_qie.ui import restore as back
    from diffsynth_qie.ui.results import read_extras

    ref = tmp_path / "ref.png"
    _photo(9, (32, 32)).save(ref)
    out = ui.generate(_inputs(references=[(str(ref), None)], mask_invert=True, mask_grow=2, seed=21))
    entry = out.entries[0]
    root = ui.config.resolved_outputs_dir
    assert Path(entry.image).is_relative_to(root) and "1 reference image" in out.status
    files, command = read_extras(entry.image)
    assert command == entry.command and len(files["references"]) == 1 and Path(files["references"][0]).is_file()
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(shlex.split(entry.command)[2:])
    assert args.image == [entry.input, files["references"][0]] and all(Path(p).is_absolute() for p in args.image)
    assert Path(args.mask).is_absolute() and Path(args.mask).is_file()
    # a restart or reload: the history comes back from the folder
    saved = hist.load_saved(root)
    again = next(e for e in saved if e.image == entry.image)
    assert (again.settings, again.command, again.input, again.references) == \
        (entry.settings, entry.command, entry.input, entry.references)
    # a dropped PNG brings its settings and files back; restored, they give the same mask
    settings, restored = back.from_png(entry.image, root)
    assert settings == entry.settings and restored["image"] == entry.input
    job = ui.check(_inputs(editor={"background": restored["image"], "layers": [], "composite": None},
                           mask_file=restored["mask"], mask_invert=True, mask_grow=2, seed=21))
    np.testing.assert_array_equal(np.asarray(job.mask), np.asarray(Image.open(entry.mask)))
    other = tmp_path / "not-ours.png"
    _photo().save(other)
    with pytest.raises(UIError, match="carries no diffsynth-qie settings"):
        back.from_png(other, root)
