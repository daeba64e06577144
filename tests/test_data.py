"""Data layer: metadata formats, image decoding rules, validation, demo data."""
from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from diffsynth_qie.data import (DEFAULT_MAX_BAD_FRACTION, EditRow, FieldNames, SkippedRow, check_bad_fraction,
                                fit_to_budget, image_bytes_hash, load_mask, load_rgb, prepare_rows, read_rows,
                                resize_to, to_mask, to_rgb, validate_rows, write_skipped)
from diffsynth_qie.data.demo import MIXED_SIZES, make_demo_data, make_demo_jsonl
from diffsynth_qie.data.formats import T2I_REASON


# ---------------------------------------------------------------- helpers

def _png(path: Path, size=(32, 16), colour=(10, 20, 30), mode="RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    return path


@pytest.fixture
def img_dir(tmp_path):
    """Four small images a.png..d.png plus a matching mask under tmp_path/imgs."""
    d = tmp_path / "imgs"
    for name, c in zip("abcd", [(255, 0, 0), (0, 255, 0), (0, 0, 255), (9, 9, 9)]):
        _png(d / f"{name}.png", colour=c)
    _png(d / "m.png", mode="L", colour=255)
    return d


def _write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    return path


# ---------------------------------------------------------------- formats

def test_diffsynth_json_paths_and_fields(tmp_path, img_dir):
    abs_src = str(img_dir / "c.png")
    meta = [
        {"prompt": "make it red", "image": "imgs/a.png", "edit_image": ["imgs/b.png", abs_src],
         "back_mask": "imgs/m.png", "ref_gt": "imgs/d.png"},
        {"prompt": "one source as a string", "image": "imgs/b.png", "edit_image": "imgs/a.png", "id": "custom-7"},
    ]
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    rows = read_rows(tmp_path / "metadata.json", dataset_name="ds")
    assert [r.row_id for r in rows] == ["ds:0", "custom-7"]
    r0, r1 = rows
    assert r0.prompts == ["make it red"] and r0.target == tmp_path / "imgs/a.png"
    assert r0.edit_images == [tmp_path / "imgs/b.png", Path(abs_src)]
    assert r0.back_mask == tmp_path / "imgs/m.png" and r0.ref_gt == tmp_path / "imgs/d.png"
    assert r0.dataset == "ds" and not r0.inverse and r0.num_sources == 2
    assert r1.edit_images == [tmp_path / "imgs/a.png"] and r1.back_mask is None and r1.ref_gt is None
    # explicit base_dir: paths resolve against it, not the metadata directory
    other = tmp_path / "meta"
    other.mkdir()
    (other / "m.json").write_text(json.dumps(meta))
    rows2 = read_rows(other / "m.json", base_dir=tmp_path)
    assert rows2[0].target == tmp_path / "imgs/a.png"
    assert rows2[0].dataset == "meta"  # default name: the metadata file's directory


def test_diffsynth_jsonl_and_csv_agree(tmp_path, img_dir):
    recs = [
        {"prompt": "p0", "image": "imgs/a.png", "edit_image": ["imgs/b.png", "imgs/c.png"], "back_mask": "imgs/m.png"},
        {"prompt": "p1", "image": "imgs/b.png", "edit_image": "imgs/a.png", "ref_gt": "imgs/d.png"},
    ]
    _write_jsonl(tmp_path / "m.jsonl", recs)
    with open(tmp_path / "m.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "image", "edit_image", "back_mask", "ref_gt"])
        w.writeheader()
        w.writerow({"prompt": "p0", "image": "imgs/a.png", "edit_image": json.dumps(["imgs/b.png", "imgs/c.png"]),
                    "back_mask": "imgs/m.png", "ref_gt": ""})
        w.writerow({"prompt": "p1", "image": "imgs/b.png", "edit_image": "imgs/a.png", "back_mask": "",
                    "ref_gt": "imgs/d.png"})
    a = read_rows(tmp_path / "m.jsonl", dataset_name="x")
    b = read_rows(tmp_path / "m.csv", dataset_name="x")
    assert len(a) == 2 and a == b
    assert a[0].edit_images == [tmp_path / "imgs/b.png", tmp_path / "imgs/c.png"]
    assert a[0].ref_gt is None and a[1].back_mask is None and a[1].ref_gt == tmp_path / "imgs/d.png"


def _firered_records():
    return [
        {"source_image": "imgs/a.png", "target_image": "imgs/b.png", "instruction": "make it green",
         "instruction_cn": "变成绿色", "inverse_instruction": "make it red", "inverse_instruction_cn": "变成红色"},
        {"source_image": ["imgs/a.png", "imgs/c.png"], "target_image": "imgs/d.png", "instruction": "merge",
         "instruction_cn": "", "inverse_instruction": "split"},  # 2 sources: no inverse row
        {"source_image": None, "target_image": "imgs/c.png", "instruction": "a blue square",
         "instruction_cn": "蓝色正方形"},
        {"source_image": "imgs/c.png", "target_image": "imgs/a.png", "instruction": "", "instruction_cn": "只有中文"},
    ]


def test_firered_jsonl_inverse_and_t2i(tmp_path, img_dir):
    path = _write_jsonl(tmp_path / "fr.jsonl", _firered_records())
    skipped: list[SkippedRow] = []
    rows = read_rows(path, dataset_name="fr", skipped=skipped)
    by_id = {r.row_id: r for r in rows}
    assert set(by_id) == {"fr:0", "fr:0#inverse", "fr:1", "fr:3"}
    assert by_id["fr:0"].prompts == ["make it green", "变成绿色"]
    inv = by_id["fr:0#inverse"]
    assert inv.inverse and inv.prompts == ["make it red", "变成红色"]
    assert inv.target == tmp_path / "imgs/a.png" and inv.edit_images == [tmp_path / "imgs/b.png"]
    assert by_id["fr:1"].prompts == ["merge"] and by_id["fr:1"].num_sources == 2
    assert by_id["fr:3"].prompts == ["只有中文"]
    assert [(s.row_id, s.field, s.reason) for s in skipped] == [("fr:2", "source_image", T2I_REASON)]

    rows_t2i = read_rows(path, dataset_name="fr", t2i_mode=True)
    t2i = [r for r in rows_t2i if r.is_t2i]
    assert [(r.row_id, r.prompts, r.target) for r in t2i] == [("fr:2", ["a blue square", "蓝色正方形"],
                                                              tmp_path / "imgs/c.png")]
    no_inv = read_rows(path, dataset_name="fr", t2i_mode=True, disable_inverse=True)
    assert not any(r.inverse for r in no_inv) and len(no_inv) == len(rows_t2i) - 1


def test_field_overrides(tmp_path, img_dir):
    recs = [{"src": ["imgs/a.png"], "tgt": "imgs/b.png", "en": "edit", "zh": "编辑", "inv": "undo", "key": "k1",
             "mask": "imgs/m.png"}]
    path = _write_jsonl(tmp_path / "custom.jsonl", recs)
    fields = FieldNames(source_field="src", target_field="tgt", instruction_field="en", instruction_cn_field="zh",
                        inverse_instruction_field="inv", id_field="key", back_mask_field="mask")
    rows = read_rows(path, fields=fields)
    assert [r.row_id for r in rows] == ["k1", "k1#inverse"]
    assert rows[0].prompts == ["edit", "编辑"] and rows[0].back_mask == tmp_path / "imgs/m.png"
    assert rows[1].prompts == ["undo"]
    with pytest.raises(ValueError, match="--target_field"):
        read_rows(path)  # default names find neither format


def test_malformed_files_raise_with_location(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "image": "x.png", "edit_image": "y.png"}\n{"prompt": "b", "image": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON line"):
        read_rows(bad)
    notlist = tmp_path / "obj.json"
    notlist.write_text(json.dumps({"rows": []}, indent=2))
    with pytest.raises(ValueError, match="expected a JSON list"):
        read_rows(notlist)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"prompt": "a",\n "image": }]')
    with pytest.raises(ValueError, match=r"broken\.json:2: invalid JSON"):
        read_rows(broken)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        read_rows(tmp_path / "nope.json")


def test_row_level_parse_problems_are_skipped(tmp_path, img_dir):
    recs = [
        {"id": "dup", "prompt": "a", "image": "imgs/a.png", "edit_image": "imgs/b.png"},
        {"id": "dup", "prompt": "b", "image": "imgs/b.png", "edit_image": "imgs/a.png"},
        {"prompt": "c", "image": "", "edit_image": "imgs/a.png"},
        {"prompt": "d", "image": "https://example.com/x.png", "edit_image": "imgs/a.png"},
        {"prompt": "e", "image": "imgs/a.png", "edit_image": []},
    ]
    skipped: list[SkippedRow] = []
    rows = read_rows(_write_jsonl(tmp_path / "m.jsonl", recs), dataset_name="d", skipped=skipped)
    assert [r.row_id for r in rows] == ["dup"]
    got = {(s.row_id, s.field, s.reason.split(";")[0]) for s in skipped}
    assert got == {("dup", "id", "duplicate id (first used by record 0)"), ("d:2", "image", "missing value"),
                   ("d:3", "image", "URLs are not supported"), ("d:4", "edit_image", "no source image")}


# ---------------------------------------------------------------- image decoding

def test_exif_orientation_is_applied(tmp_path):
    arr = np.zeros((20, 40, 3), np.uint8)  # stored 40 wide, 20 high: left red, right blue
    arr[:, :20] = (255, 0, 0)
    arr[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    path = tmp_path / "rot.jpg"
    Image.fromarray(arr).save(path, exif=exif.tobytes(), quality=95)
    assert Image.open(path).size == (40, 20)
    im = load_rgb(path)
    assert im.size == (20, 40) and im.mode == "RGB"
    out = np.asarray(im).astype(int)
    assert out[5, 10, 0] > 200 and out[5, 10, 2] < 60  # former left (red) is now on top
    assert out[35, 10, 2] > 200 and out[35, 10, 0] < 60
    # the mask loader applies the same rotation
    m = np.zeros((20, 40), np.uint8)
    m[:, :20] = 255
    Image.fromarray(m).save(tmp_path / "rot_mask.jpg", exif=exif.tobytes(), quality=95)
    mask = np.asarray(load_mask(tmp_path / "rot_mask.jpg"))
    assert mask.shape == (40, 20) and mask[:18].min() == 255 and mask[22:].max() == 0


def test_alpha_gray_16bit_cmyk_conversions(tmp_path):
    rgba = np.zeros((2, 3, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)     # opaque red stays red
    rgba[0, 1] = (255, 0, 0, 0)       # transparent -> white
    rgba[0, 2] = (0, 0, 0, 128)       # half black on white -> ~127 gray
    rgba[1] = (0, 255, 0, 255)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    out = np.asarray(load_rgb(tmp_path / "a.png")).astype(int)
    assert out[0, 0].tolist() == [255, 0, 0] and out[0, 1].tolist() == [255, 255, 255]
    assert np.all(np.abs(out[0, 2] - 127) <= 1) and out[1, 0].tolist() == [0, 255, 0]

    la = Image.fromarray(np.array([[[50, 255], [50, 0]]], np.uint8), "LA")
    assert np.asarray(to_rgb(la)).tolist() == [[[50, 50, 50], [255, 255, 255]]]

    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    pal.putdata([0, 1])
    pal.info["transparency"] = 0
    pal.save(tmp_path / "p.png")
    assert np.asarray(load_rgb(tmp_path / "p.png")).tolist() == [[[255, 255, 255], [200, 10, 10]]]

    Image.fromarray(np.array([[0, 77, 255]], np.uint8), "L").save(tmp_path / "g.png")
    assert np.asarray(load_rgb(tmp_path / "g.png")).tolist() == [[[0] * 3, [77] * 3, [255] * 3]]

    vals16 = np.array([[0, 257 * 100, 65535, 257 * 200 + 100]], np.uint16)
    Image.fromarray(vals16).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    got16 = np.asarray(load_rgb(tmp_path / "g16.png"))[0, :, 0].tolist()
    assert got16 == [0, 100, 255, 200]
    as_i = Image.fromarray(vals16.astype(np.int32), "I")  # how older PIL decodes 16-bit PNGs
    assert np.asarray(to_rgb(as_i))[0, :, 1].tolist() == [0, 100, 255, 200]

    cmyk = Image.new("CMYK", (1, 1), (0, 255, 255, 0))
    assert np.asarray(to_rgb(cmyk)).tolist() == [[[255, 0, 0]]]
    cmyk.save(tmp_path / "c.jpg")
    r, g, b = np.asarray(load_rgb(tmp_path / "c.jpg"))[0, 0].astype(int)
    assert r > 200 and g < 60 and b < 60


def test_mask_rules():
    gray = Image.fromarray(np.array([[0, 127, 128, 255]], np.uint8), "L")
    assert np.asarray(to_mask(gray)).tolist() == [[0, 0, 255, 255]]
    rgb = Image.fromarray(np.array([[[255, 255, 255], [0, 0, 0], [200, 200, 200]]], np.uint8), "RGB")
    assert np.asarray(to_mask(rgb)).tolist() == [[255, 0, 255]]
    # painted layer: transparent = keep, painted (any colour) = edit
    layer = Image.fromarray(np.array([[[0, 0, 0, 0], [10, 10, 10, 255], [255, 255, 255, 0]]], np.uint8), "RGBA")
    assert np.asarray(to_mask(layer)).tolist() == [[0, 255, 0]]
    m16 = Image.fromarray(np.array([[0, 65535, 257 * 100]], np.uint16))
    assert np.asarray(to_mask(m16)).tolist() == [[0, 255, 0]]


def test_truncated_and_corrupt_images_are_errors(tmp_path):
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
    for ext in ("png", "jpg"):
        full = tmp_path / f"full.{ext}"
        noise.save(full)
        data = full.read_bytes()
        (tmp_path / f"trunc.{ext}").write_bytes(data[: len(data) // 2])
        with pytest.raises(ValueError, match=f"trunc.{ext}"):
            load_rgb(tmp_path / f"trunc.{ext}")
    assert not ImageFile.LOAD_TRUNCATED_IMAGES
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    with pytest.raises(ValueError, match="junk.png"):
        load_rgb(tmp_path / "junk.png")
    with pytest.raises(FileNotFoundError, match="absent.png"):
        load_rgb(tmp_path / "absent.png")


def test_image_bytes_hash(tmp_path):
    a = _png(tmp_path / "a.png", colour=(1, 2, 3))
    h1 = image_bytes_hash(a)
    assert h1 == image_bytes_hash(a) and len(h1) == 64
    _png(a, colour=(1, 2, 4))
    assert image_bytes_hash(a) != h1


# ---------------------------------------------------------------- resizing

@pytest.mark.parametrize("divisor", [8, 16, 32])
def test_fit_to_budget_properties(divisor):
    sides = [1, 7, 15, 16, 17, 63, 64, 100, 255, 512, 777, 1024, 1536, 2048, 4000, 9000]
    budgets = [divisor * divisor, 64 * 64, 100_000, 512 * 512, 1024 * 1024]
    for w in sides:
        for h in sides:
            for budget in budgets:
                w2, h2 = fit_to_budget(w, h, budget, divisor)
                assert w2 * h2 <= budget
                assert w2 % divisor == 0 and h2 % divisor == 0 and w2 >= divisor and h2 >= divisor
                scale = min(1.0, math.sqrt(budget / (w * h)))
                clamped = w * scale < divisor or h * scale < divisor
                # never larger than the scaled size (no upscaling), except a side clamped up to divisor
                assert w2 <= max(divisor, w * scale + 1e-6) and h2 <= max(divisor, h * scale + 1e-6)
                if not clamped:  # rounding down loses less than one divisor per side -> aspect kept
                    assert w2 > w * scale - divisor and h2 > h * scale - divisor
    # already fits and divisible -> unchanged; upscale=True reaches the budget
    assert fit_to_budget(96, 64, 512 * 512) == (96, 64)
    up = fit_to_budget(96, 64, 512 * 512, upscale=True)
    assert up[0] * up[1] > 0.9 * 512 * 512 and abs(up[0] / up[1] - 1.5) < 0.05
    with pytest.raises(ValueError, match="max_pixels"):
        fit_to_budget(64, 64, 100, 16)


def test_resize_to_rgb_and_mask():
    rgb = Image.new("RGB", (100, 50), (10, 200, 30))
    out = resize_to(rgb, (48, 32))
    assert out.size == (48, 32) and out.mode == "RGB"
    assert np.abs(np.asarray(out).astype(int) - [10, 200, 30]).max() <= 1
    m = np.zeros((64, 64), np.uint8)
    m[16:48, 8:24] = 255
    small = np.asarray(resize_to(Image.fromarray(m, "L"), (16, 16)))
    assert set(np.unique(small).tolist()) <= {0, 255}
    assert small[4:12, 2:6].min() == 255 and small[:, 8:].max() == 0 and small[:3].max() == 0
    with pytest.raises(ValueError, match="mode"):
        resize_to(Image.new("RGBA", (4, 4)), (2, 2))


# ---------------------------------------------------------------- validation

def test_validate_rows_reports_each_problem(tmp_path, img_dir):
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "full.jpg")
    data = (tmp_path / "full.jpg").read_bytes()
    (img_dir / "trunc.jpg").write_bytes(data[: len(data) // 2])
    _png(img_dir / "small_mask.png", size=(16, 16), mode="L", colour=255)
    _png(img_dir / "m_rot.png", size=(16, 32), mode="L", colour=255)
    p = lambda n: img_dir / n  # noqa: E731
    rows = [
        EditRow("good", ["ok"], p("a.png"), [p("b.png")], back_mask=p("m.png"), ref_gt=p("d.png")),
        EditRow("missing", ["ok"], p("a.png"), [p("nope.png")]),
        EditRow("empty", ["  ", ""], p("a.png"), [p("b.png")]),
        EditRow("noprompt", [], p("a.png"), [p("b.png")]),
        EditRow("trunc", ["ok"], p("trunc.jpg"), [p("b.png")]),
        EditRow("masksize", ["ok"], p("a.png"), [p("b.png")], back_mask=p("small_mask.png")),
        EditRow("masktransposed", ["ok"], p("a.png"), [p("b.png")], back_mask=p("m_rot.png")),
        EditRow("badref", ["ok"], p("a.png"), [p("b.png")], ref_gt=p("trunc.jpg")),
        EditRow("t2i", ["a cat"], p("a.png"), []),
    ]
    good, skipped = validate_rows(rows)
    assert [r.row_id for r in good] == ["good", "t2i"]
    got = {s.row_id: (s.field, s.path, s.reason) for s in skipped}
    assert set(got) == {"missing", "empty", "noprompt", "trunc", "masksize", "masktransposed", "badref"}
    assert got["missing"] == ("edit_images[0]", str(p("nope.png")), "missing file")
    assert got["empty"] == ("prompts", None, "empty prompt") and got["noprompt"] == ("prompts", None, "empty prompt")
    assert got["trunc"][:2] == ("target", str(p("trunc.jpg"))) and "truncated" in got["trunc"][2]
    assert got["masksize"][0] == "back_mask" and "16x16 differs from target image size 32x16" in got["masksize"][2]
    assert got["masktransposed"][0] == "back_mask"
    assert got["badref"][:2] == ("ref_gt", str(p("trunc.jpg")))
    # without image checks only existence and prompts are checked
    good2, skipped2 = validate_rows(rows, check_images=False)
    assert {s.row_id for s in skipped2} == {"missing", "empty", "noprompt"}


def test_write_skipped_roundtrip(tmp_path):
    skipped = [SkippedRow("a:1", "target", "/x/y.png", "missing file"),
               SkippedRow("b", "prompts", None, "empty prompt")]
    path = write_skipped(tmp_path / "out" / "skipped.jsonl", skipped)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [{"row_id": "a:1", "field": "target", "path": "/x/y.png", "reason": "missing file"},
                     {"row_id": "b", "field": "prompts", "path": None, "reason": "empty prompt"}]
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind
    write_skipped(path, [])
    assert path.read_text() == ""


def test_bad_fraction_threshold():
    bad = [SkippedRow(f"r{i}", "target", f"/d/{i}.png", "missing file") for i in range(2)]
    check_bad_fraction(40, bad, DEFAULT_MAX_BAD_FRACTION, "meta.json")  # 5% is allowed
    with pytest.raises(ValueError) as e:
        check_bad_fraction(20, bad, 0.05, "/data/meta.json", "/out/skipped.jsonl")
    msg = str(e.value)
    for part in ("2 of 20 rows (10.0%)", "/data/meta.json", "--max_bad_fraction 0.05", "2x target: missing file",
                 "/out/skipped.jsonl"):
        assert part in msg
    check_bad_fraction(20, bad, 0.1, "meta.json")
    with pytest.raises(ValueError, match="all 2 rows"):
        check_bad_fraction(2, bad, 1.0, "meta.json")
    with pytest.raises(ValueError, match="no rows"):
        check_bad_fraction(0, [], 1.0, "meta.json")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_bad_fraction(10, [], 5, "meta.json")


def test_prepare_rows_end_to_end(tmp_path):
    d = make_demo_data(tmp_path / "demo", num_pairs=10, seed=3)
    (d / "images" / "004_src.png").unlink()
    skipped_path = tmp_path / "cache" / "skipped.jsonl"
    with pytest.raises(ValueError, match="1 of 10 rows"):
        prepare_rows(d / "metadata.json", skipped_path=skipped_path)
    assert json.loads(skipped_path.read_text())["row_id"] == "demo:4"
    good, skipped = prepare_rows(d / "metadata.json", max_bad_fraction=0.1, skipped_path=skipped_path)
    assert len(good) == 9 and [(s.row_id, s.field) for s in skipped] == [("demo:4", "edit_images[0]")]


# ---------------------------------------------------------------- demo data

def _all_files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_demo_data_is_deterministic(tmp_path):
    a = _all_files(make_demo_data(tmp_path / "a", num_pairs=12, seed=5))
    b = _all_files(make_demo_data(tmp_path / "b", num_pairs=12, seed=5))
    c = _all_files(make_demo_data(tmp_path / "c", num_pairs=12, seed=6))
    assert a == b and len(a) == 1 + 12 * 4 + 3  # metadata + 4 files per pair + 3 swatches
    assert a != c and a["images/000_tgt.png"] != c["images/000_tgt.png"]


def test_demo_data_content(tmp_path):
    d = make_demo_data(tmp_path / "demo", num_pairs=20, seed=0)
    meta = json.loads((d / "metadata.json").read_text())
    assert len(meta) == 20
    assert all(set(r) == {"prompt", "image", "edit_image", "back_mask", "ref_gt"} for r in meta)
    n_src = [len(r["edit_image"]) for r in meta]
    assert n_src.count(2) == 5 and n_src.count(1) == 15
    sizes = set()
    for r in meta:
        src, tgt = load_rgb(d / r["edit_image"][0]), load_rgb(d / r["image"])
        mask = np.asarray(load_mask(d / r["back_mask"])) > 0
        assert src.size == tgt.size == load_rgb(d / r["ref_gt"]).size == mask.shape[::-1]
        assert 64 <= min(src.size) and max(src.size) <= 128 and src.size[0] % 16 == 0 and src.size[1] % 16 == 0
        sizes.add(src.size)
        s, t = np.asarray(src), np.asarray(tgt)
        assert np.array_equal(s[~mask], t[~mask]), r  # outside the mask nothing changes
        assert (s[mask] != t[mask]).any(), r          # inside it the edit is visible
        assert 0.01 < mask.mean() < 0.7
        if len(r["edit_image"]) == 2:
            assert "picture 2" in r["prompt"]
            swatch = np.asarray(load_rgb(d / r["edit_image"][1]))
            assert (t[mask] == swatch[0, 0]).all(axis=-1).any()  # the target uses the swatch colour
    assert sizes == set(MIXED_SIZES)
    same = make_demo_data(tmp_path / "small", num_pairs=4, seed=0, mixed_sizes=False)
    assert {load_rgb(same / r["image"]).size for r in json.loads((same / "metadata.json").read_text())} == {(64, 64)}
    good, skipped = prepare_rows(d / "metadata.json", max_bad_fraction=0.0)
    assert len(good) == 20 and skipped == []


def test_demo_jsonl_parses_every_kind(tmp_path):
    d = make_demo_jsonl(tmp_path / "fr", num_pairs=8, seed=0)
    recs = [json.loads(x) for x in (d / "metadata.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(recs) == 10 and sum(r["source_image"] is None for r in recs) == 2
    assert sum(isinstance(r["source_image"], list) for r in recs) == 2
    n_inverse = sum(bool(r.get("inverse_instruction")) and isinstance(r["source_image"], str) for r in recs)
    good, skipped = prepare_rows(d / "metadata.jsonl", t2i_mode=True, max_bad_fraction=0.0)
    assert skipped == [] and len(good) == 10 + n_inverse and n_inverse == 6
    assert all(len(r.prompts) == 2 for r in good)  # English + Chinese everywhere
    assert sum(r.is_t2i for r in good) == 2 and sum(r.inverse for r in good) == n_inverse
    # without --t2i_mode the two t2i rows are bad rows, with the hint in the reason
    rows_skipped: list[SkippedRow] = []
    read_rows(d / "metadata.jsonl", skipped=rows_skipped)
    assert [s.reason for s in rows_skipped] == [T2I_REASON, T2I_REASON]


def test_make_demo_data_command(tmp_path):
    from diffsynth_qie.commands import make_demo_data as cmd

    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "x"), "--num_pairs", "3", "--format", "both",
                              "--no-mixed_sizes"])
    assert cmd.run(args) == 0
    assert len(json.loads((tmp_path / "x" / "metadata.json").read_text())) == 3
    assert len((tmp_path / "x" / "metadata.jsonl").read_text().splitlines()) == 5
    assert Image.open(tmp_path / "x" / "images" / "002_tgt.png").size == (64, 64)
