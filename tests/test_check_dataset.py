"""`qie check-dataset` on a crafted dataset with one planted case of each kind: exactly those rows are flagged,
with the kind planted; the measured shift is the planted one (±1 px); clean pairs are not flagged."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

SIZE = 96


def scene(seed: int, square=(200, 30, 30), size=(SIZE, SIZE)) -> np.ndarray:
    """A smooth random background with a coloured square at (32..64, 32..64)."""
    rng = np.random.default_rng(seed)
    low = Image.fromarray(rng.integers(40, 215, (12, 12, 3), dtype=np.uint8)).resize(size, Image.BILINEAR)
    a = np.asarray(low).copy()
    if square is not None:
        a[32:64, 32:64] = square
    return a


def save(path: Path, a: np.ndarray, mode: str | None = None) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(a, mode).save(path)
    return path.name


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    d = tmp_path_factory.mktemp("crafted")
    square = np.zeros((SIZE, SIZE), np.uint8)
    square[30:66, 30:66] = 255
    rows = []

    def row(name, source, target, mask=None):
        rec = {"id": name, "prompt": "make the red square blue",
               "image": save(d / f"{name}_t.png", target), "edit_image": save(d / f"{name}_s.png", source)}
        if mask is not None:
            rec["back_mask"] = save(d / f"{name}_m.png", mask, "L")
        rows.append(rec)

    for i in range(3):  # clean: red square -> blue square, with its mask
        row(f"clean{i}", scene(i), scene(i, (30, 30, 200)), square)
    row("identical", scene(10), scene(10))
    s = scene(11)
    row("shifted", s, np.roll(scene(11, (30, 30, 200)), (3, 5), axis=(0, 1)))
    row("aspect", scene(12), np.asarray(Image.fromarray(scene(12, (30, 30, 200))).resize((128, SIZE))))
    zoomed = Image.fromarray(scene(20, (30, 30, 200))).crop((10, 10, 86, 86)).resize((SIZE, SIZE), Image.BICUBIC)
    row("zoomed", scene(20), np.asarray(zoomed))  # the target zoomed by 96/76 = 1.26
    rows.append({**rows[0], "id": "duplicate"})  # the files of clean0 again
    holdout_t = scene(13, (30, 30, 200))
    row("leak", scene(13), holdout_t)
    row("empty", scene(14), scene(14, (30, 30, 200)), np.zeros_like(square))
    row("full", scene(15), scene(15, (30, 30, 200)), np.full_like(square, 255))
    outside = scene(16, (30, 30, 200)).astype(np.int16)
    outside[:, :30] = np.clip(outside[:, :30] + 80, 0, 255)
    row("outside", scene(16), outside.astype(np.uint8), square)
    row("reversed", scene(17, (30, 30, 200)), scene(17), square)
    row("small", scene(18)[:8, :8].copy(), scene(18, (30, 30, 200))[:8, :8].copy())
    row("unreadable", scene(19), scene(19, (30, 30, 200)))
    (d / "unreadable_t.png").write_bytes((d / "unreadable_t.png").read_bytes()[:200])  # truncated
    (d / "metadata.json").write_text(json.dumps(rows))
    (d / "holdout.json").write_text(json.dumps([{"prompt": "x", "image": save(d / "held_t.png", holdout_t),
                                                  "edit_image": save(d / "held_s.png", scene(13))}]))
    return d


def test_exactly_the_planted_cases_are_flagged_with_their_kind(crafted, tmp_path):
    from diffsynth_qie.cli import main

    out = tmp_path / "check"
    assert main(["check-dataset", str(crafted / "metadata.json"), "--out", str(out), "--holdout",
                 str(crafted / "holdout.json"), "--write_clean", str(tmp_path / "clean.json"), "--workers", "2"]) == 0
    flagged = {r["row_id"]: r for r in map(json.loads, (out / "check.jsonl").read_text().splitlines())}
    kinds = {rid: set(r["flags"]) for rid, r in flagged.items()}
    assert kinds == {"identical": {"near_identical"}, "shifted": {"shifted"}, "aspect": {"aspect"},
                     "zoomed": {"scale_mismatch"},
                     "duplicate": {"duplicate"}, "leak": {"holdout_duplicate"}, "empty": {"mask_empty"},
                     "full": {"mask_full"}, "outside": {"changes_outside_mask"}, "reversed": {"reversed"},
                     "small": {"too_small"}, "unreadable": {"unreadable"}}
    dy, dx = flagged["shifted"]["flags"]["shifted"]
    assert abs(dy - 3) <= 1 and abs(dx - 5) <= 1
    assert flagged["duplicate"]["flags"]["duplicate"] == "clean0"
    assert abs(flagged["zoomed"]["flags"]["scale_mismatch"] - 96 / 76) <= 0.03
    clean = json.loads((tmp_path / "clean.json").read_text())
    # --write_clean drops errors only: the full mask around a small change is a hint, its row stays
    assert {rid: r["issues"]["mask_full"]["severity"] for rid, r in flagged.items() if "mask_full" in r["flags"]} == {
        "full": "hint"}
    assert [Path(r["image"]).name for r in clean] == ["clean0_t.png", "clean1_t.png", "clean2_t.png", "full_t.png"]
    assert all(i["reason"] and i["severity"] == "error" for rid, r in flagged.items() if rid != "full"
               for i in r["issues"].values())
    page = (out / "check.html").read_text()
    assert page.count('class="card"') == 12 and page.count("data:image/png;base64,") >= 27
    assert page.index("error: ") < page.index("hint: mask_full")  # grouped by severity, the errors first
    assert "derived mask" not in page
    assert main(["check-dataset", str(crafted / "metadata.json"), "--out", str(tmp_path / "derived"), "--auto_mask",
                 "--workers", "0"]) == 0
    page = (tmp_path / "derived" / "check.html").read_text()
    # the flagged rows without a mask of their own: identical, shifted, aspect, zoomed, small, unreadable (no --holdout)
    assert page.count("derived mask (--auto_mask diff)") == 6


def test_the_direction_heuristic_says_when_it_cannot_decide(tmp_path):
    """Three red->blue edits and three blue->red ones: no majority, so no row is judged, and the note says so."""
    from diffsynth_qie.data.check import CheckConfig, check_rows

    rows = []
    for i in range(6):
        red, blue = scene(30 + i), scene(30 + i, (30, 30, 200))
        source, target = (red, blue) if i < 3 else (blue, red)
        rows.append({"row_id": f"r{i}", "target": str(tmp_path / save(tmp_path / f"{i}_t.png", target)),
                     "source": str(tmp_path / save(tmp_path / f"{i}_s.png", source)), "mask": None})
    checks, note = check_rows(rows, CheckConfig(workers=0), show_progress=False)
    assert not any(c.flags for c in checks)
    assert note is not None and "no majority edit direction" in note


def test_make_dataset_check_runs_the_report_on_its_output(tmp_path):
    from diffsynth_qie.cli import main

    for i in range(3):
        save(tmp_path / "after" / f"{i}.png", scene(40 + i, (30, 30, 200)))
        save(tmp_path / "before" / f"{i}.png", scene(40 + i))
    save(tmp_path / "after" / "3.png", scene(43))
    save(tmp_path / "before" / "3.png", scene(43))  # an identical pair
    out = tmp_path / "meta.json"
    assert main(["make-dataset", "--target", str(tmp_path / "after"), "--source", str(tmp_path / "before"),
                 "--prompt", "make it blue", "--out", str(out), "--check", "--workers", "0"]) == 0
    flagged = [json.loads(line) for line in (tmp_path / "meta.json.check" / "check.jsonl").read_text().splitlines()]
    assert [set(r["flags"]) for r in flagged] == [{"near_identical"}]
    assert (tmp_path / "meta.json.check" / "check.html").is_file()
