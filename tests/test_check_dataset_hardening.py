"""`qie check-dataset` under attack: --write_clean never writes over its input and keeps every field of the rows
it keeps, one bad row never stops the check, check.jsonl is strict JSON, a mask of another aspect ratio is
flagged, the work is bounded (workers, the duplicate index, the page's size)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from test_check_dataset import save, scene  # noqa: E402


def _pairs(d: Path, n: int, start: int = 0) -> list[dict]:
    rows = []
    for i in range(start, start + n):
        rows.append({"image": save(d / f"{i}_t.png", scene(100 + i, (30, 30, 200))),
                     "edit_image": save(d / f"{i}_s.png", scene(100 + i))})
    return rows


def test_write_clean_refuses_its_own_input_and_the_file_is_untouched(tmp_path):
    from diffsynth_qie.cli import main

    rows = [{**r, "prompt": "blue"} for r in _pairs(tmp_path, 3)]
    meta = tmp_path / "metadata.json"
    meta.write_text(json.dumps(rows))
    before = meta.read_bytes()
    assert main(["check-dataset", str(meta), "--out", str(tmp_path / "check"), "--write_clean", str(meta),
                 "--workers", "0"]) == 2
    assert meta.read_bytes() == before and not (tmp_path / "check").exists()
    link = tmp_path / "link.json"  # another spelling of the same file
    link.symlink_to(meta)
    assert main(["check-dataset", str(meta), "--out", str(tmp_path / "check"), "--write_clean", str(link),
                 "--workers", "0"]) == 2
    assert meta.read_bytes() == before


def test_write_clean_keeps_the_original_records_and_lists_what_it_drops(tmp_path):
    """FireRed-style prompt fields on DiffSynth rows (no `prompt`: an IndexError before), prompt lists, extra
    fields, a row the reader skips and a flagged row: the kept records come back whole."""
    from diffsynth_qie.cli import main

    d = tmp_path / "data"
    rows = _pairs(d, 4)
    rows[0].update(prompt=["make it blue", "turn the square blue"], note="keep me")
    rows[1].update(instruction="make it blue", instruction_cn="把它变蓝", inverse_instruction="make it red")
    rows[2].update(prompt="identical pair", image=rows[2]["edit_image"])  # near_identical: flagged
    rows[3].update(prompt="no source")
    del rows[3]["edit_image"]  # a text-to-image row: the reader skips it
    meta = d / "metadata.jsonl"
    meta.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    clean = tmp_path / "elsewhere" / "clean.json"
    clean.parent.mkdir()
    assert main(["check-dataset", str(meta), "--out", str(tmp_path / "check"), "--write_clean", str(clean),
                 "--workers", "0"]) == 0
    kept = json.loads(clean.read_text())
    assert [r.get("prompt") for r in kept] == [["make it blue", "turn the square blue"], None]
    assert kept[0]["note"] == "keep me" and kept[1]["instruction_cn"] == "把它变蓝"
    assert kept[1]["inverse_instruction"] == "make it red"
    assert (clean.parent / kept[0]["image"]).resolve() == (d / rows[0]["image"]).resolve()  # re-based
    dropped = [json.loads(line) for line in (tmp_path / "check" / "dropped.jsonl").read_text().splitlines()]
    assert [(x["record"], x["why"].split(":")[0]) for x in dropped] == [(2, "flagged"), (3, "skipped by the reader")]
    assert "near_identical" in dropped[0]["why"]
    from diffsynth_qie.data.formats import read_rows

    back = read_rows(clean)  # the clean file reads back, prompts included
    assert [r.prompts for r in back[:2]] == [["make it blue", "turn the square blue"], ["make it blue", "把它变蓝"]]


def test_the_demo_data_loses_no_kept_row(tmp_path):
    from diffsynth_qie.cli import main
    from diffsynth_qie.data.formats import read_rows

    assert main(["make-demo-data", "--out", str(tmp_path / "demo"), "--num_pairs", "12"]) == 0
    meta = tmp_path / "demo" / "metadata.json"
    records = json.loads(meta.read_text())
    clean = tmp_path / "demo" / "clean.json"  # (beside it: the paths stay as they are)
    assert main(["check-dataset", str(meta), "--out", str(tmp_path / "check"), "--write_clean", str(clean),
                 "--workers", "0"]) == 0
    dropped = (tmp_path / "check" / "dropped.jsonl").read_text().splitlines()
    kept = json.loads(clean.read_text())
    assert len(kept) + len(dropped) == len(records)
    flagged = {r["row_id"] for r in map(json.loads, (tmp_path / "check" / "check.jsonl").read_text().splitlines())
               if any(i["severity"] == "error" for i in r["issues"].values())}
    assert len(dropped) == len(flagged) == 0  # (the demo's pairs are all clean: no error, so nothing dropped)
    assert all(k in records for k in kept)  # whole original records (the paths' folder is the same)
    assert len(read_rows(clean)) == len(kept)


def test_one_bad_row_is_reported_and_the_others_are_checked(tmp_path):
    """A measurement that raises (a 16000x16 strip: 'array of sample points is empty' before) is the row's
    error, with its message; every other row is measured."""
    from diffsynth_qie.data.check import CheckConfig, check_rows

    rows = [{"row_id": f"r{i}", "target": str(tmp_path / r["image"]), "source": str(tmp_path / r["edit_image"]),
             "mask": None} for i, r in enumerate(_pairs(tmp_path, 3))]
    strip = np.asarray(Image.fromarray(scene(1)).resize((16000, 16)))
    rows.append({"row_id": "strip", "target": str(tmp_path / save(tmp_path / "strip_t.png", strip)),
                 "source": str(tmp_path / save(tmp_path / "strip_s.png", strip[:, ::-1].copy())), "mask": None})
    checks, _ = check_rows(rows, CheckConfig(workers=0), show_progress=False)
    by_id = {c.row_id: c for c in checks}
    assert set(by_id) == {"r0", "r1", "r2", "strip"}
    assert "error" in by_id["strip"].flags and by_id["strip"].flags["error"]
    assert all("error" not in by_id[f"r{i}"].flags and "psnr" in by_id[f"r{i}"].measures for i in range(3))


def test_check_jsonl_is_strict_json_and_an_exact_copy_says_identical(tmp_path):
    from diffsynth_qie.cli import main

    rows = _pairs(tmp_path, 2)
    rows.append({"image": rows[0]["edit_image"], "edit_image": rows[0]["edit_image"]})  # an exact copy
    for r in rows:
        r["prompt"] = "blue"
    (tmp_path / "m.json").write_text(json.dumps(rows))
    assert main(["check-dataset", str(tmp_path / "m.json"), "--out", str(tmp_path / "c"), "--workers", "0"]) == 0
    lines = (tmp_path / "c" / "check.jsonl").read_text().splitlines()

    def no_constants(name):
        raise ValueError(f"{name} in check.jsonl")

    records = [json.loads(line, parse_constant=no_constants) for line in lines]
    copy = next(r for r in records if "near_identical" in r["flags"])
    assert copy["measures"]["psnr"] is None and copy["measures"]["identical"] is True


def test_a_mask_of_another_aspect_ratio_is_flagged(tmp_path):
    from diffsynth_qie.data.check import CheckConfig, check_rows

    rows = []
    for i, size in enumerate([(96, 96), (160, 96)]):  # a square mask, and a 5:3 one, for square pairs
        m = np.zeros(size[::-1], np.uint8)
        m[30:66, 30:66] = 255
        rows.append({"row_id": f"r{i}", "target": str(tmp_path / save(tmp_path / f"{i}_t.png", scene(i, (30, 30, 200)))),
                     "source": str(tmp_path / save(tmp_path / f"{i}_s.png", scene(i))),
                     "mask": str(tmp_path / save(tmp_path / f"{i}_m.png", m, "L"))})
    checks, _ = check_rows(rows, CheckConfig(workers=0), show_progress=False)
    assert "mask_aspect" not in checks[0].flags
    assert checks[1].flags.get("mask_aspect") == "mask 160x96, target 96x96"


def test_workers_are_capped_by_cores_and_rows(monkeypatch):
    import os

    from diffsynth_qie.data.check import pool_size

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert pool_size(1000, 50) == 2
    assert pool_size(1000, 1) == 1
    assert pool_size(0, 50) == 0 and pool_size(4, 0) == 0


@pytest.mark.parametrize("k", [0, 1, 4, 7, 20, 64])
def test_the_duplicate_pass_answers_as_the_pairwise_scan(k):
    """``duplicate``, ``duplicate_pair`` and ``holdout_duplicate`` exactly as every row compared with every earlier
    one gives them, on random hashes and on the flat ones of plain images (the index's two ways of looking up),
    with more copies of one pair than the index keeps, whatever the batches the rows arrive in (each row is
    compared with the rows before it only, in its batch too)."""
    import copy
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.check_dataset_scale import pairwise_pairs, synthetic_checks
    from diffsynth_qie.data.check_dups import DuplicatePass, flag_pair_duplicates

    kinds = set()
    for flat in (False, True):
        rows, held = synthetic_checks(700 if k <= 4 else 250, seed=k, flat=flat, copies=40, k=k)
        expected = pairwise_pairs(rows, held, k)
        for batch in (1, 37):
            fed = copy.deepcopy(rows)
            found = DuplicatePass(held, k, batch=batch)
            for c in fed:
                found.add(c)
            found.finish()
            assert {i: c.flags for i, c in enumerate(fed) if c.flags} == expected, batch
        flag_pair_duplicates(rows, held, k)
        assert {i: c.flags for i, c in enumerate(rows) if c.flags} == expected
        kinds |= {f for flags in expected.values() for f in flags}
    assert kinds == {"duplicate", "duplicate_pair", "holdout_duplicate"} or k == 0 and "duplicate" in kinds


def test_the_duplicate_pass_is_near_linear():
    """5,000 demo rows (flat images: their hashes a few bits from many others) took 57 s when every look-up walked
    the bands' growing lists, 8,000 flat synthetic rows 18 s; they, and 10,000 random ones, must take a few
    seconds at most."""
    import sys
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.check_dataset_scale import synthetic_checks
    from diffsynth_qie.data.check_dups import flag_pair_duplicates

    for flat, n in ((False, 10_000), (True, 8_000)):
        rows, held = synthetic_checks(n, flat=flat)
        start = time.process_time()
        flag_pair_duplicates(rows, held, 4)
        assert time.process_time() - start < 6.0, f"{n} rows, flat hashes: {flat}"


def test_the_fast_measures_are_numpy_s_numbers_bit_for_bit():
    """The cell means are numpy's ``reshape(...).mean(axis=(1, 3))`` to the bit (any cell size, a row of cells,
    a strided channel, three channels at once), and block motion transforms only the textured blocks: theirs are
    the numbers of transforming every block, the flat ones have no shift and no peak."""
    from diffsynth_qie.data.check_align import MIN_TEXTURE, _pool, block_motion, fit_motion

    rng = np.random.default_rng(0)
    for trial in range(60):
        h, w = (int(v) for v in rng.integers(8, 260, 2))
        f = int(rng.integers(1, 14)) if trial % 3 else max(1, min(h, w) // 32)
        a = (rng.integers(0, 256, (h, w, 3)) / 255.0).astype(np.float32)
        for g in (a[..., 1], a @ np.array([0.299, 0.587, 0.114], np.float32)):
            hh, ww = h // f * f, w // f * f
            ref = g[:hh, :ww].reshape(hh // f, f, ww // f, f).mean(axis=(1, 3))
            assert _pool(g, f).tobytes() == ref.tobytes(), (h, w, f)
        assert _pool(a, f).tobytes() == np.stack([_pool(a[..., c], f) for c in range(3)], -1).tobytes()
    base = np.full((160, 224), 0.8, np.float32)
    base[40:120, 60:200] = rng.random((80, 140)).astype(np.float32) * np.linspace(0, 0.3, 140, dtype=np.float32)
    for gs, gt in ((base, np.roll(base, (2, -3), (0, 1))), (base, base[::-1].copy())):
        some, every = block_motion(gs, gt), block_motion(gs, gt, min_texture=-1.0)
        judged = some["texture"] > MIN_TEXTURE
        assert 0 < judged.sum() < len(judged) and (every["texture"] == some["texture"]).all()
        assert some["shift"][judged].tobytes() == every["shift"][judged].tobytes()
        assert some["peak"][judged].tobytes() == every["peak"][judged].tobytes()
        assert not some["shift"][~judged].any() and not some["peak"][~judged].any()
        assert fit_motion(some) == fit_motion(every)
    with pytest.raises(ValueError, match="min_texture"):
        fit_motion(some, min_texture=0.01)


def test_the_page_stays_bounded_and_counts_every_flagged_row(tmp_path):
    from diffsynth_qie.data.check import RowCheck
    from diffsynth_qie.data.check_report import write_outputs

    checks = [RowCheck(i, f"r{i}", {}, flags={"shifted": [3.0, 0.0]}) for i in range(1000)]
    page = write_outputs(tmp_path, checks, None, "m.json", max_cards=50, show_progress=False).read_text()
    assert page.count('class="card"') == 50 and "1000 shifted" in page and "all 1000 are in check.jsonl" in page
    assert len((tmp_path / "check.jsonl").read_text().splitlines()) == 1000


def test_a_copy_past_the_kept_ones_with_an_instruction_no_kept_row_has_is_flagged():
    """An index keeps 32 rows per distinct hash: the 41st copy of a pair, with an instruction none of the kept rows
    has, is a ``duplicate_pair`` of the first (its instruction is looked up, never required to be known)."""
    from diffsynth_qie.data.check import RowCheck
    from diffsynth_qie.data.check_dups import flag_pair_duplicates

    thumb = bytes(range(256))
    rows = [RowCheck(i, f"r{i}", {}, measures={"target_hash": 7, "source_hash": 9, "_target_thumb": thumb,
                                               "_source_thumb": thumb, "_instruction": "b" if i == 40 else "a"})
            for i in range(41)]
    flag_pair_duplicates(rows, [], 4)
    assert rows[0].flags == {} and all(r.flags == {"duplicate": "r0"} for r in rows[1:40])
    assert rows[40].flags == {"duplicate_pair": "r0"}
