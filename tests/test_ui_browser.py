"""End to end: `python app_gradio.py` in a subprocess, driven by Debian's headless Chromium.

Checks that a user error shows as a message, then uploads an image, paints a mask
stroke, types a prompt, picks a real LoRA, generates (flow matching, then LBM), and
checks the served output images. The screenshot goes
to the test's tmp dir and to ``outputs/screenshots/ui_e2e.png``.

Chromium comes from apt (``scripts/install_chromium.sh``), never from a browser
download; the test skips, saying why, only if it cannot be installed or launched.
"""
from __future__ import annotations

import io
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

from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SCREENSHOT_COPY = REPO / "outputs" / "screenshots" / "ui_e2e.png"
W, H = 96, 64   # multiples of 16: the output keeps this size
LORA_NAME = "run1/lora.safetensors"

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


def _write_lora(path: Path, dit_file: Path) -> None:
    """A real rank-4 LoRA on the tiny DiT's attention projections (shapes from its header)."""
    import torch
    from safetensors import safe_open

    from diffsynth_qie.lora import save_lora

    g = torch.Generator().manual_seed(0)
    sd = {}
    with safe_open(str(dit_file), "pt") as f:
        for key in f.keys():
            module = key[: -len(".weight")]
            if key.endswith(".weight") and module.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v"):
                out_f, in_f = f.get_slice(key).get_shape()
                sd[f"{module}.lora_A.weight"] = torch.randn(4, in_f, generator=g) * 0.5
                sd[f"{module}.lora_B.weight"] = torch.randn(out_f, 4, generator=g) * 0.5
    path.parent.mkdir(parents=True, exist_ok=True)
    save_lora(path, sd)


def _wait_for_server(url: str, proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"app_gradio.py exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"app_gradio.py did not serve {url} within {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")


def _fetch_image(src: str) -> Image.Image:
    with urllib.request.urlopen(src, timeout=10) as r:
        data = r.read()
    image = Image.open(io.BytesIO(data))
    image.load()  # a truncated or invalid file raises here
    return image


@pytest.fixture
def server(tmp_path, tiny_model_dir):
    """The app on a free port: tiny model, a LoRA folder holding one real LoRA."""
    lora_dir = tmp_path / "loras"
    _write_lora(lora_dir / LORA_NAME, Path(tiny_model_dir) / "transformer" / "diffusion_pytorch_model.safetensors")
    port = free_port()
    log_path = tmp_path / "server.log"
    env = dict(os.environ, DIFFSYNTH_SKIP_DOWNLOAD="True", GRADIO_ANALYTICS_ENABLED="False",
               GRADIO_TEMP_DIR=str(tmp_path / "gradio-tmp"), PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "app_gradio.py"), "--port", str(port), "--model", "tiny",
             "--model_dir", str(tiny_model_dir), "--lora_dir", str(lora_dir), "--device", "cpu"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", proc, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.browser
@pytest.mark.slow
def test_mask_edit_in_headless_chromium(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    chromium = _chromium_or_skip()
    url, proc, log_path = server
    start = time.monotonic()
    source = Image.fromarray(np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8), "RGB")
    source_path = tmp_path / "input.png"
    source.save(source_path)

    with sync_api.sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, timeout=30_000)
        except Exception as exc:  # noqa: BLE001 - any launch failure means "cannot run a browser here"
            pytest.skip(f"headless Chromium at {chromium} cannot be launched: {exc}")
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(30_000)
            _wait_for_server(url, proc, log_path, timeout=60)
            page.goto(url)
            page.wait_for_selector("#editor input[type=file]", state="attached")
            model_status = page.inner_text("#model-status")
            assert "loading in the background" in model_status or "loaded in" in model_status, model_status

            # A user error comes back as a message (toast), not a stack trace.
            page.click("#generate")
            toast = page.get_by_test_id("toast-text").filter(has_text="type a prompt describing the edit")
            toast.wait_for()
            assert "Traceback" not in page.inner_text("body")
            page.get_by_test_id("toast-close").first.click()

            # Upload, then paint one stroke across the middle of the canvas with the brush.
            page.set_input_files("#editor input[type=file]", str(source_path))
            page.wait_for_function("() => document.querySelector('#editor canvas')?.width > 0")
            page.wait_for_timeout(500)  # the editor lays the image out on the canvas
            page.click("#editor button[aria-label=Brush]")
            box = page.locator("#editor canvas").last.bounding_box()
            cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
            page.mouse.move(cx - 30, cy)
            page.mouse.down()
            for i in range(1, 4):  # few events: each waits for a software-WebGL frame
                page.mouse.move(cx - 30 + 20 * i, cy + 3 * i)
            page.mouse.up()

            page.fill("#prompt textarea", "turn the painted area blue")
            page.fill("#steps input[type=number]", "6")
            page.press("#steps input[type=number]", "Enter")
            page.click("#lora input")
            page.get_by_role("option", name=LORA_NAME).click()
            assert page.input_value("#lora input") == LORA_NAME

            page.click("#generate")
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('Done')",
                                   timeout=60_000)
            status = page.inner_text("#status")
            assert f"LoRA {LORA_NAME}" in status.replace("`", "") and "6 steps" in status, status
            assert "mask covers" in status, f"the painted stroke did not reach the server as a mask: {status}"
            output = _fetch_image(page.get_attribute("#output img", "src"))
            assert output.size == (W, H), output.size
            assert not page.is_visible("#output-sub"), "the sub-stream output is for LBM only"

            # LBM: one step, both the main and the sub-stream outputs are shown.
            page.get_by_label("LBM (1–4 steps)").check()
            page.wait_for_selector("#output-sub", state="visible")
            page.click("#generate")
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('LBM, 1 step')",
                                   timeout=30_000)
            page.wait_for_selector("#output-sub img")
            main = _fetch_image(page.get_attribute("#output img", "src"))
            sub = _fetch_image(page.get_attribute("#output-sub img", "src"))
            assert main.size == (W, H) and sub.size == (W, H)
            assert not np.array_equal(np.asarray(main), np.asarray(sub))
            assert "loaded in" in page.inner_text("#model-status")

            page.wait_for_load_state("networkidle")
            shot = tmp_path / "ui_e2e.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()

    SCREENSHOT_COPY.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, SCREENSHOT_COPY)
    log.warning("UI screenshot: %s (copy: %s); browser test took %.1f s", shot, SCREENSHOT_COPY,
                time.monotonic() - start)
    server_log = log_path.read_text()
    # Our errors are logged by diffsynth_qie.* loggers (uvicorn may log a ClientDisconnect
    # for an upload cut short when the browser closes: not ours). The one expected
    # refusal is the empty prompt.
    problems = [line for line in server_log.splitlines()
                if (" ERROR diffsynth_qie" in line or " WARNING diffsynth_qie" in line)]
    assert len(problems) == 1 and "refused: type a prompt" in problems[0], problems
    assert server_log.count("model 'tiny' loaded") == 1  # two generations, one model load


def test_build_ui_queues_one_generation_at_a_time(tmp_path):
    """The UI's wiring: a queue with concurrency 1 and the generate event limited to 1."""
    pytest.importorskip("gradio")
    from diffsynth_qie.ui.app import build_ui
    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.handlers import UIHandlers

    demo = build_ui(UIHandlers(UIConfig(lora_dir=str(tmp_path))))
    assert demo._queue.default_concurrency_limit == 1
    limits = {fn.name: fn.concurrency_limit for fn in demo.fns.values()}
    assert limits["run"] == 1, limits
