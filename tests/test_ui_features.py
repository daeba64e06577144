"""The web UI's pieces without a browser: LoRA labels, samplers, results and their PNG text, the `qie edit`
command, history, examples, mask tools, and the bugs a new user hit (each test failed before its fix)."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffsynth_qie.ui.config import UIConfig
from diffsynth_qie.ui.handlers import MODE_FLOW, MODE_LBM, MODE_LIGHTNING, NO_LORA, GenerateInputs, UIHandlers
from diffsynth_qie.ui.uploads import UIError


def _lora(path: Path, metadata: dict | None = None) -> Path:
    from diffsynth_qie.lora import save_lora

    sd = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 8),
          "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 4)}
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_lora(path, sd, metadata=metadata)


def _photo(size=(64, 48), seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


# --- LoRA picker from the files' metadata -------------------------------------------------
def test_lora_labels_sampler_and_mismatch_come_from_metadata(tmp_path):
    _lora(tmp_path / "lora.safetensors", {"loss": "sft", "preset": "2511", "step": 800})
    _lora(tmp_path / "lbm" / "lora.safetensors", {"loss": "lbm", "preset": "2509", "step": 40})
    _lora(tmp_path / "other.safetensors")  # no metadata: listed by name only
    h = UIHandlers(UIConfig(model="2511", lora_dir=str(tmp_path), examples=""))
    labels = dict((name, label) for label, name in h.lora_options())
    assert labels["lora.safetensors"] == "lora.safetensors · flow matching · 2511 · rank 4 · step 800"
    assert labels["lbm/lora.safetensors"].startswith("lbm/lora.safetensors · LBM · 2509 · rank 4 · step 40")
    assert labels["lbm/lora.safetensors"].endswith("⚠ other model")   # trained on 2509, served on 2511
    assert labels["other.safetensors"] == "other.safetensors · rank 4" and labels[NO_LORA] == NO_LORA
    assert "trained on **2509**" in h.lora_status("lbm/lora.safetensors")
    assert "⚠" not in h.lora_status("lora.safetensors")
    # An LBM LoRA picks the LBM sampler; a flow-matching one leaves LBM; an unknown one changes nothing.
    assert h.mode_for_lora("lbm/lora.safetensors", MODE_FLOW) == MODE_LBM
    assert h.mode_for_lora("lora.safetensors", MODE_LBM) == MODE_FLOW
    assert h.mode_for_lora("other.safetensors", MODE_LBM) == MODE_LBM
    # The run's own LoRA is pre-selected (as the training scripts' `try it:` line starts the UI); --lora wins.
    assert h.default_lora() == "lora.safetensors"
    assert UIHandlers(UIConfig(lora_dir=str(tmp_path), lora="other.safetensors")).default_lora() == "other.safetensors"
    assert UIHandlers(UIConfig(lora_dir=str(tmp_path / "lbm" / "none"))).default_lora() == NO_LORA


def test_lightning_is_offered_only_when_it_can_run(tmp_path):
    """Bug 6: the Lightning sampler was selectable without any Lightning LoRA."""
    _lora(tmp_path / "run" / "lora.safetensors", {"loss": "sft"})
    h = UIHandlers(UIConfig(lora_dir=str(tmp_path), examples=""))
    assert [m for _, m in h.mode_choices()] == [MODE_FLOW, MODE_LBM]
    with pytest.raises(UIError, match="needs a Lightning LoRA"):
        h.check(GenerateInputs(editor={"background": _photo(), "layers": []}, prompt="x", mode=MODE_LIGHTNING))
    _lora(tmp_path / "Qwen-Image-Edit-Lightning-8steps.safetensors")
    assert [m for _, m in h.mode_choices()] == [MODE_FLOW, MODE_LBM, MODE_LIGHTNING]
    job = h.check(GenerateInputs(editor={"background": _photo(), "layers": []}, prompt="x", mode=MODE_LIGHTNING,
                                 steps=40))
    assert (job.settings.steps, job.settings.cfg, job.scheduler) == (8, 1.0, "lightning")
    assert [p.name for p, _ in job.loras] == ["Qwen-Image-Edit-Lightning-8steps.safetensors"]  # found in the folder
    assert job.lightning_lora == job.loras[0][0]
    picked = h.check(GenerateInputs(editor={"background": _photo(), "layers": []}, prompt="x", mode=MODE_LIGHTNING,
                                    lora="Qwen-Image-Edit-Lightning-8steps.safetensors"))
    assert len(picked.loras) == 1 and picked.lightning_lora is None  # picked by the user: not stacked again


# --- sampler switching ------------------------------------------------------------------------
def test_leaving_lightning_gives_the_steps_back():
    """Bug 4: Lightning set steps to 8, and they stayed 8 after switching back to flow matching."""
    from diffsynth_qie.ui.events import steps_for_mode

    steps, saved = steps_for_mode(MODE_LIGHTNING, MODE_FLOW, 28, None)
    assert (steps, saved) == (8, 28)
    assert steps_for_mode(MODE_FLOW, MODE_LIGHTNING, steps, saved) == (28, 28)
    assert steps_for_mode(MODE_LBM, MODE_LIGHTNING, 8, 28)[0] == 28
    assert steps_for_mode(MODE_LBM, MODE_FLOW, 17, None) == (17, None)


# --- checks before queueing ------------------------------------------------------------------
def test_check_refuses_before_any_model_load(tmp_path):
    """Bug 5: a refused Generate is decided without the model (and before the queue)."""
    h = UIHandlers(UIConfig(lora_dir=str(tmp_path), examples=""), editor_factory=lambda: pytest.fail("loaded"))
    editor = {"background": _photo(), "layers": []}
    for inputs, message in ((GenerateInputs(editor=editor, prompt=" \u200b"), "type a prompt"),
                            (GenerateInputs(editor=None, prompt="x"), "upload an image"),
                            (GenerateInputs(editor=editor, prompt="x", variations=9), "variations"),
                            (GenerateInputs(editor=editor, prompt="x", mask_invert=True), "Invert mask")):
        with pytest.raises(UIError, match=message):
            h.check(inputs)
    job = h.check(GenerateInputs(editor=editor, prompt="x", seed=5, variations=3))
    assert job.seeds == [5, 6, 7] and h.load_count == 0


def test_missing_weights_message_reaches_status_and_toast(tmp_path):
    """Bug 1: with no weights the user saw "internal error (FileNotFoundError)"; the missing files and the
    download command reached only the log."""
    from diffsynth_qie.ui.handlers import user_message

    h = UIHandlers(UIConfig(model="2511", model_dir=str(tmp_path / "empty"), lora_dir=str(tmp_path), examples=""))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as info:
        h.generate(GenerateInputs(editor={"background": _photo(), "layers": []}, prompt="x"))
    toast = user_message(info.value)
    assert "modelscope download --model Qwen/Qwen-Image-Edit-2511" in toast and "internal error" not in toast
    status = h.model_status()
    assert "failed to load" in status and "modelscope download --model Qwen/Qwen-Image-Edit-2511" in status


# --- results: names, PNG text, the `qie edit` command -------------------------------------------
def test_result_png_carries_its_settings_and_the_command_repeats_it(tmp_path):
    from diffsynth_qie.cli import build_parser
    from diffsynth_qie.ui.results import EditSettings, qie_edit_command, read_settings, save_png

    s = EditSettings(prompt="make it 'blue'", model="2511", mode=MODE_FLOW, steps=28, cfg=2.5, seed=42,
                     lora="run1/lora.safetensors", lora_scale=0.8, lora2="style.safetensors", lora2_scale=0.5,
                     strength=0.7, mask_feather=3.0)
    path = save_png(_photo(), tmp_path, s)
    assert path.name == "edit_seed42_run1-lora.png"
    assert read_settings(path) == s
    with Image.open(path) as im:
        summary = im.text["parameters"]
    assert "make it 'blue'" in summary and "LoRA run1/lora.safetensors × 0.8" in summary
    command = qie_edit_command(s, "in.png", "mask.png", lora_dir="outs", model_dir="/m", out="o.png")
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert (args.prompt, args.steps, args.cfg, args.seed, args.strength, args.mask_feather) == \
        ("make it 'blue'", 28, 2.5, 42, 0.7, 3.0)
    # absolute paths: the command runs from any folder, in a fresh shell (this environment's own `qie`)
    outs = Path("outs").absolute()
    assert args.lora == [str(outs / "run1/lora.safetensors"), str(outs / "style.safetensors")]
    assert args.lora_scale == [0.8, 0.5]
    assert (args.image, args.mask, args.model, args.model_dir, args.out) == \
        ([str(Path("in.png").absolute())], str(Path("mask.png").absolute()), "2511", "/m", "o.png")
    assert shlex.split(command)[0] == str(Path(sys.executable).parent / "qie")
    # the reference images follow the edited image as further --image flags
    with_refs = qie_edit_command(s, "in.png", None, lora_dir="outs", references=["r 1.png", "/abs/r2.png"])
    assert build_parser().parse_args(shlex.split(with_refs)[1:]).image == \
        [str(Path("in.png").absolute()), str(Path("r 1.png").absolute()), "/abs/r2.png"]
    lbm = qie_edit_command(EditSettings(prompt="p", model="tiny", mode=MODE_LBM, lbm_steps=2), "i.png", None,
                           lora_dir=".")
    args = build_parser().parse_args(shlex.split(lbm)[1:])
    assert args.lbm_steps == 2 and args.mask is None and args.out == "edit-lbm_seed0.png"


def test_history_restores_settings_newest_first():
    from diffsynth_qie.ui import history as hist
    from diffsynth_qie.ui.results import EditSettings

    entries = [hist.HistoryEntry(image=f"{i}.png", before="b.png", settings=EditSettings(prompt=f"p{i}", model="tiny",
                                                                                         seed=i, lora="a.safetensors"))
               for i in range(hist.MAX_ENTRIES + 3)]
    history = hist.add(None, entries[:2])
    history = hist.add(history, entries[2:])
    assert len(history) == hist.MAX_ENTRIES and history[0].settings.seed == 2 and history[-1].settings.seed == 49
    # the caption starts with what tells entries apart (seed, sampler, LoRA), then the prompt
    assert hist.gallery(history)[0] == ("2.png", "seed 2 · flow matching, 40 steps, CFG 4 · a.safetensors · p2")
    values = dict(zip(hist.RESTORED, hist.restore(history[0], [NO_LORA, "a.safetensors"])))
    assert (values["prompt"], values["seed"], values["lora"]) == ("p2", 2, "a.safetensors")
    assert dict(zip(hist.RESTORED, hist.restore(history[0], [NO_LORA])))["lora"] == NO_LORA  # since deleted
    assert hist.editor_value("r.png") == {"background": "r.png", "layers": [], "composite": "r.png"}


# --- examples ------------------------------------------------------------------------------------
def test_examples_from_held_out_rows(tmp_path):
    from diffsynth_qie.data.demo import make_recolour_demo
    from diffsynth_qie.ui.examples import examples_file, load_examples

    # auto: the demo's held-out rows under the LoRA folder, else (tiny models) a fresh copy; none for real models.
    trained = make_recolour_demo(tmp_path / "outputs" / "demo-red-circle-blue", num_pairs=1, num_heldout=3)
    assert examples_file("auto", str(tmp_path / "outputs"), "tiny", tmp_path / "t") == trained / "heldout.json"
    fresh = examples_file("auto", str(tmp_path / "none"), "tiny", tmp_path / "t")
    assert fresh.is_file() and fresh.is_relative_to(tmp_path / "t")
    assert examples_file("auto", str(tmp_path / "none"), "2511", tmp_path / "t") is None
    assert examples_file("", str(tmp_path), "tiny", tmp_path / "t") is None
    with pytest.raises(ValueError, match="--examples .*missing.json is not a file"):
        examples_file(str(tmp_path / "missing.json"), str(tmp_path), "tiny", tmp_path / "t")
    rows = json.loads((trained / "heldout.json").read_text())
    (trained / rows[1]["edit_image"][0]).unlink()  # a broken row is skipped, not fatal
    examples = load_examples(trained / "heldout.json")
    assert [Path(e.image).name for e in examples] == ["heldout_000_src.png", "heldout_002_src.png"]
    assert all(Path(e.mask).is_file() and e.prompt == "make the red circle blue" for e in examples)


# --- mask tools ------------------------------------------------------------------------------------
def test_mask_tools_union_invert_grow_and_clear(tmp_path):
    from diffsynth_qie.ui import masks

    size = (40, 30)
    painted = np.zeros((30, 40), np.uint8)
    painted[5:10, 5:10] = 255
    file_mask = np.zeros((15, 20), np.uint8)  # half size: scaled to the image
    file_mask[10:15, 15:20] = 255
    union = np.asarray(masks.combine(Image.fromarray(painted), Image.fromarray(file_mask), size))
    expected = painted.copy()
    expected[20:30, 30:40] = 255
    np.testing.assert_array_equal(union, expected)
    inverted = np.asarray(masks.combine(Image.fromarray(painted), None, size, invert=True))
    np.testing.assert_array_equal(inverted, 255 - painted)
    assert masks.combine(None, None, size) is None
    grown = np.asarray(masks.grow_mask(Image.fromarray(painted), 2))
    assert grown[3:12, 3:12].all() and grown.sum() == 9 * 9 * 255
    assert masks.brush_size((1024, 768)) == 61 and masks.brush_size((64, 48)) == 4 and masks.brush_size((8, 8)) == 2
    with pytest.raises(UIError, match="the mask file is 20x20 but the image is 40x30: it belongs to another image"):
        masks.combine(None, Image.new("L", (20, 20)), size)
    _photo(size).save(tmp_path / "img.png")
    cleared = masks.clear({"background": str(tmp_path / "img.png"), "layers": []}, tmp_path / "ed")
    assert cleared["layers"] == [] and cleared["background"] != str(tmp_path / "img.png")
    np.testing.assert_array_equal(np.asarray(Image.open(cleared["background"])), np.asarray(_photo(size)))


def test_generate_uses_the_image_the_editor_was_given(tmp_path):
    """The editor loads an example (or "Edit this result", "Clear paint") with no event saying when, and until then
    sends what it held: the image the user sees is used, without the old image's paint; a newer upload or fresh
    paint is used as sent; a file the UI did not serve is never read."""
    from diffsynth_qie.ui import masks

    h = UIHandlers(UIConfig(lora_dir=str(tmp_path), examples="", temp_dir=str(tmp_path / "t")))
    old, new = _photo(seed=1), _photo(seed=2)
    given = h.config.resolved_temp_dir / "given.png"
    given.parent.mkdir(parents=True)
    new.save(given)
    layer = np.zeros((48, 64, 4), np.uint8)
    layer[:8, :8] = 255
    stale = {"background": old, "layers": [layer]}
    record = masks.loaded_record(str(given), stale)
    job = h.check(GenerateInputs(editor=stale, prompt="x", loaded_image=record))
    assert np.array_equal(np.asarray(job.image), np.asarray(new)) and job.mask is None
    painted = {"background": new, "layers": [layer]}  # the given image, painted since
    job = h.check(GenerateInputs(editor=painted, prompt="x", loaded_image=record))
    assert np.array_equal(np.asarray(job.image), np.asarray(new)) and job.mask is not None
    mine = {"background": _photo(seed=3), "layers": []}  # the user's own upload since
    job = h.check(GenerateInputs(editor=mine, prompt="x", loaded_image=record))
    assert np.array_equal(np.asarray(job.image), np.asarray(_photo(seed=3)))
    secret = tmp_path / "secret.png"
    new.save(secret)
    job = h.check(GenerateInputs(editor=stale, prompt="x", loaded_image=masks.loaded_record(str(secret), stale)))
    assert np.array_equal(np.asarray(job.image), np.asarray(old)) and job.mask is not None
    h.known_images = frozenset({str(secret)})  # an example's image outside the temp folder
    job = h.check(GenerateInputs(editor=stale, prompt="x", loaded_image=masks.loaded_record(str(secret), stale)))
    assert np.array_equal(np.asarray(job.image), np.asarray(new))


# --- defaults and checks that follow the model -----------------------------------------------
def test_a_21_model_gets_its_own_defaults_and_lbm_only_where_its_family_has_it(tmp_path, monkeypatch):
    from diffsynth_qie.models.family import QWEN21
    from diffsynth_qie.models.family_ops import ops_for
    from diffsynth_qie.ui.lora_picker import LoraInfo
    from diffsynth_qie.ui.model_fit import (check_lora_size, check_sampler, default_cfg, family_label,
                                            licence_note)
    from diffsynth_qie.ui.startup import random_label

    h = UIHandlers(UIConfig(model="tiny-2.1", lora_dir=str(tmp_path), examples=""))
    assert MODE_LBM in [value for _, value in h.mode_choices()]  # 2.1 has an LBM path
    check_sampler("tiny-2.1", MODE_LBM)
    monkeypatch.setattr(type(ops_for(QWEN21)), "supports_lbm", False)  # a family without one
    assert MODE_LBM not in [value for _, value in h.mode_choices()]
    assert MODE_LBM in [value for _, value in UIHandlers(UIConfig(lora_dir=str(tmp_path))).mode_choices()]
    with pytest.raises(UIError, match="tiny-2.1 is Qwen-Image-2.1, which has no LBM sampler"):
        check_sampler("tiny-2.1", MODE_LBM)
    editor = {"background": _photo(), "layers": []}
    with pytest.raises(UIError, match="LBM"):  # refused by the precheck, before any model load
        UIHandlers(UIConfig(model="tiny-2.1", lora_dir=str(tmp_path), examples=""),
                   editor_factory=lambda: pytest.fail("loaded")).check(
            GenerateInputs(editor=editor, prompt="x", mode=MODE_LBM))
    assert default_cfg("tiny-2.1") == 1.0 and default_cfg("2511") == 4.0
    assert family_label("tiny-2.1") == "Qwen-Image-2.1" and family_label("tiny") == "Qwen-Image-Edit"
    assert "non-commercial" in licence_note("2.1") and "non-commercial" in licence_note("tiny-2.1")
    assert licence_note("2511") == ""
    assert "random weights" in random_label("tiny-2.1", None) and random_label("2511", None) == ""
    with pytest.raises(UIError, match="another size"):  # a tiny LoRA cannot load on a real model
        check_lora_size("2511", LoraInfo(name="t.safetensors", preset="tiny"))
    check_lora_size("2511", LoraInfo(name="r.safetensors", preset="2509"))  # same size: a warning only


def test_an_examples_row_brings_every_reference_in_order(tmp_path):
    """A multi-image row: its first image goes to the editor, the others to the references gallery, in order."""
    from PIL import Image

    from diffsynth_qie.ui.examples import load_examples

    for name, colour in (("src.png", "red"), ("person.png", "green"), ("garment.png", "blue"), ("t.png", "white")):
        Image.new("RGB", (32, 32), colour).save(tmp_path / name)
    (tmp_path / "meta.json").write_text(json.dumps([
        {"prompt": "dress the person", "image": "t.png", "edit_image": ["src.png", "person.png", "garment.png"]},
        {"prompt": "one image", "image": "t.png", "edit_image": ["src.png"]}]))
    multi, single = load_examples(tmp_path / "meta.json")
    assert Path(multi.image).name == "src.png"
    assert [Path(p).name for p in multi.references] == ["person.png", "garment.png"]
    assert single.references == ()
