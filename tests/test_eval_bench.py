"""`qie eval-edits` on benchmark folders and with a judge, on the tiny model: ``--bench DIR`` reads an ImgEdit-Bench
folder (and GEdit-Bench records) as they ship and writes base and LoRA generations in the benchmark's layout;
``--judge URL#MODEL`` adds a judge column from a local OpenAI-compatible server; a LoRA trained on top of a frozen
LoRA is also scored stacked on it with its declared schedule; the grid shows every reference of a row."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import chat_server
from diffsynth_qie.cli import main
from diffsynth_qie.inference.bench_inputs import detect, gedit_rows, read_bench

SCHEDULE = {"version": 1, "steps": 3, "cfg": 1.0, "sigmas": [1.0, 0.6, 0.3]}


def _image(seed, size=(32, 32)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _imgedit_dir(root, n=2):
    """ImgEdit-Bench as it ships: basic_edit.json and the sources under singleturn/."""
    meta = {}
    for i in range(n):
        (root / "singleturn" / "animal").mkdir(parents=True, exist_ok=True)
        _image(i).save(root / "singleturn" / "animal" / f"{i}.jpg", quality=95)
        meta[str(100 + i)] = {"id": f"animal/{i}.jpg", "prompt": f"make the animal {'red' if i else 'blue'}",
                              "edit_type": "alter"}
    (root / "basic_edit.json").write_text(json.dumps(meta))
    return root


def _lora(path, seed, metadata=None):
    from diffsynth_qie.lora import save_lora

    g = torch.Generator().manual_seed(seed)
    state = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 64, generator=g),
             "transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(64, 4, generator=g),
             "proj_out.lora_A.weight": torch.randn(4, 64, generator=g),
             "proj_out.lora_B.weight": torch.randn(64, 4, generator=g) * 0.1}
    return save_lora(path, state, metadata=metadata)


def _judged_by_instruction(seen):
    """A verbose reply whose score follows the row's instruction (a column's rows are judged concurrently, in any
    order), 2 more for the second column (the LoRA's: the base column is judged first)."""
    text = seen[-1][2]["messages"][0]["content"][0]["text"]
    return f"Image 2 shows the edit.\nStep 1 of 2 ... Score: {(2 if 'blue' in text else 7) + 2 * (len(seen) > 2)}/10"


@pytest.fixture
def judge_server():
    with chat_server(_judged_by_instruction) as served:
        yield served


def test_reads_imgedit_and_gedit_as_they_ship(tmp_path):
    root = _imgedit_dir(tmp_path / "imgedit")
    layout, rows = read_bench(root)
    assert layout == "imgedit" and [r.extra["key"] for r in rows] == ["100", "101"]
    assert rows[1].prompt == "make the animal red" and rows[1].source.size == (32, 32)
    buf = io.BytesIO()
    _image(5).save(buf, format="PNG")
    records = [{"key": "k1", "task_type": "color_alter", "instruction": "make it blue", "instruction_language": "en",
                "input_image": {"bytes": buf.getvalue(), "path": "k1.png"}}]
    (row,) = gedit_rows(records)
    assert row.extra == {"key": "k1", "task_type": "color_alter", "instruction_language": "en"}
    assert np.array_equal(np.asarray(row.source), np.asarray(_image(5)))
    with pytest.raises(ValueError, match="no input_image"):
        gedit_rows([{"key": "k2", "instruction": "x"}])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither an ImgEdit-Bench folder"):
        detect(tmp_path / "empty")
    (tmp_path / "g" / "data").mkdir(parents=True)
    (tmp_path / "g" / "data" / "train-00000-of-00001.parquet").write_bytes(b"PAR1")
    assert detect(tmp_path / "g") == "gedit"


@pytest.mark.parametrize("field, value", [("id", 7), ("id", ["animal/1.jpg"]), ("id", ""), ("prompt", None),
                                          ("prompt", ["make it red", "make it blue"]), ("prompt", 3), ("prompt", " ")])
def test_an_imgedit_row_with_an_id_or_prompt_that_is_not_text_is_named(tmp_path, field, value):
    """Not a traceback, and never the text "None" or "['a', 'b']" sent as the instruction: one line naming the
    file, the row, the field and what it holds."""
    root = _imgedit_dir(tmp_path / "imgedit")
    meta = json.loads((root / "basic_edit.json").read_text())
    meta["101"][field] = value
    (root / "basic_edit.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"basic_edit.json: row '101': '{field}' must be "):
        read_bench(root)


@pytest.mark.parametrize("keys", [("a/b", "a_b"), ("x" * 80 + "1", "x" * 80 + "2")])
def test_two_rows_that_would_write_one_file_are_refused_before_anything_is_edited(tmp_path, keys):
    """Keys that differ only in characters a file name cannot hold, or after the 80 a file name keeps, would write
    one output for two rows: refused when the benchmark is read, naming both rows and the file."""
    from diffsynth_qie.inference.bench_layout import export

    root = _imgedit_dir(tmp_path / "imgedit")
    meta = json.loads((root / "basic_edit.json").read_text())
    (root / "basic_edit.json").write_text(json.dumps(dict(zip(keys, meta.values()))))
    with pytest.raises(ValueError, match=f"rows {keys[0]!r} and {keys[1]!r} would both be written as "):
        read_bench(root)
    with pytest.raises(ValueError, match="would both be written as"):  # the writer refuses them too
        export("gedit", tmp_path / "out", [_image(0)] * 2, ["a", "b"], [_image(1)] * 2, [{"key": k} for k in keys])
    assert not (tmp_path / "out").exists()


def test_bench_run_writes_the_benchmark_layout_with_judge_scores(tiny_model_dir, tmp_path, judge_server, capsys,
                                                                monkeypatch):
    """... and with --reward holding a judge term too, each row is turned into pixels once and judged once."""
    from diffsynth_qie.inference import evaluate as ev

    url, requests = judge_server
    converted, real = [], ev.case_pixels
    monkeypatch.setattr(ev, "case_pixels", lambda *a, **k: converted.append(1) or real(*a, **k))
    bench = _imgedit_dir(tmp_path / "imgedit")
    lora = _lora(tmp_path / "mine.safetensors", 0)
    out, card = tmp_path / "out", tmp_path / "card.json"
    code = main(["eval-edits", "--model", "tiny", "--model_dir", str(tiny_model_dir), "--bench", str(bench),
                 "--lora", str(lora), "--steps", "2", "--export", "imgedit", str(out), "--judge", f"{url}#judge-m",
                 "--reward", "drift:1,judge:0.5", "--scorecard", str(card), "--device", "cpu"])
    assert code == 0 and len(converted) == 4  # 2 rows x (base, LoRA), once each
    for row in json.loads(card.read_text())["per_row"]["lora"]:
        assert row["reward"] == pytest.approx(-row["shift_px"] + 0.5 * row["judge"])
    for column in ("base", "lora"):
        meta = json.loads((out / column / "edit.json").read_text())
        assert set(meta) == {"100", "101"} and meta["101"]["prompt"] == "make the animal red"
        assert all((out / column / f"{k}.png").is_file() and (out / column / "sources" / v["id"]).is_file()
                   for k, v in meta.items())
    assert len(requests) == 4 and all(body["model"] == "judge-m" for *_, body in requests)  # 2 rows x (base, LoRA)
    summary = json.loads(card.read_text())
    assert set(summary["metrics"]["judge"]) == {"base", "lora"}
    assert [r["judge"] for r in summary["per_row"]["base"] + summary["per_row"]["lora"]] == [2.0, 7.0, 4.0, 9.0]
    assert "edit_psnr" not in summary["metrics"]  # no targets: no fidelity, never invented
    err = capsys.readouterr().err
    assert "beats base" in err and "by judge" in err


def test_bench_needs_export_and_judge_spec_is_checked_first(tmp_path, capsys):
    bench = _imgedit_dir(tmp_path / "imgedit")
    assert main(["eval-edits", "--bench", str(bench)]) == 2
    assert "--export LAYOUT OUT_DIR" in capsys.readouterr().err
    assert main(["eval-edits", "--bench", str(bench), "--export", "gedit", str(tmp_path / "o"),
                 "--judge", "http://127.0.0.1:1/v1"]) == 2
    assert "after '#'" in capsys.readouterr().err
    assert main(["eval-edits", "--bench", str(bench), "--export", "gedit", str(tmp_path / "o"),
                 "--judge", str(tmp_path / "nowhere")]) == 2
    assert "local EditScore-7B directory" in capsys.readouterr().err
    assert main(["eval-edits", "--export", "gedit", str(tmp_path / "o")]) == 2
    assert "--dataset_metadata FILE (held-out rows) or --bench DIR" in capsys.readouterr().err


def test_a_lora_trained_on_a_frozen_lora_is_also_scored_stacked_with_its_schedule(tiny_model_dir, demo_data_dir,
                                                                                  tmp_path, capsys, monkeypatch):
    from diffsynth_qie.inference import evaluate as ev
    from diffsynth_qie.lora.frozen import FrozenLora

    turbo = _lora(tmp_path / "turbo.safetensors", 1, {"qie_schedule": json.dumps(SCHEDULE)})
    mine = _lora(tmp_path / "mine.safetensors", 2, FrozenLora(str(turbo), 0.8, "abc").metadata())
    calls = []
    real = ev.Editor.edit

    def spy(self, request):
        calls.append((sorted(p.name for p, _ in self.active_loras), request.steps, request.sigmas))
        return real(self, request)

    monkeypatch.setattr(ev.Editor, "edit", spy)
    card, grid = tmp_path / "card.json", tmp_path / "grid.png"
    assert main(["eval-edits", "--model", "tiny", "--model_dir", str(tiny_model_dir), "--dataset_metadata",
                 f"{demo_data_dir}/metadata.json", "--limit", "1", "--lora", str(mine), "--steps", "2",
                 "--scorecard", str(card), "--grid", str(grid), "--device", "cpu"]) == 0
    assert calls[:2] == [([], 2, None), (["mine.safetensors"], 2, None)]
    assert calls[2] == (["mine.safetensors", "turbo.safetensors"], 3, tuple(SCHEDULE["sigmas"]))
    summary = json.loads(card.read_text())
    assert summary["columns"] == ["base", "lora", "lora+turbo@3"]
    err = capsys.readouterr().err
    assert "stacked on the frozen LoRA it was trained on (turbo.safetensors at scale 0.8)" in err
    assert "its declared schedule" in err and "few-step gap vs lora: lora+turbo@3:" in err
    width, height = Image.open(grid).size
    assert width == 5 * height  # one row: the reference | base | LoRA | LoRA on turbo | target


def test_the_grid_shows_every_reference_of_a_row():
    from diffsynth_qie.inference.evaluate import EvalCase, compare_grid

    refs = [Image.new("RGB", (16, 16), c) for c in ("red", "green", "blue")]
    out, target = Image.new("RGB", (16, 16), "white"), Image.new("RGB", (16, 16), "black")
    cases = [EvalCase(refs, "p", target), EvalCase(refs[:1], "p", None)]
    grid = np.asarray(compare_grid(cases, [[out, out]]))
    assert grid.shape == (32, 80, 3)  # row 1: 3 references | output | target
    assert [tuple(grid[8, 8 + 16 * k]) for k in range(5)] == [(255, 0, 0), (0, 128, 0), (0, 0, 255),
                                                               (255, 255, 255), (0, 0, 0)]
    assert tuple(grid[24, 8]) == (255, 0, 0) and tuple(grid[24, 24]) == (255, 255, 255)  # row 2: one ref, no target
