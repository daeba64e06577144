"""Retake the README's pictures of the web UI: ``docs/ui.png`` (1400x1000) and ``docs/ui-phone.png`` (390x844).

    .venv/bin/python scripts/ui_screenshots.py [--lora_dir outputs/qie-2511] [--out docs]

Starts ``app_gradio.py`` as a user does after the CPU demo (the pretrained tiny base, the LoRA that
``bash Qwen-Image-Edit-2511.sh`` trained, the demo's held-out rows as examples), clicks the first example, presses
Generate at the UI's defaults, drags the before/after handle to the middle and photographs the page in headless
Chromium (``scripts/install_chromium.sh``; the Python package ``playwright`` drives it). Writes each picture
atomically; a run without the demo's LoRA stops with the command that makes it.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]

log = logging.getLogger("ui_screenshots")


def shoot(page, path: Path) -> None:
    """A screenshot of ``page`` written to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp.png")
    page.screenshot(path=str(tmp))
    os.replace(tmp, path)
    log.info("wrote %s", path)


def take(url: str, out: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            page.goto(url)
            page.wait_for_function("() => document.querySelector('#model-status')?.innerText.includes('loaded in')")
            page.click("#examples [data-testid='dataset-cell-0-0']")
            page.wait_for_selector("#mask-file img")
            page.wait_for_selector("#generate:not([disabled])")
            page.click("#generate")
            page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('Done')")
            slider = page.locator("#result [data-testid=slider]").bounding_box()
            frame = page.locator("#result img[data-testid=imageslider-image]").nth(1).bounding_box()
            page.mouse.move(slider["x"] + slider["width"] / 2, slider["y"] + slider["height"] / 2)
            page.mouse.down()
            page.mouse.move(frame["x"] + frame["width"] / 2, slider["y"] + slider["height"] / 2, steps=8)
            page.mouse.up()
            page.evaluate("() => window.scrollTo(0, 0)")
            shoot(page, out / "ui.png")
            page.set_viewport_size({"width": 390, "height": 844})
            page.wait_for_function("() => document.documentElement.scrollWidth <= 390")
            page.evaluate("() => window.scrollTo(0, 0)")
            shoot(page, out / "ui-phone.png")
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    from diffsynth_qie.ui.running import AppNotServing, running_app

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lora_dir", default=str(REPO / "outputs" / "qie-2511"),
                        help="a training run's folder holding lora.safetensors (default: the CPU demo's)")
    parser.add_argument("--out", default=str(REPO / "docs"), help="where ui.png and ui-phone.png go")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    lora_dir = Path(args.lora_dir)
    if not (lora_dir / "lora.safetensors").is_file():
        raise SystemExit(f"--lora_dir {lora_dir} holds no lora.safetensors: train the CPU demo's LoRA first "
                         "(bash Qwen-Image-Edit-2511.sh) or name a run's folder")
    if not os.access(CHROMIUM, os.X_OK):
        raise SystemExit(f"no Chromium at {CHROMIUM}: run scripts/install_chromium.sh")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qie-ui-shots-") as tmp:
        flags = ["--lora_dir", lora_dir, "--outputs_dir", Path(tmp) / "kept", "--temp_dir", Path(tmp) / "ui-tmp"]
        try:
            with running_app(flags, Path(tmp) / "app.log") as app:
                take(app.url, out)
        except AppNotServing as e:
            raise SystemExit(str(e)) from e
    return 0


if __name__ == "__main__":
    sys.exit(main())
