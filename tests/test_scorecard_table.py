"""`qie eval-edits`' scorecard side by side: means per column, win rates against the first column, the
few-step gap line, and the summary the launch scripts print from the JSON file."""
from __future__ import annotations

import json

import pytest

from diffsynth_qie.inference.scorecard_table import compare, format_table, gap_line, summary_text, win_line

BASE = [{"edit_psnr": 10.0, "preserve_psnr": 30.0, "shift_px": 1.0}, {"edit_psnr": 12.0, "shift_px": 0.0}]
LORA = [{"edit_psnr": 14.0, "preserve_psnr": 29.0, "shift_px": 0.0}, {"edit_psnr": 11.0, "shift_px": 0.0}]
FEW = [{"edit_psnr": 13.0, "preserve_psnr": 28.0, "shift_px": 0.0}, {"edit_psnr": 10.0, "shift_px": 0.0}]


def test_compare_means_and_win_rates():
    s = compare({"base": BASE, "lora": LORA, "lora@4": FEW})
    assert s["columns"] == ["base", "lora", "lora@4"] and s["rows"] == 2
    assert s["metrics"]["edit_psnr"] == {"base": 11.0, "lora": 12.5, "lora@4": 11.5}
    assert s["metrics"]["preserve_psnr"] == {"base": 30.0, "lora": 29.0, "lora@4": 28.0}  # one row has it
    assert s["wins"]["lora"]["edit_psnr"] == {"rate": 0.5, "rows": [0]}
    assert s["wins"]["lora"]["shift_px"] == {"rate": 0.75, "rows": [0]}  # lower is better; the tie counts half
    table = format_table(s)
    assert "edit_psnr ↑" in table and "shift_px ↓" in table and "50%" in table
    assert win_line(s).startswith("lora beats base on 50% of rows by edit_psnr (better rows: [0])")
    assert gap_line(s, "lora", ["lora@4"]) == "few-step gap vs lora: lora@4: edit_psnr -1.00 dB, preserve_psnr -1.00 dB"


def test_summary_text_reads_the_written_file(tmp_path):
    s = compare({"base": BASE, "lora": LORA})
    path = tmp_path / "scorecard.json"
    path.write_text(json.dumps({**s, "per_row": {"base": BASE, "lora": LORA}}))
    text = summary_text(str(path))
    assert text == format_table(s) + "\n" + win_line(s) + "\n"
    with pytest.raises(ValueError, match="at least one column"):
        compare({})


@pytest.mark.parametrize("argv, message", [
    (["--few_steps", "4"], "--few_steps scores a LoRA at fewer steps; pass --lora FILE too"),
    (["--lora", "{d}/l.safetensors", "--lbm_steps", "1", "--few_steps", "8"], "--few_steps 8 with --lbm_steps"),
    (["--export", "geditv2", "{d}/out"], "--export 'geditv2': choose one of gedit, imgedit"),
    (["--scorecard", "{d}"], "--scorecard .* is a directory"),
])
def test_eval_edits_refuses_bad_scorecard_flags_before_any_work(tmp_path, argv, message, capsys):
    import re

    from diffsynth_qie.cli import main

    (tmp_path / "m.json").write_text("[]")
    (tmp_path / "l.safetensors").write_bytes(b"x")
    assert main(["eval-edits", "--dataset_metadata", f"{tmp_path}/m.json"] + [a.format(d=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err
