""""Select object": a SAM checkpoint found and loaded offline, a click turned into a mask of the image's size in
the right coordinate frame, the button shown only with a checkpoint, and a wrong folder refused in one line.

The checkpoint is a tiny random ``SamModel`` saved with its processor: its masks mean nothing, so these tests
check the plumbing, not the segmentation."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffsynth_qie.inference.segment import Segmenter, check_sam_dir, resolve_sam_dir

EDGE = 64  # the tiny processor's longest side (SAM's own is 1024)


def save_tiny_sam(folder: Path) -> Path:
    from transformers import SamConfig, SamImageProcessor, SamModel, SamProcessor
    from transformers.models.sam.configuration_sam import (SamMaskDecoderConfig, SamPromptEncoderConfig,
                                                           SamVisionConfig)

    vision = SamVisionConfig(hidden_size=16, output_channels=8, num_hidden_layers=1, num_attention_heads=1,
                             image_size=EDGE, patch_size=8, mlp_dim=16, global_attn_indexes=[0], num_pos_feats=4)
    prompt = SamPromptEncoderConfig(hidden_size=8, image_size=EDGE, patch_size=8, mask_input_channels=4)
    decoder = SamMaskDecoderConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, mlp_dim=16,
                                   iou_head_hidden_dim=8)
    model = SamModel(SamConfig(vision_config=vision, prompt_encoder_config=prompt, mask_decoder_config=decoder))
    torch.manual_seed(2)  # SAM's own init gives near-zero logits here: one mask for every click; these differ
    with torch.no_grad():
        for weight in (p for p in model.parameters() if p.dim() > 1):
            weight.normal_(0, 0.2)
    model.save_pretrained(folder)
    SamProcessor(image_processor=SamImageProcessor(size={"longest_edge": EDGE}, pad_size={"height": EDGE,
                                                                                           "width": EDGE})) \
        .save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sam_dir(tmp_path_factory) -> Path:
    return save_tiny_sam(tmp_path_factory.mktemp("sam") / "tiny-sam")


def _photo(size=(80, 50), seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


# --- finding and loading the checkpoint ----------------------------------------------------------
def test_the_checkpoint_loads_offline_from_its_folder(sam_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert check_sam_dir(sam_dir) == sam_dir and resolve_sam_dir(str(sam_dir)) == sam_dir
    model, processor = Segmenter(sam_dir, "cpu").load()
    assert type(model).__name__ == "SamModel" and not model.training
    assert processor.image_processor.size["longest_edge"] == EDGE


@pytest.mark.parametrize("problem", ["missing", "not_sam", "no_weights", "bad_json"])
def test_a_wrong_folder_is_one_line_naming_the_flag_and_the_fix(tmp_path, sam_dir, problem):
    folder = tmp_path / problem
    if problem != "missing":
        folder.mkdir()
        config = json.loads((sam_dir / "config.json").read_text())
        text = {"not_sam": json.dumps({**config, "model_type": "clip"}), "bad_json": "{"}.get(problem)
        (folder / "config.json").write_text(text or json.dumps(config))
        if problem == "not_sam":
            (folder / "model.safetensors").write_bytes((sam_dir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError) as err:
        check_sam_dir(folder)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"--sam_model {folder}") and "facebook/sam-vit-base" in message


def test_the_ui_refuses_a_wrong_folder_at_start_in_one_line(tmp_path, capsys):
    import app_gradio

    with pytest.raises(SystemExit) as done:
        app_gradio.main(["--sam_model", str(tmp_path / "nowhere"), "--temp_dir", str(tmp_path)])
    assert done.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"--sam_model {tmp_path / 'nowhere'}: no config.json there" in errors[0]


def test_off_and_auto_look_only_at_what_is_on_disk(tmp_path, sam_dir, monkeypatch):
    from huggingface_hub import constants

    assert resolve_sam_dir("") is None and resolve_sam_dir(None) is None and resolve_sam_dir("none") is None
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_sam_dir("auto") is None  # an empty cache: no button
    snapshot = tmp_path / "hub" / "models--facebook--sam-vit-base" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text((sam_dir / "config.json").read_text())
    assert resolve_sam_dir("auto") is None  # config only (a partial download): no button
    for f in sam_dir.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    assert resolve_sam_dir("auto") == snapshot


# --- a click -------------------------------------------------------------------------------------
def test_a_click_is_the_models_best_mask_at_the_images_size(sam_dir):
    """The click goes through the model as transformers documents SAM's use (processor, model with pixel values,
    post_process_masks, best IoU score); the mask is binary "L" at the image's size."""
    from transformers import SamModel, SamProcessor

    image, point = _photo(), (10, 30)
    mask = Segmenter(sam_dir, "cpu").select(image, point)
    assert mask.mode == "L" and mask.size == image.size and set(np.unique(np.asarray(mask))) <= {0, 255}

    model, processor = SamModel.from_pretrained(sam_dir).eval(), SamProcessor.from_pretrained(sam_dir)
    inputs = processor(images=image, input_points=[[list(point)]], return_tensors="pt")
    with torch.no_grad():
        out = model(**{**inputs, "input_points": inputs["input_points"].float()}, multimask_output=True)
    masks = processor.image_processor.post_process_masks(out.pred_masks, inputs["original_sizes"],
                                                         inputs["reshaped_input_sizes"])[0][0]
    expected = masks[int(out.iou_scores[0, 0].argmax())].numpy()
    assert any(not np.array_equal(expected, m.numpy()) for m in masks)  # so the best is told from the others
    np.testing.assert_array_equal(np.asarray(mask) == 255, expected)


def test_the_point_reaches_the_model_in_the_resized_images_frame(sam_dir):
    """(x, y) in the image's pixels, scaled by the processor's resize (longest side to EDGE): a swapped x/y or an
    unscaled point would land elsewhere on this non-square image."""
    seg = Segmenter(sam_dir, "cpu")
    model, _ = seg.load()
    seen, encoded = [], []
    forward, embed = model.forward, model.get_image_embeddings
    model.forward = lambda **kw: seen.append(kw["input_points"].clone()) or forward(**kw)
    model.get_image_embeddings = lambda pixels: encoded.append(tuple(pixels.shape)) or embed(pixels)
    image = _photo((80, 40))
    scale = EDGE / max(image.size)
    seg.select(image, (70, 5))
    assert seen[-1].shape == (1, 1, 1, 2)  # one image, one prompt, one point
    assert seen[-1].flatten().tolist() == pytest.approx([70 * scale, 5 * scale])
    seg.select(image, (3, 39))
    assert seen[-1].flatten().tolist() == pytest.approx([3 * scale, 39 * scale])
    assert encoded == [(1, 3, EDGE, EDGE)]  # a second click on the same image reuses its embedding
    seg.select(_photo((80, 40), seed=1), (3, 39))
    assert len(encoded) == 2
    with pytest.raises(ValueError, match=r"the point \(80, 5\) is outside the 80×40 image"):
        seg.select(image, (80, 5))


# --- the UI --------------------------------------------------------------------------------------
def _ui_config(tmp_path, sam_model):
    from diffsynth_qie.ui.config import UIConfig

    return UIConfig(lora_dir=str(tmp_path / "loras"), examples="", temp_dir=str(tmp_path / "temp"),
                    outputs_dir=str(tmp_path / "out"), sam_model=sam_model, preload=False)


def _select_button(demo):
    return next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "select-object")


@pytest.mark.parametrize("with_model", [False, True])
def test_the_button_is_shown_only_with_a_checkpoint(tmp_path, sam_dir, with_model):
    from diffsynth_qie.ui.app import build_ui
    from diffsynth_qie.ui.handlers import UIHandlers

    demo = build_ui(UIHandlers(_ui_config(tmp_path, str(sam_dir) if with_model else "")))
    assert _select_button(demo).visible is with_model


def test_a_click_adds_the_object_to_the_mask_file(tmp_path, sam_dir):
    from diffsynth_qie.ui.handlers import UIHandlers
    from diffsynth_qie.ui.mask_events import MaskTools
    from diffsynth_qie.ui.select_object import ObjectSelect

    tools = MaskTools(UIHandlers(_ui_config(tmp_path, str(sam_dir))))
    select = ObjectSelect.from_config(tools)
    image = _photo()
    old = np.zeros((image.height, image.width), np.uint8)
    old[:5, :] = 255
    Image.fromarray(old, "L").save(tmp_path / "old.png")
    path, line = select.select("70,45,1700000000", {"background": image, "layers": []}, None,
                               str(tmp_path / "old.png"))
    selected = np.asarray(select.segmenter.select(image, (70, 45))) == 255
    united = np.asarray(Image.open(path))
    np.testing.assert_array_equal(united == 255, (old == 255) | selected)
    assert united.shape == old.shape and set(np.unique(united)) <= {0, 255}
    assert line.startswith("Object at (70, 45) added to the mask file")
    import gradio as gr

    hidden = ObjectSelect.from_config(MaskTools(UIHandlers(_ui_config(tmp_path, ""))))
    assert not hidden.available  # a stray point with no checkpoint changes nothing
    assert hidden.select("1,1", {"background": image, "layers": []}, None, None) == (gr.skip(), gr.skip())


# --- in the browser (a step of test_ui_browser.py's walk through the page, on its app with this tiny SAM) ---------
def select_object_at_the_centre(page) -> None:
    """Armed by its button, a click on the mask preview's centre reaches the server as the 64-px example's centre
    pixel and adds the object there to the mask file; the next click is the box tool's again (disarmed)."""
    from test_ui_browser import EXAMPLE_SIZE, _given

    page.click("#examples [data-testid='dataset-cell-0-0']")
    _given(page, "Example 1 loaded")
    page.wait_for_function("() => document.querySelector('#mask-preview-text')?.innerText.includes('%')")
    for attempt in range(3):  # on a loaded machine the example's preview may be redrawn under the click
        if not page.locator("body[data-select-armed]").count():
            page.click("#select-object")
            page.wait_for_selector("body[data-select-armed]", state="attached")
        page.wait_for_timeout(300)  # (the preview settles)
        box = page.locator("#mask-preview img").bounding_box()
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        try:
            page.wait_for_function("() => document.querySelector('#mask-preview-text')?.innerText"
                                   ".includes('Object at')", timeout=15_000)
            break
        except Exception:  # noqa: BLE001 - the click met a redrawn preview: arm and click again
            if attempt == 2:
                raise
    line = page.inner_text("#mask-preview-text")
    x, y = (int(v) for v in line.split("Object at (")[1].split(")")[0].split(", "))
    assert abs(x - EXAMPLE_SIZE[0] / 2) <= 1 and abs(y - EXAMPLE_SIZE[1] / 2) <= 1, (x, y)
    page.wait_for_selector("#mask-file img")
    assert page.locator("body[data-select-armed]").count() == 0  # one click per arming
