"""`qie check-dataset` on real photos (the labelled benchmark, `benchmarks/pairs_bench.py`): every error flag
at >= 95 % precision and recall, at most 5 % of the clean rows with an error; the demo data gets no error; bad
input is a per-row error, never a crash; `--vl_check` refuses a folder without weights before it loads anything."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_the_benchmark_of_real_photos_meets_its_targets(tmp_path):
    pytest.importorskip("skimage", reason="the benchmark's photos come with scikit-image (the dev extra)")
    from benchmarks.pairs_bench import CASES, format_table, run_benchmark

    cases = json.loads(CASES.read_text())
    kinds = {f for c in cases for f in c["expect"]}
    assert kinds >= {"near_identical", "no_op", "shifted", "scale_mismatch", "duplicate", "reversed",
                     "changes_outside_mask", "mask_empty", "mask_aspect", "wrong_source"}
    table, _, _ = run_benchmark(cases, 256, 2, tmp_path / "bench")
    report = format_table(table)
    for name, t in table.items():
        if not name.startswith("_") and t["severity"] == "error":
            assert t["precision"] >= 0.95 and t["recall"] >= 0.95, report
    assert table["_clean"]["with_error"] <= 0.05 * table["_clean"]["rows"], report
    assert table["_clean"]["rows"] >= 50


def test_the_demo_data_gets_no_error(tmp_path):
    from diffsynth_qie.cli import main

    assert main(["make-demo-data", "--out", str(tmp_path / "demo"), "--num_pairs", "36"]) == 0
    assert main(["check-dataset", str(tmp_path / "demo" / "metadata.json"), "--out", str(tmp_path / "c"),
                 "--workers", "0"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "c" / "check.jsonl").read_text().splitlines()]
    assert [r["row_id"] for r in rows if any(i["severity"] == "error" for i in r["issues"].values())] == []


def test_bad_input_is_a_row_error_never_a_crash(tmp_path):
    from diffsynth_qie.data.check import CheckConfig, check_rows

    rng = np.random.default_rng(0)
    good = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
    good.save(tmp_path / "s.png")
    good.save(tmp_path / "t.png")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "corrupt.png").write_bytes((tmp_path / "s.png").read_bytes()[:300])
    Image.fromarray((rng.integers(0, 65535, (64, 64))).astype(np.uint16)).save(tmp_path / "deep.png")
    Image.new("1", (9000, 8000)).save(tmp_path / "huge.png")
    Image.new("L", (80, 20), 255).save(tmp_path / "wide_mask.png")
    (tmp_path / "loop").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop")
    cases = {"missing": "nope.png", "empty": "empty.png", "corrupt": "corrupt.png", "huge": "huge.png",
             "loop": "loop", "deep": "deep.png"}
    rows = [{"row_id": k, "target": str(tmp_path / v), "source": str(tmp_path / "s.png"), "mask": None}
            for k, v in cases.items()]
    rows.append({"row_id": "mask", "target": str(tmp_path / "t.png"), "source": str(tmp_path / "s.png"),
                 "mask": str(tmp_path / "wide_mask.png")})
    rows.append({"row_id": "no_target", "target": None, "source": str(tmp_path / "s.png"), "mask": None})
    checks, _ = check_rows(rows, CheckConfig(workers=0), show_progress=False)
    flags = {c.row_id: c for c in checks}
    for rid in ("missing", "empty", "corrupt", "huge", "loop", "no_target"):
        assert flags[rid].severity() == "error" and "unreadable" in flags[rid].flags, (rid, flags[rid].flags)
        assert flags[rid].issues["unreadable"]["reason"]
    assert "unreadable" not in flags["deep"].flags and "error" not in flags["deep"].flags  # 16-bit reads
    assert flags["mask"].flags["mask_aspect"] == "mask 80x20, target 64x64"


def test_write_clean_drops_errors_only_unless_told(tmp_path):
    from diffsynth_qie.cli import main
    from test_check_dataset import save, scene

    square = np.zeros((96, 96), np.uint8)
    square[30:66, 30:66] = 255
    rows = []
    for i in range(3):
        rows.append({"id": f"ok{i}", "prompt": "make the red square blue", "image": save(tmp_path / f"{i}t.png", scene(
            i, (30, 30, 200))), "edit_image": save(tmp_path / f"{i}s.png", scene(i)),
            "back_mask": save(tmp_path / f"{i}m.png", square, "L")})
    rows[1]["back_mask"] = save(tmp_path / "full.png", np.full_like(square, 255), "L")  # a hint
    rows[2]["image"] = rows[2]["edit_image"]  # an error
    (tmp_path / "m.json").write_text(json.dumps(rows))
    for drop, kept in (("error", ["ok0", "ok1"]), ("hint", ["ok0"])):
        out = tmp_path / f"clean_{drop}.json"
        assert main(["check-dataset", str(tmp_path / "m.json"), "--out", str(tmp_path / drop), "--write_clean",
                     str(out), "--drop", drop, "--workers", "0"]) == 0
        assert [r["id"] for r in json.loads(out.read_text())] == kept


def test_vl_check_refuses_a_folder_without_weights_and_loads_one_with_them(tmp_path, monkeypatch):
    from diffsynth_qie.data import check_vl

    with pytest.raises(ValueError, match="no such folder"):
        check_vl.VLJudge.load(tmp_path / "nope")
    enc = tmp_path / "text_encoder"
    enc.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        check_vl.VLJudge.load(enc)
    (enc / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ValueError, match="cannot look at images"):
        check_vl.VLJudge.load(enc)
    (enc / "config.json").write_text(json.dumps({"architectures": ["Qwen2_5_VLForConditionalGeneration"]}))
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        check_vl.VLJudge.load(enc)
    (enc / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no processor"):
        check_vl.VLJudge.load(enc)
    (tmp_path / "processor").mkdir()
    (tmp_path / "processor" / "preprocessor_config.json").write_text("{}")
    loads = []
    monkeypatch.setattr(check_vl, "_load_model", lambda path, proc: loads.append((path, proc)) or ("m", "p"))
    judge = check_vl.VLJudge.load(enc)  # the folder passes every check: the weights would load here
    assert loads == [(enc, tmp_path / "processor")] and judge.model == "m"


def test_vl_check_is_refused_before_the_dataset_is_measured(tmp_path):
    from diffsynth_qie.cli import main

    (tmp_path / "m.json").write_text("[]")
    assert main(["check-dataset", str(tmp_path / "m.json"), "--out", str(tmp_path / "c"), "--vl_check",
                 str(tmp_path / "nope")]) != 0
    assert not (tmp_path / "c" / "check.jsonl").exists()
