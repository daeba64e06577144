"""`qie make-dataset`: folders -> metadata that our own reader reads back row for row."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image


def image(path: Path, size=(64, 48), colour=(200, 30, 30), mode="RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour if mode == "RGB" else 255).save(path)
    return path


def parse(argv: list[str]):
    from diffsynth_qie.cli import build_parser

    return build_parser().parse_args(["make-dataset", *argv])


def make(argv: list[str]) -> int:
    args = parse(argv)
    return args._run(args)


@pytest.fixture
def folders(tmp_path):
    """a, g: good (a with a mask); b: mask of another size; c: unreadable source; d: no source;
    e: no prompt; f: 8x8 target; z: a source without a target; t.tmp-*: a temp file to ignore."""
    root = tmp_path / "data"
    for key in "abcdefg":
        image(root / "target" / f"{key}.png", (8, 8) if key == "f" else (64, 48))
        if key != "e":
            (root / "target" / f"{key}.txt").write_text(f"make {key} blue\n")
    for key in "abcefgz":
        image(root / "source" / f"{key}.jpg", colour=(10, 10, 250))
    (root / "source" / "c.jpg").write_bytes((root / "source" / "c.jpg").read_bytes()[:100])  # truncated
    image(root / "mask" / "a.png", (64, 48), mode="L")
    image(root / "mask" / "b.png", (32, 32), mode="L")
    (root / "source" / "t.png.tmp-123").write_bytes(b"partial")
    return root


def test_folders_become_metadata_that_read_rows_reads_back(folders):
    from diffsynth_qie.data.formats import read_rows

    out = folders / "meta" / "metadata.json"
    assert make(["--target", str(folders / "target"), "--source", str(folders / "source"),
                 "--mask", str(folders / "mask"), "--out", str(out), "--workers", "2"]) == 0
    records = json.loads(out.read_text())
    assert isinstance(records, list) and len(records) == 2
    for rec in records:  # relative to the metadata file's folder, never absolute
        for key in ("image", "edit_image", "back_mask"):
            if key in rec:
                assert not Path(rec[key]).is_absolute() and rec[key].startswith("../"), rec
    rows = read_rows(out)
    got = {r.target.resolve(): r for r in rows}
    assert set(got) == {(folders / "target" / f"{k}.png").resolve() for k in "ag"}
    a = got[(folders / "target" / "a.png").resolve()]
    assert a.prompts == ["make a blue"]
    assert [p.resolve() for p in a.edit_images] == [(folders / "source" / "a.jpg").resolve()]
    assert a.back_mask.resolve() == (folders / "mask" / "a.png").resolve()
    g = got[(folders / "target" / "g.png").resolve()]
    assert g.back_mask is None and g.prompts == ["make g blue"]

    skipped = [json.loads(line) for line in (out.parent / "metadata.json.skipped.jsonl").read_text().splitlines()]
    by_key = {s["row_id"]: s for s in skipped}
    assert set(by_key) == set("bcdef")
    assert by_key["b"]["field"] == "back_mask" and "64x48" in by_key["b"]["reason"]
    assert by_key["c"]["field"] == "edit_images[0]" and by_key["c"]["path"].endswith("c.jpg")
    assert by_key["d"]["field"] == "edit_images[0]" and "no source" in by_key["d"]["reason"]
    assert by_key["e"]["field"] == "prompts" and by_key["e"]["path"].endswith("e.txt")
    assert by_key["f"]["field"] == "target" and "8x8" in by_key["f"]["reason"]


def test_scan_reports_unmatched_stems_and_ignores_temp_files(folders):
    from diffsynth_qie.data.folders import FolderSpec, match_folders, validate

    scan = match_folders(FolderSpec(target=folders / "target", sources=[folders / "source"], mask=folders / "mask"))
    assert scan.unmatched == {str(folders / "source"): ["z"], str(folders / "mask"): []}
    scan = validate(scan, max_pixels=64 * 48, workers=0)  # in-process gives the same answer
    assert sorted(r.key for r in scan.rows) == ["a", "g"]
    assert scan.images_checked == 12  # a, b, c, f, g with their sources, and the masks of a and b (d, e: no match)
    assert "1 file(s) in" in scan.summary() and "z" in scan.summary()
    assert "1 row(s) written without a mask (none has this stem): g" in scan.summary()  # (c..f: not written)
    # a pixel budget below the images' 64x48 skips them all
    tight = validate(match_folders(FolderSpec(target=folders / "target", sources=[folders / "source"])),
                     max_pixels=64 * 48 - 1, workers=0)
    assert tight.rows == [] and {s.field for s in tight.skipped if s.row_id == "a"} == {"target"}


def test_multi_image_edits_with_a_prompts_file_keep_both_languages(tmp_path):
    from diffsynth_qie.data.formats import read_rows

    for key in ("x1", "x2"):
        image(tmp_path / "t" / f"{key}.png")
        image(tmp_path / "s1" / f"{key}.png", colour=(0, 255, 0))
        image(tmp_path / "s2" / f"{key}.webp", colour=(0, 0, 255))
    image(tmp_path / "single" / "x1.png")
    (tmp_path / "prompts.csv").write_text("stem,prompt,instruction_cn\nx1.png,put the cup on the table,把杯子放在桌上\n"
                                          "x2,add a hat,\n", encoding="utf-8")
    out = tmp_path / "out" / "meta.jsonl"
    assert make(["--target", str(tmp_path / "t"), "--source", str(tmp_path / "s1"), "--source",
                 str(tmp_path / "s2"), "--prompts", str(tmp_path / "prompts.csv"), "--out", str(out),
                 "--absolute_paths", "--workers", "0"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 2 and all(Path(r["target_image"]).is_absolute() for r in lines)
    rows = {r.target.name: r for r in read_rows(out)}
    assert rows["x1.png"].prompts == ["put the cup on the table", "把杯子放在桌上"]
    assert rows["x2.png"].prompts == ["add a hat"]
    assert [p.parent.name for p in rows["x1.png"].edit_images] == ["s1", "s2"]
    assert rows["x1.png"].edit_images[1].suffix == ".webp"

    # DiffSynth's fields cannot hold the second language: asked for explicitly, it is refused
    with pytest.raises(ValueError, match="--fields firered"):
        make(["--target", str(tmp_path / "t"), "--source", str(tmp_path / "s1"), "--prompts",
              str(tmp_path / "prompts.csv"), "--out", str(out), "--fields", "diffsynth", "--workers", "0"])
    # inverse instructions give FireRed-style rows, and read_rows adds the inverse row
    (tmp_path / "p.jsonl").write_text(json.dumps({"stem": "x1", "instruction": "add", "inverse_instruction": "remove"}))
    inv = tmp_path / "inv.json"
    make(["--target", str(tmp_path / "t"), "--source", str(tmp_path / "single"), "--prompts",
          str(tmp_path / "p.jsonl"), "--out", str(inv), "--workers", "0"])
    rows = read_rows(inv)
    assert [(r.prompts, r.inverse) for r in rows] == [(["add"], False), (["remove"], True)]
    assert rows[1].target.resolve() == (tmp_path / "single" / "x1.png").resolve()


def test_one_prompt_for_all(tmp_path):
    from diffsynth_qie.data.formats import read_rows

    for key in ("p", "q", "r"):
        image(tmp_path / "t" / "sub" / f"{key}.png")
        image(tmp_path / "s" / "sub" / f"{key}.png")
    out = tmp_path / "m.json"
    make(["--target", str(tmp_path / "t"), "--source", str(tmp_path / "s"), "--prompt", "relight",
          "--out", str(out), "--workers", "2"])
    rows = read_rows(out)
    assert [r.target.name for r in rows] == ["p.png", "q.png", "r.png"] and all(r.prompts == ["relight"] for r in rows)
    assert json.loads(out.read_text())[0]["image"] == "t/sub/p.png"


def test_bad_input_names_the_flag_and_the_fix(tmp_path, folders, capsys):
    t, s = str(folders / "target"), str(folders / "source")
    cases = [
        (["--target", str(tmp_path / "nope"), "--source", s, "--out", "m.json"], "is not a directory"),
        (["--target", t, "--source", s, "--out", str(tmp_path / "m.txt")], r"\.json or \.jsonl"),
        (["--target", t, "--source", s, "--out", str(tmp_path / "m.json"), "--format", "jsonl"], "--format jsonl"),
        (["--target", t, "--source", s, "--out", str(tmp_path / "m.json"), "--prompt", "x", "--prompts", "p.csv"],
         "not both"),
        (["--target", t, "--source", s, "--out", str(tmp_path / "m.json"), "--prompts", str(tmp_path / "no.csv")],
         "prompts file .* not found"),
        (["--target", t, "--source", str(image(tmp_path / "other" / "zz.png").parent), "--prompt", "x", "--out",
          str(tmp_path / "m.json"), "--workers", "0"], "no usable rows"),
    ]
    (tmp_path / "bad.csv").write_text("name,prompt\na,x\n")
    cases.append((["--target", t, "--source", s, "--out", str(tmp_path / "m.json"), "--prompts",
                   str(tmp_path / "bad.csv")], "no 'stem' field"))
    for argv, match in cases:
        with pytest.raises(ValueError, match=match):
            make(argv)
    assert not (tmp_path / "m.json").exists()
    with pytest.raises(SystemExit) as e:  # out of the declared range: argparse's usage error naming the flag
        parse(["--target", t, "--source", s, "--out", str(tmp_path / "m.json"), "--max_pixels", "10"])
    assert e.value.code == 2 and "argument --max_pixels: 10 is out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse(["--help"])
    assert e.value.code == 0 and "--source" in capsys.readouterr().out
