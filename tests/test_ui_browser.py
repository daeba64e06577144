"""End to end: `python app_gradio.py` in a subprocess, driven by Debian's headless Chromium.

What a user does, and what they see: a refused Generate (a toast; the last result stays),
an example click, an edit, the before/after slider, the sampler and LoRA pickers (LoRA
labels from their metadata; an LBM LoRA switches to the LBM sampler), a history restore,
"Edit this result", variations with a double click, Stop, a non-image dropped on the
editor, a painted stroke, "Select object" (a tiny SAM checkpoint) and the page at phone width. The
screenshot goes to the test's tmp dir and to ``outputs/screenshots/ui_e2e.png``.

Chromium comes from apt (``scripts/install_chromium.sh``), never from a browser
download; the test skips, saying why, only if it cannot be installed or launched.
"""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffsynth_qie.ui.running import running_app

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SCREENSHOT_COPY = REPO / "outputs" / "screenshots" / "ui_e2e.png"
W, H = 96, 64   # multiples of 16: the output keeps this size
EXAMPLE_SIZE = (64, 64)  # the CPU demo's held-out rows

log = logging.getLogger(__name__)


def _chromium_or_skip() -> str:
    if not os.access(CHROMIUM, os.X_OK):
        try:
            subprocess.run(["bash", str(REPO / "scripts" / "install_chromium.sh")], check=True,
                           capture_output=True, timeout=300)
        except (subprocess.SubprocessError, OSError) as exc:
            pytest.skip(f"Chromium is not installed and scripts/install_chromium.sh failed: {exc}")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"Chromium not found at {CHROMIUM} after scripts/install_chromium.sh")
    return CHROMIUM


def _write_lora(path: Path, dit_file: Path, metadata: dict, seed: int = 0) -> None:
    """A real rank-4 LoRA on the tiny DiT's attention projections (shapes from its header), with training metadata."""
    import torch
    from safetensors import safe_open

    from diffsynth_qie.lora import save_lora

    g = torch.Generator().manual_seed(seed)
    sd = {}
    with safe_open(str(dit_file), "pt") as f:
        for key in f.keys():
            module = key[: -len(".weight")]
            if key.endswith(".weight") and module.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v"):
                out_f, in_f = f.get_slice(key).get_shape()
                sd[f"{module}.lora_A.weight"] = torch.randn(4, in_f, generator=g) * 0.5
                sd[f"{module}.lora_B.weight"] = torch.randn(out_f, 4, generator=g) * 0.5
    path.parent.mkdir(parents=True, exist_ok=True)
    save_lora(path, sd, metadata=metadata)


def _fetch_image(src: str) -> Image.Image:
    with urllib.request.urlopen(src, timeout=10) as r:
        data = r.read()
    image = Image.open(io.BytesIO(data))
    image.load()  # a truncated or invalid file raises here
    return image


@pytest.fixture(scope="module")
def app_python(tmp_path_factory):
    """The ``python`` that runs ``app_gradio.py``: one whose runs start with torch, DiffSynth and the UI's handlers
    imported (tests/warm_python.py), not gradio, which reads GRADIO_TEMP_DIR when it is imported: the app still
    imports it after setting that. This process's own python if it has imported gradio already. (tests/
    test_ui_startup.py starts the app in a fresh python.)"""
    if "gradio" in sys.modules:
        yield sys.executable
        return
    from warm_python import PRELOAD, warm_python

    with warm_python(tmp_path_factory.mktemp("warm-app"), preload=(
            *PRELOAD, "diffsynth_qie.ui.handlers", "diffsynth_qie.ui.startup", "diffsynth_qie.ui.config"),
            launches_warm=False) as folder:  # the app shows the `qie` command of its own venv
        assert "gradio" not in sys.modules
        yield str(folder / "bin" / "python")


@pytest.fixture
def server(tmp_path, tiny_model_dir, app_python):
    """The app on a free port: tiny model; a LoRA folder as a training run leaves it (its own lora.safetensors),
    plus an LBM run's LoRA and a Lightning LoRA; examples from the CPU demo's held-out rows (the default)."""
    lora_dir = tmp_path / "loras"
    dit_file = Path(tiny_model_dir) / "transformer" / "diffusion_pytorch_model.safetensors"
    _write_lora(lora_dir / "lora.safetensors", dit_file, {"loss": "sft", "preset": "tiny", "step": 12})
    _write_lora(lora_dir / "lbm-run" / "lora.safetensors", dit_file, {"loss": "lbm", "preset": "tiny", "step": 30}, 1)
    _write_lora(lora_dir / "tiny-Lightning-8steps.safetensors", dit_file, {}, 2)
    from safetensors.torch import save_file
    import torch
    save_file({"not_a_module.lora_A.weight": torch.zeros(2, 3), "not_a_module.lora_B.weight": torch.zeros(3, 2)},
              str(lora_dir / "zz-broken.safetensors"))  # its keys fit no module: the run fails
    from test_ui_select_object import save_tiny_sam

    sam_dir = save_tiny_sam(tmp_path / "tiny-sam")  # random weights: "Select object" shows, its masks mean nothing
    flags = ["--model", "tiny", "--model_dir", tiny_model_dir, "--lora_dir", lora_dir, "--device", "cpu",
             "--temp_dir", tmp_path / "ui-tmp", "--outputs_dir", tmp_path / "kept", "--sam_model", sam_dir]
    env = {"DIFFSYNTH_SKIP_DOWNLOAD": "True", "GRADIO_TEMP_DIR": str(tmp_path / "gradio-tmp")}
    # (waited for in _open, once Chromium is up: the two start side by side)
    with running_app(flags, tmp_path / "server.log", env=env, wait=False, python=app_python) as app:
        yield app


def _history_count(page) -> int:
    return page.locator("#history img").count()


def _generate(page, runs_before: int, timeout: float = 60_000, click: bool = True) -> str:
    """Press Generate (unless ``click`` is False: already pressed) and wait for its result in the history; the
    status line."""
    if click:
        page.click("#generate")
    page.wait_for_function(f"() => document.querySelectorAll('#history img').length > {runs_before}", timeout=timeout)
    page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('Done')")
    return page.inner_text("#status")


def _set_number(page, elem_id: str, value) -> None:
    page.fill(f"#{elem_id} input[type=number]", str(value))
    page.press(f"#{elem_id} input[type=number]", "Enter")


def _shown(page) -> tuple[str, str]:
    """(before, after) image URLs of the before/after slider."""
    imgs = page.locator("#result img[data-testid=imageslider-image]")
    return imgs.nth(0).get_attribute("src"), imgs.nth(1).get_attribute("src")


def _given(page, status: str) -> None:
    """After the editor was given an image (example, "Edit this result", "Clear paint"): its status line."""
    page.wait_for_function(f"() => document.querySelector('#status')?.innerText.includes({status!r})")
    page.wait_for_selector("#generate:not([disabled])")


def _toast(page, text: str) -> None:
    page.get_by_test_id("toast-text").filter(has_text=text).wait_for()
    page.get_by_test_id("toast-close").first.click()


def _paint_stroke(page) -> None:
    page.click("#editor button[aria-label=Brush]")
    box = page.locator("#editor canvas").last.bounding_box()
    cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(cx - 30, cy)
    page.mouse.down()
    for i in range(1, 4):  # few events: each waits for a software-WebGL frame
        page.mouse.move(cx - 30 + 20 * i, cy + 3 * i)
    page.mouse.up()


def _launch(playwright, chromium: str):
    """Headless Chromium, or a skip saying why it cannot run here (any launch failure means that)."""
    try:
        return playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, timeout=30_000)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"headless Chromium at {chromium} cannot be launched: {exc}")


def _open(browser, server):
    """A 1400x1000 page on the app of ``server``, once the app answers."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30_000)
    server.wait(timeout=120)
    page.goto(server.url)
    return page


@pytest.mark.browser
@pytest.mark.slow
def test_mask_edit_in_headless_chromium(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    chromium = _chromium_or_skip()
    url, log_path = server.url, server.log_path
    start = time.monotonic()
    source = Image.fromarray(np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8), "RGB")
    source_path = tmp_path / "input.png"
    source.save(source_path)

    with sync_api.sync_playwright() as p:
        browser = _launch(p, chromium)
        try:
            page = _open(browser, server)
            page.wait_for_selector("#editor input[type=file]", state="attached")
            model_status = page.inner_text("#model-status")
            assert "loading in the background" in model_status or "loaded in" in model_status, model_status

            # The run's own LoRA is picked at start; labels come from the files' training metadata.
            assert page.input_value("#lora input") == "lora.safetensors · flow matching · tiny · rank 4 · step 12"

            # A user error comes back as a toast, before anything is queued.
            page.click("#generate")
            _toast(page, "type a prompt describing the edit")
            assert "Traceback" not in page.inner_text("body")

            # An example: image, mask file and prompt in one click.
            page.click("#examples [data-testid='dataset-cell-0-0']")
            page.wait_for_selector("#mask-file img")
            _given(page, "Example 1 loaded")
            assert page.input_value("#prompt textarea") == "make the red circle blue"
            _set_number(page, "steps", 6)
            page.get_by_label("Balanced").check()  # the first result is a cached one (the Speed setting)
            status = _generate(page, 0)
            assert "6 steps" in status and "LoRA lora.safetensors × 1" in status.replace("`", ""), status
            assert "mask covers" in status, f"the example's mask did not reach the server: {status}"
            # The result, the status and Stop are in sight at 1400x1000 where the user pressed Generate.
            # So are they at 1920x1080.
            for width, height in ((1400, 1000), (1920, 1080)):
                page.set_viewport_size({"width": width, "height": height})
                for elem in ("#result", "#status", "#stop"):
                    rect = page.eval_on_selector(elem, "e => { const r = e.getBoundingClientRect(); "
                                                       "return [r.top, r.bottom]; }")
                    assert rect[1] > 20 and rect[0] < height - 80, (width, elem, rect)
            page.set_viewport_size({"width": 1400, "height": 1000})

            # Before/after at the same size, the after PNG carrying its settings; dragging the slider reveals more.
            before_src, after_src = _shown(page)
            before, after = _fetch_image(before_src), _fetch_image(after_src)
            assert before.size == after.size == EXAMPLE_SIZE
            settings = json.loads(after.text["diffsynth-qie"])
            assert (settings["seed"], settings["steps"], settings["lora"], settings["cache"]) == \
                (0, 6, "lora.safetensors", "balanced")
            clip = page.locator("#result img.fixed").get_attribute("style")
            slider = page.locator("#result [data-testid=slider]")
            slider.scroll_into_view_if_needed()
            handle = slider.bounding_box()
            x, y = handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2
            page.mouse.move(x, y)
            page.mouse.down()
            for i in range(1, 5):
                page.mouse.move(x - 30 * i, y)
            page.mouse.up()
            assert page.locator("#result img.fixed").get_attribute("style") != clip, "the slider did not move"
            downloads = page.inner_text("#downloads").replace("\n", "")
            assert "edit_seed0_lora.png" in downloads and "mask.png" in downloads, downloads
            cut = page.evaluate("() => [...document.querySelectorAll('#downloads .filename')]"
                                ".filter(n => n.scrollWidth > n.clientWidth + 1 || n.getBoundingClientRect().width < 60)"
                                ".map(n => n.innerText)")
            assert not cut, f"download names cut short (they showed as '.p'): {cut}"
            command = page.input_value("#qie-command textarea")
            assert command.startswith(f"{Path(sys.executable).parent / 'qie'} edit --model tiny"), command
            assert "--seed 0" in command and "--steps 6" in command and f"--lora {tmp_path}/loras/lora" in command
            assert "--cache balanced" in command, command
            page.get_by_label("Exact").check()

            # An error inside the run (a LoRA whose keys fit no module): a toast, the last result stays on screen,
            # Generate works again (it stayed locked, under an "Error" pill, before).
            page.click("#lora input")
            page.get_by_role("option", name="zz-broken.safetensors").click()
            page.click("#generate")
            _toast(page, "not_a_module")
            page.wait_for_selector("#generate:not([disabled])")
            assert "Failed:" in page.inner_text("#status")
            assert _shown(page) == (before_src, after_src) and "Error" not in page.inner_text("#result")
            page.click("#lora input")
            page.get_by_role("option", name="lora.safetensors · flow matching · tiny · rank 4 · step 12").click()
            # A prompt over the token limit is refused before the queue.
            page.fill("#prompt textarea", "make the red circle blue " * 400)
            page.click("#generate")
            _toast(page, "more than the limit of 1024")
            page.wait_for_selector("#generate:not([disabled])")

            # A refused Generate keeps the last result on screen (no "Error" over it).
            page.fill("#prompt textarea", " ")
            page.click("#generate")
            _toast(page, "type a prompt describing the edit")
            assert _shown(page) == (before_src, after_src) and "Error" not in page.inner_text("#result")
            page.fill("#prompt textarea", "make the red circle blue")

            # Lightning sets 8 steps; leaving it gives the user's steps back.
            page.get_by_label("Lightning (4 / 8 steps)").check()
            page.wait_for_function("() => document.querySelector('#steps input[type=number]')?.value === '8'")
            page.get_by_label("Flow matching").check()
            page.wait_for_function("() => document.querySelector('#steps input[type=number]')?.value === '6'")

            # An LBM LoRA from the picker switches to the LBM sampler; both streams are shown.
            page.click("#lora input")
            page.get_by_role("option", name="lbm-run/lora.safetensors · LBM · tiny · rank 4 · step 30").click()
            page.wait_for_selector("#lbm-steps", state="visible")
            assert page.get_by_label("LBM (1–4 steps)").is_checked()
            status = _generate(page, 1)
            assert "LBM, 1 step" in status, status
            page.wait_for_selector("#output-sub img")
            main = _fetch_image(_shown(page)[1])
            sub = _fetch_image(page.get_attribute("#output-sub img", "src"))
            assert main.size == sub.size == EXAMPLE_SIZE and not np.array_equal(np.asarray(main), np.asarray(sub))

            # History: the first result (the oldest, last in the gallery) brings its settings back.
            page.locator("#history img").last.click()
            page.wait_for_function("() => document.querySelector('#steps input[type=number]')?.value === '6'")
            assert page.get_by_label("Flow matching").is_checked() and page.get_by_label("Balanced").is_checked()
            assert page.input_value("#lora input").startswith("lora.safetensors · flow matching")
            assert _shown(page)[1].endswith("edit_seed0_lora.png")
            first_result = _fetch_image(_shown(page)[1])

            # While the editor is given an image (its progress overlay shows), Generate and the canvas take no clicks.
            # Gradio redraws the overlay's class when an update lands, so each poll sets it again until the page's
            # own timer has seen it.
            for shown, locked in (("remove", "==="), ("add", "!==")):
                page.wait_for_function(
                    "() => { document.querySelector('#editor > [data-testid=status-tracker]')"
                    f".classList.{shown}('hide'); return getComputedStyle(document.querySelector('#generate'))"
                    f".pointerEvents {locked} 'none'; }}", polling=100)

            # "Edit this result": the next edit starts from it. Variations: seeds 0 and 1, a double click runs once.
            page.click("#edit-result")
            _given(page, "Editing the result of seed 0")
            page.wait_for_selector("#mask-file img", state="detached")  # the restored mask file goes with its image
            _set_number(page, "variations", 2)
            page.dblclick("#generate")
            _toast(page, "this tab already has a generation queued or running")  # the second click, refused
            status = _generate(page, 2, click=False)
            assert "seeds 0–1" in status, status
            page.wait_for_timeout(1000)  # a duplicate run would land by now
            assert _history_count(page) == 4, "a double click queued two generations"
            assert page.locator("#variations-grid img").count() == 2
            command = page.input_value("#qie-command textarea")
            image_arg = Path(command.split("--image ")[1].split(" ")[0])
            np.testing.assert_array_equal(np.asarray(Image.open(image_arg).convert("RGB")),
                                          np.asarray(first_result.convert("RGB")))

            # Stop: a long run ends at its next step; Generate works again. Steps above 100 are kept (up to 1000).
            _set_number(page, "steps", 200)
            _set_number(page, "variations", 8)
            page.click("#prompt textarea")  # the steps box loses focus: 200 stays 200
            assert page.input_value("#steps input[type=number]") == "200"
            page.click("#generate")
            page.wait_for_function("() => document.querySelector('#result')?.innerText.includes('/200')")
            page.click("#stop")
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('Stopped at step')")
            page.wait_for_selector("#generate:not([disabled])")
            assert "of variation" in page.inner_text("#status") and "/8" in page.inner_text("#status")
            page.wait_for_timeout(500)
            runs = _history_count(page)  # 4, plus the variations that finished before Stop (kept)
            page.wait_for_timeout(1000)  # the stopped run ends at its next step: no error toast for it
            assert page.get_by_test_id("toast-text").count() == 0, page.get_by_test_id("toast-text").all_inner_texts()
            _set_number(page, "steps", 4)
            _set_number(page, "variations", 1)

            # A non-image dropped on the editor is refused with a message, not ignored.
            transfer = page.evaluate_handle("""() => { const dt = new DataTransfer();
                dt.items.add(new File(['hello'], 'notes.txt', {type: 'text/plain'})); return dt; }""")
            page.dispatch_event("#editor", "drop", {"dataTransfer": transfer})
            assert "notes.txt is not an image" in page.inner_text("#drop-message")
            # So are a non-image and a damaged PNG picked with the upload button; a good image clears the message.
            notes, broken = tmp_path / "notes.txt", tmp_path / "broken.png"
            notes.write_text("hello")
            broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
            page.evaluate("() => { document.querySelector('#drop-message').textContent = ''; }")
            page.set_input_files("#editor input[type=file]", str(notes))
            page.wait_for_function("() => document.querySelector('#drop-message').innerText.includes('notes.txt')")
            page.set_input_files("#editor input[type=file]", str(broken))
            page.wait_for_function("() => document.querySelector('#drop-message').innerText.includes("
                                   "'broken.png is not a readable image')")

            # An uploaded image of another shape: the example's mask file no longer fits and is refused by name.
            page.set_input_files("#editor input[type=file]", str(source_path))
            page.wait_for_function("() => document.querySelector('#drop-message').textContent === ''")
            page.wait_for_timeout(1500)  # the editor lays the image out on the canvas
            other_mask = tmp_path / "mask64.png"
            Image.new("L", EXAMPLE_SIZE, 255).save(other_mask)
            page.set_input_files("#mask-file input[type=file]", str(other_mask))
            page.wait_for_selector("#mask-file img")
            page.click("#generate")
            _toast(page, "the mask file is 64x64 but the image is 96x64")
            page.click("#mask-file button[aria-label='Remove Image']")
            page.wait_for_selector("#mask-file img", state="detached")
            # One painted stroke is the mask; "Clear paint" removes it and keeps the image.
            _paint_stroke(page)
            status = _generate(page, runs)
            assert "mask covers" in status and "4 steps" in status, status
            assert _fetch_image(_shown(page)[1]).size == (W, H)
            page.click("#mask-clear")
            _given(page, "Paint cleared")
            page.focus("#prompt textarea")
            page.keyboard.press("Control+Enter")  # runs Generate
            status = _generate(page, runs + 1, click=False)
            assert "no mask painted" in status, status
            assert _fetch_image(_shown(page)[0]).size == (W, H)
            assert "loaded in" in page.inner_text("#model-status")

            # A second example: the brush fits the image (about 4 px on 64 px, not 25 or 50), shown in the mask
            # preview before Generate; [ and ] resize it; Ctrl+Z / Ctrl+Y undo and redo the paint.
            page.click("#examples [data-testid='dataset-cell-1-0']")
            _given(page, "Example 2 loaded")
            page.wait_for_selector("#mask-file img")
            page.click("#mask-file button[aria-label='Remove Image']")
            page.wait_for_function("() => document.querySelector('#mask-preview-text')?.innerText.includes("
                                   "'whole image')")
            page.wait_for_function("() => document.querySelector('#brush-size input[type=number]')?.value === '4'")
            page.get_by_label("Invert mask (edit all but the painted part)").check()  # nothing painted: refused
            page.wait_for_function("() => document.querySelector('#mask-preview-text')?.innerText.includes("
                                   "'needs a painted region')")
            assert "“Invert mask”" in page.inner_text("#mask-preview-text")
            page.get_by_label("Invert mask (edit all but the painted part)").uncheck()
            _paint_stroke(page)
            page.wait_for_function("() => /may change \\d/.test(document.querySelector('#mask-preview-text')"
                                   "?.innerText)")
            share = float(page.inner_text("#mask-preview-text").split("change ")[1].split(" %")[0])
            assert 0 < share < 10, f"a short stroke covers {share} % of a 64-px example: the brush is too big"
            page.click("h1")  # keys act outside text fields
            page.keyboard.press("]")
            page.wait_for_function("() => document.querySelector('#brush-size input[type=number]')?.value === '5'")
            page.keyboard.press("[")
            page.wait_for_function("() => document.querySelector('#brush-size input[type=number]')?.value === '4'")
            page.keyboard.press("Control+z")
            page.wait_for_function("() => document.querySelector('#mask-preview-text')?.innerText.includes("
                                   "'whole image')")
            page.keyboard.press("Control+y")
            page.wait_for_function(f"() => document.querySelector('#mask-preview-text')?.innerText.includes("
                                   f"'{share:.1f} %')")
            # The box tool: a box dragged on the preview is added to the mask file.
            box = page.locator("#mask-preview img").bounding_box()
            page.mouse.move(box["x"] + box["width"] * 0.1, box["y"] + box["height"] * 0.1)
            page.mouse.down()
            page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] * 0.6)
            page.mouse.up()
            page.wait_for_selector("#mask-file img")
            page.wait_for_function(f"() => {{ const m = /may change ([\\d.]+) %/.exec(document.querySelector("
                                   f"'#mask-preview-text')?.innerText); return m && +m[1] > {share + 10}; }}")
            shot = tmp_path / "ui_e2e.png"
            page.screenshot(path=str(shot))

            # A reload keeps the history (rebuilt from --outputs_dir); a dropped result PNG restores its settings.
            page.reload()
            page.wait_for_function(f"() => document.querySelectorAll('#history img').length === {runs + 2}")
            first_png = sorted((tmp_path / "kept").glob("*/edit_seed0_lora.png"))[0]  # the oldest: 6 steps
            _set_number(page, "steps", 3)
            page.set_input_files("#settings-png input[type=file]", str(first_png))
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('Settings restored')")
            page.wait_for_function("() => document.querySelector('#steps input[type=number]')?.value === '6'")
            assert page.input_value("#prompt textarea") == "make the red circle blue"

            # A tab closed while its generation runs: the generation stops, nobody waits for it.
            other = browser.new_page(viewport={"width": 1400, "height": 1000})
            other.goto(url)
            other.click("#examples [data-testid='dataset-cell-0-0']")
            _given(other, "Example 1 loaded")
            _set_number(other, "steps", 100)
            _set_number(other, "variations", 8)
            other.click("#generate")
            other.wait_for_function("() => document.querySelector('#result')?.innerText.includes('denoising')")
            other.close()
            deadline = time.monotonic() + 30
            while "a browser tab went away" not in log_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert "a browser tab went away" in log_path.read_text()

            # Select object (the app has a SAM checkpoint): an armed click on the preview adds the object there.
            from test_ui_select_object import select_object_at_the_centre

            select_object_at_the_centre(page)

            # Phone width: nothing wider than the screen, reference previews not cropped.
            page.set_viewport_size({"width": 390, "height": 844})
            wide = tmp_path / "wide.png"
            Image.new("RGB", (300, 60), (200, 30, 30)).save(wide)
            page.set_input_files("#references input[type=file]", str(wide))
            page.wait_for_selector("#references img")
            assert page.eval_on_selector("#references img", "e => getComputedStyle(e).objectFit") == "contain"
            page.wait_for_function("() => document.documentElement.scrollWidth <= 390")
            # The examples table shows every column within the screen; Generate is on screen without scrolling.
            page.evaluate("() => window.scrollTo(0, 0)")
            cells = page.eval_on_selector_all("#examples tbody tr:first-child td", "tds => tds.map(td => { "
                                              "const r = td.getBoundingClientRect(); return [r.left, r.right]; })")
            assert len(cells) == 3 and all(0 <= left and right <= 391 for left, right in cells), cells
            rect = page.eval_on_selector("#generate", "e => { const r = e.getBoundingClientRect(); "
                                                      "return [r.top, r.bottom]; }")
            assert 0 <= rect[0] and rect[1] <= 844, f"Generate is off screen at 390 px: {rect}"
            page.screenshot(path=str(tmp_path / "ui_phone.png"))
        except Exception as exc:  # what the page and the server showed, for a failure seen only in CI
            seen = page.evaluate("() => ({status: document.querySelector('#status')?.innerText, toasts: "
                                 "[...document.querySelectorAll('[data-testid=toast-text]')].map(t => t.innerText)})")
            raise AssertionError(f"{exc}\npage: {seen}\nserver log (end):\n{log_path.read_text()[-3000:]}") from exc
        finally:
            browser.close()

    SCREENSHOT_COPY.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, SCREENSHOT_COPY)
    shutil.copyfile(tmp_path / "ui_phone.png", SCREENSHOT_COPY.with_name("ui_e2e_phone.png"))
    log.warning("UI screenshot: %s (copy: %s); browser test took %.1f s", shot, SCREENSHOT_COPY,
                time.monotonic() - start)
    deadline = time.monotonic() + 30  # the closed tab's generation ends at its next step, on the server's time
    while log_path.read_text().count("generation stopped by the user") < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    server_log = log_path.read_text()
    # Our errors are logged by diffsynth_qie.* loggers (uvicorn may log a ClientDisconnect
    # for an upload cut short when the browser closes: not ours). The expected refusals: the empty prompts, the
    # mask file of another image.
    problems = [line for line in server_log.splitlines()
                if (" ERROR diffsynth_qie" in line or " WARNING diffsynth_qie" in line)]
    expected = ("refused: type a prompt", "refused: the mask file is 64x64", "not_a_module", "limit of 1024",
                "Nothing to invert", "not a readable image")
    assert problems and all(any(e in line for e in expected) for line in problems), problems
    assert server_log.count("model 'tiny' loaded") == 1  # many generations, one model load
    assert server_log.count("generation stopped by the user") >= 2  # Stop, and the closed tab
    assert server_log.count("generated 2 image(s)") == 1  # the double click ran once


def test_build_ui_queues_one_generation_at_a_time(tmp_path):
    """The UI's wiring: a queue with concurrency 1 and the generate event limited to 1."""
    pytest.importorskip("gradio")
    from diffsynth_qie.ui.app import build_ui
    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.handlers import UIHandlers

    demo = build_ui(UIHandlers(UIConfig(lora_dir=str(tmp_path), examples="")))
    assert demo._queue.default_concurrency_limit == 1
    limits = {fn.name: fn.concurrency_limit for fn in demo.fns.values()}
    assert limits["run"] == 1 and limits["precheck"] is None, limits
