"""`qie report OUTPUT_DIR`: one self-contained HTML page from loss.jsonl and the validation strips.

- the smoothed loss is the bias-corrected EMA (checked against its closed form);
- the page inlines every image: one plot each for loss, lr and every logged metric, and
  every finished validation strip, pixel for pixel (temp files of unfinished writes ignored);
- the summary table holds the last and best value of each metric;
- bad input (no directory, no loss.jsonl, smoothing out of range) is one clear error.
"""
from __future__ import annotations

import base64
import io
import json
import re

import numpy as np
import pytest
from PIL import Image

from diffsynth_qie.cli import main
from diffsynth_qie.training.report import smooth
from diffsynth_qie.training.tracking import Tracker


def images_in(page: str) -> list[tuple[str, Image.Image]]:
    out = []
    for alt, src in re.findall(r"<img alt='([^']*)' src='([^']*)'>", page):
        assert src.startswith("data:image/png;base64,"), f"not inlined: {src[:60]}"
        out.append((alt, Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB")))
    return out


@pytest.fixture
def run_dir(tmp_path):
    """A run's output: 6 logged steps, validation metrics and strips at steps 3 and 6."""
    out = tmp_path / "run"
    rng = np.random.default_rng(0)
    tracker = Tracker(out, enabled=True)
    losses = list(1.0 / np.arange(1, 7) + rng.normal(0, 0.05, 6))
    for step, loss in enumerate(losses, 1):
        tracker.log(step, {"loss": float(loss), "lr": 1e-3 * step / 6, "epoch": 0, "grad_norm": 0.5 + step})
        if step % 3 == 0:
            tracker.log_validation(step, {"val_psnr": 20.0 + step, "val_ssim": 0.5 + 0.01 * step,
                                          "val_lpips": 0.4 - 0.01 * step})
    tracker.close()
    strips = {}
    for step in (3, 6):
        folder = out / "validation" / f"step-{step}"
        folder.mkdir(parents=True)
        for k in range(2):
            img = Image.fromarray(rng.integers(0, 256, (24, 72, 3), dtype=np.uint8))
            img.save(folder / f"{k}-entry_{k}.png")
            strips[(step, f"{k}-entry_{k}")] = img
        (folder / ".0-entry_0.png.tmp").write_bytes(b"unfinished")  # a killed write: ignored
    return out, losses, strips


def test_smooth_is_the_bias_corrected_ema():
    x = [3.0, 1.0, 4.0, 1.0, 5.0]
    for w in (0.0, 0.5, 0.9):
        want = [sum((1 - w) * w ** (t - i) * x[i] for i in range(t + 1)) / (1 - w ** (t + 1)) for t in range(len(x))]
        assert smooth(x, w) == pytest.approx(want, rel=1e-12)
    assert smooth([2.0] * 4, 0.9) == pytest.approx([2.0] * 4)  # no bias towards 0 at the start
    with pytest.raises(ValueError, match="smoothing"):
        smooth(x, 1.0)


def test_report_page_is_self_contained_with_plots_and_strips(run_dir):
    pytest.importorskip("matplotlib")
    out, losses, strips = run_dir
    assert main(["report", str(out), "--smoothing", "0.5"]) == 0
    page = (out / "report.html").read_text()
    assert "http://" not in page and "https://" not in page and "file:" not in page
    imgs = images_in(page)
    plots = [(alt, im) for alt, im in imgs if not re.match(r"\d+-entry_\d+$", alt)]
    assert [alt for alt, _ in plots] == ["loss", "learning rate", "val_lpips", "val_psnr", "val_ssim", "grad_norm"]
    assert all(im.size == (750, 320) and np.asarray(im).std() > 0 for _, im in plots)
    shown = [(alt, im) for alt, im in imgs if re.match(r"\d+-entry_\d+$", alt)]
    assert len(shown) == len(strips) == 4
    steps = [int(s) for s in re.findall(r"<h3>step (\d+)</h3>", page)]
    assert steps == [3, 6]
    order = [(step, alt) for step in steps for alt in ("0-entry_0", "1-entry_1")]
    for (step, name), (alt, im) in zip(order, shown):
        assert alt == name and im.tobytes() == strips[(step, name)].tobytes()
    # summary: last / best / smoothed
    rows = dict(re.findall(r"<tr><td>([^<]+)</td>(.*?)</tr>", page))
    cells = {k: re.findall(r"<td>([^<]*)</td>", v) for k, v in rows.items()}
    assert float(cells["loss"][0]) == pytest.approx(losses[-1], rel=1e-5)
    assert float(cells["loss"][1]) == pytest.approx(min(losses), rel=1e-5)
    assert float(cells["loss"][2]) == pytest.approx(smooth(losses, 0.5)[-1], rel=1e-5)
    assert [float(c) for c in cells["val_psnr"][:2]] == pytest.approx([26.0, 26.0])
    assert [float(c) for c in cells["val_lpips"][:2]] == pytest.approx([0.34, 0.34])  # lower is better
    assert cells["grad_norm"][:2] == ["6.5", "–"]  # not a quality measure: no "best"


def test_report_custom_path_and_no_validation(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    t = Tracker(out, enabled=True)
    t.log(1, {"loss": 0.25, "lr": 1e-4})
    t.close()
    dest = tmp_path / "pages" / "r.html"
    assert main(["report", str(out), "--out", str(dest)]) == 0
    page = dest.read_text()
    assert [alt for alt, _ in images_in(page)] == ["loss", "learning rate"]
    assert "--validate_every" in page and not (out / "report.html").exists()


def test_report_bad_input_names_the_problem(tmp_path):
    from diffsynth_qie.training.report import write_report

    assert main(["report", str(tmp_path / "missing")]) == 2  # a user error: exit code 2, no traceback
    with pytest.raises(ValueError, match=r"missing is not a directory"):
        write_report(tmp_path / "missing")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "loss.jsonl")) + " not found"):
        write_report(tmp_path)
    (tmp_path / "loss.jsonl").write_text(json.dumps({"step": 1, "val_psnr": 20.0}) + "\n")
    with pytest.raises(ValueError, match="has no logged loss"):
        write_report(tmp_path)
    (tmp_path / "loss.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match=re.escape("smoothing must be in [0, 1), got 1.0")):
        write_report(tmp_path, smoothing=1.0)
    assert not (tmp_path / "report.html").exists()


def test_report_help_names_its_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "OUTPUT_DIR" in text and "--smoothing" in text and "--out" in text


def test_report_selects_the_best_step_and_shows_the_worst_rows(run_dir):
    from diffsynth_qie.training.report import best_step, build_report
    from diffsynth_qie.training.tracking import read_loss_log
    from diffsynth_qie.training.validation_metrics import write_scores

    out, _, strips = run_dir
    records = read_loss_log(out / "loss.jsonl")
    assert best_step(records, "val_psnr") == (6, 26.0)
    assert best_step(records, "val_lpips") == (6, pytest.approx(0.34))       # lower is better
    (out / "checkpoint-6").mkdir()
    write_scores(out / "validation" / "step-6" / "scores.jsonl",
                 {"0-entry_0": {"psnr": 30.0}, "1-entry_1": {"psnr": 12.0}})
    page = build_report(out, select_by="val_psnr", worst=1)
    assert "Best by val_psnr" in page and "checkpoint-6" in page
    worst = [img for alt, img in images_in(page) if alt == "1-entry_1"]
    assert len(worst) == 3 and "1-entry_1: psnr 12<" in page  # the worst row: in the selection, then steps 3 and 6
    assert np.array_equal(np.asarray(worst[0]), np.asarray(strips[(6, "1-entry_1")]))
    with pytest.raises(ValueError, match="--select_by val_nope: not in .*val_psnr"):
        build_report(out, select_by="val_nope")


def test_report_shows_the_held_out_edits_with_every_reference(run_dir, tmp_path):
    """The grid `qie eval-edits --grid` wrote into the run's directory (a row with two references here) is in the
    page pixel for pixel; without it the page has no such section."""
    from diffsynth_qie.inference.evaluate import EvalCase, compare_grid
    from diffsynth_qie.training.report import HELDOUT_GRID_NAME, build_report

    out, _, _ = run_dir
    assert "Held-out edits" not in build_report(out)
    refs = [Image.new("RGB", (16, 16), c) for c in ("red", "green")]
    grid = compare_grid([EvalCase(refs, "p", Image.new("RGB", (16, 16), "black"))], [[Image.new("RGB", (16, 16))]])
    grid.save(out / HELDOUT_GRID_NAME)
    shown = [img for alt, img in images_in(build_report(out)) if alt == "held-out edits"]
    assert len(shown) == 1 and np.array_equal(np.asarray(shown[0]), np.asarray(grid))
    assert shown[0].size == (4 * 16, 16)  # both references | output | target
