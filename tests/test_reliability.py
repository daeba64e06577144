"""Every command leaves no debris, refuses what it cannot honour, and fails in one clear line."""
from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffsynth_qie.cli import build_parser, main


def _train_config(cache_dir, tiny_model_dir, out, **train):
    from diffsynth_qie.training.config import LoRAConfig, OptimConfig, RunConfig, TrainConfig

    lora = {k: train.pop(k) for k in ("lora_rank",) if k in train}
    optim = {k: train.pop(k) for k in ("optimizer", "learning_rate", "lr_schedule") if k in train}
    return RunConfig(train=TrainConfig(cache_dir=str(cache_dir), output_dir=str(out), model="tiny",
                                       model_dir=str(tiny_model_dir), device="cpu", **train),
                     lora=LoRAConfig(**{"lora_rank": 4, **lora}), optim=OptimConfig(**optim))


# --- debris ------------------------------------------------------------------------------------------
def test_a_killed_write_leaves_one_entry_we_own_and_the_next_run_removes_it(tmp_path):
    """A writer killed -9 while a library wrote its own temp file beside ours (safetensors does)."""
    from diffsynth_qie.utils.atomic import clean_leftovers, finished_files, temp_leftovers

    code = ("import os, sys, time; from pathlib import Path; from diffsynth_qie.utils.atomic import atomic_save\n"
            "def write(p):\n"
            "    (p.parent / '.tmpAb12Cd').write_bytes(b'x' * 1000)\n"  # the library's own temp, 1 kB
            "    p.write_bytes(b'partial'); print('writing', flush=True); time.sleep(60)\n"
            f"atomic_save(Path({str(tmp_path / 'lora.safetensors')!r}), write)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait()
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and temp_leftovers(tmp_path) == left and not finished_files(tmp_path)
    assert clean_leftovers(tmp_path) == left and not list(tmp_path.iterdir())


def test_a_live_writer_in_the_same_directory_is_left_alone(tmp_path):
    from diffsynth_qie.utils.atomic import clean_leftovers

    alive = tmp_path / f".out.{os.getppid()}-k2j.tmp"  # a running process's write in progress
    dead = tmp_path / ".out.999999-q1w.tmp"
    alive.mkdir(), dead.mkdir()
    assert clean_leftovers(tmp_path) == [dead] and alive.exists()


@pytest.mark.parametrize("argv, where", [
    (["edit", "--image", "a.png", "--prompt", "x", "--out", "{d}/o.png"], "{d}"),
    (["export-lora", "in.safetensors", "{d}/o.safetensors", "--format", "comfyui"], "{d}"),
    (["report", "{d}", "--out", "{d}/r.html"], "{d}"),
    (["merge-lora", "base", "--lora", "l.safetensors", "--out", "{d}"], "{d}/transformer"),
])
def test_commands_remove_their_killed_runs_leftovers_before_writing(tmp_path, argv, where):
    from diffsynth_qie.cli import remove_leftovers_of

    d = tmp_path / "out"
    target = Path(where.format(d=d))
    target.mkdir(parents=True)
    (target / ".o.999999-abc.tmp").mkdir()
    (target / ".o.999999-abc.tmp" / ".tmpXy12").write_bytes(b"x")
    (target / "keep.png").write_bytes(b"x")
    remove_leftovers_of(build_parser().parse_args([a.format(d=d) for a in argv]))
    assert [p.name for p in target.iterdir()] == ["keep.png"]


# --- locks and resume ------------------------------------------------------------------------------------
def test_a_second_train_into_the_same_output_dir_exits_naming_the_first(cache_dir, tiny_model_dir, tmp_path):
    from diffsynth_qie.training.loop import train
    from diffsynth_qie.utils.dir_lock import TrainLock

    out = tmp_path / "run"
    with TrainLock(out):  # run A holds it (another open file: flock excludes it like another process)
        with pytest.raises(ValueError, match=rf"another `qie train` run \(pid {os.getpid()} .*{out}"):
            train(_train_config(cache_dir, tiny_model_dir, out, max_steps=1))
    assert not (out / "lora.safetensors").exists()


def test_an_unwritable_directory_is_one_line_naming_it(tmp_path, monkeypatch):
    from diffsynth_qie.utils import dir_lock

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "c" / ".qie-cache-lock.json"))

    monkeypatch.setattr(dir_lock.os, "open", read_only)
    with pytest.raises(ValueError, match=rf"`qie cache` cannot write into {tmp_path / 'c'} \(it is on a read-only"):
        dir_lock.CacheLock(tmp_path / "c").acquire()


@pytest.fixture(scope="module")
def trained(cache_dir, tiny_model_dir, tmp_path_factory):
    """Two steps with a checkpoint after each (AdamW, rank 4, lr 1e-4 constant)."""
    from diffsynth_qie.training.loop import train

    out = tmp_path_factory.mktemp("resume") / "run"
    train(_train_config(cache_dir, tiny_model_dir, out, max_steps=2, save_every=1, keep_last=0))
    return out


@pytest.mark.parametrize("change, message", [
    ({"lora_rank": 8}, r"--lora_rank 4 -> 8"),
    ({"optimizer": "prodigy_sf", "max_grad_norm": 0.0}, r"--optimizer adamw -> prodigy_sf"),
])
def test_resume_refuses_a_change_it_cannot_honour_naming_it(trained, cache_dir, tiny_model_dir, tmp_path, change,
                                                         message):
    import shutil

    from diffsynth_qie.training.config import OptimConfig
    from diffsynth_qie.training.loop import train

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    change = dict(change)
    grad = change.pop("max_grad_norm", None)
    cfg = _train_config(cache_dir, tiny_model_dir, out, max_steps=3, resume="latest", **change)
    if grad is not None:
        cfg.optim = OptimConfig(optimizer=cfg.optim.optimizer, max_grad_norm=grad)
    with pytest.raises(ValueError, match=message):
        train(cfg)


def test_resume_on_another_cache_is_refused(trained, cache_dir, tiny_model_dir, tmp_path):
    import shutil

    from diffsynth_qie.training.loop import train

    other = tmp_path / "cache"
    shutil.copytree(cache_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["created"] = "another run"
    (other / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    with pytest.raises(ValueError, match="--cache_dir: the cache changed"):
        train(_train_config(other, tiny_model_dir, out, max_steps=3, resume="latest"))


def test_resume_applies_a_new_learning_rate_and_schedule(trained, cache_dir, tiny_model_dir, tmp_path, caplog):
    import shutil

    from diffsynth_qie.training.loop import train
    from diffsynth_qie.training.optim import lr_factor

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    caplog.set_level(logging.INFO)
    cfg = _train_config(cache_dir, tiny_model_dir, out, max_steps=4, resume="latest", learning_rate=5e-4,
                        lr_schedule="cosine")
    train(cfg)
    assert "resuming with --learning_rate 0.0005 (the checkpoint had 0.0001)" in caplog.text
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (out / "loss.jsonl").read_text().splitlines())}
    for step in (3, 4):  # the rate each step used: the new schedule at that step, not 0 and not the old rate
        assert lrs[step] == pytest.approx(5e-4 * lr_factor(step - 1, 0, 4, "cosine", 0.0)), lrs
    assert lrs[3] > 0


# --- interrupts and one-line errors --------------------------------------------------------------------
def test_ctrl_c_in_train_says_which_checkpoint_is_safe_and_exits_130(tmp_path, monkeypatch, capsys):
    from diffsynth_qie.training import loop

    out = tmp_path / "run"
    (out / "checkpoint-40").mkdir(parents=True)
    (out / "checkpoint-40" / "trainer_state.json").write_text("{}")

    def interrupted(config, hooks=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted)
    assert main(["train", "--cache_dir", "c", "--output_dir", str(out)]) == 130
    err = capsys.readouterr().err
    assert f"interrupted: {out / 'checkpoint-40'} is complete; resume with --resume latest" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_user_caused_os_errors_are_one_line_and_bugs_keep_their_traceback(monkeypatch, capsys):
    from diffsynth_qie.commands import report

    def denied(args):
        raise PermissionError(errno.EACCES, "Permission denied", "/data/cache/shards/r0-00001.safetensors")

    monkeypatch.setattr(report, "run", denied)
    assert main(["report", "/data/run"]) == 1
    err = capsys.readouterr().err
    assert "Permission denied: /data/cache/shards/r0-00001.safetensors; check its permissions" in err
    assert len(err.strip().splitlines()) == 1

    def bug(args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(report, "run", bug)
    with pytest.raises(OSError):
        main(["report", "/data/run"])


# --- input files -------------------------------------------------------------------------------------------
def test_a_quoted_newline_in_a_csv_prompt_stays_in_its_cell(tmp_path):
    from diffsynth_qie.data.formats import read_rows

    for name in ("a.png", "b\nc.png"):
        Image.new("RGB", (32, 32)).save(tmp_path / name.replace("\n", "_"))
    (tmp_path / "m.csv").write_text('image,edit_image,prompt\na.png,a.png,"make it pink\nand the grass blue"\n'
                                    '"b\nc.png",a.png,x\n', newline="")
    rows = read_rows(tmp_path / "m.csv", tmp_path)
    assert rows[0].prompts == ["make it pink\nand the grass blue"]
    assert rows[1].target.name == "b\nc.png"  # read as written (and then skipped as a missing file, by name)
    (tmp_path / "m.jsonl").write_text(json.dumps({"image": "a.png", "edit_image": "a.png",
                                                  "prompt": "line\u2028separator"}, ensure_ascii=False) + "\n")
    assert read_rows(tmp_path / "m.jsonl", tmp_path)[0].prompts == ["line\u2028separator"]


@pytest.mark.parametrize("size, reason", [((8, 8), "at least 16 pixels"), ((1, 1), "at least 16 pixels"),
                                          ((16000, 16), "aspect ratio of 1000:1")])
def test_an_unusable_image_is_a_logged_skip_not_a_crash(tmp_path, size, reason):
    from diffsynth_qie.data.rows import EditRow, validate_rows

    good, bad = tmp_path / "good.png", tmp_path / "bad.png"
    Image.new("RGB", (64, 64)).save(good)
    Image.new("RGB", size).save(bad)
    rows = [EditRow(row_id=str(i), target=good, edit_images=[good], prompts=["x"]) for i in range(3)]
    rows.append(EditRow(row_id="bad", target=good, edit_images=[bad], prompts=["x"]))
    ok, skipped = validate_rows(rows)
    assert len(ok) == 3 and [s.row_id for s in skipped] == ["bad"]
    assert reason in skipped[0].reason and str(bad) in skipped[0].reason


def test_qie_edit_names_an_unusable_image(tmp_path):
    from diffsynth_qie.commands.edit import load_inputs

    Image.new("RGB", (16000, 16)).save(tmp_path / "strip.png")
    args = build_parser().parse_args(["edit", "--image", str(tmp_path / "strip.png"), "--prompt", "x", "--out",
                                      str(tmp_path / "o.png")])
    with pytest.raises(ValueError, match=r"--image .*strip\.png is 16000x16 pixels"):
        load_inputs(args)


@pytest.mark.parametrize("prompt", ["\x00\x01\x02", "\u200b \u200b", "   ", "\ufeff\t"])
def test_a_prompt_of_nothing_is_empty_everywhere(tmp_path, prompt):
    from diffsynth_qie.data.rows import EditRow, validate_rows
    from diffsynth_qie.inference.checks import check_request
    from diffsynth_qie.inference.editor import EditRequest
    from diffsynth_qie.utils.text import is_empty_prompt

    assert is_empty_prompt(prompt) and not is_empty_prompt("make it \u200bpink")
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    _, skipped = validate_rows([EditRow(row_id="r", target=tmp_path / "a.png", edit_images=[tmp_path / "a.png"], prompts=[prompt])])
    assert skipped and skipped[0].reason.startswith("empty prompt")
    with pytest.raises(ValueError, match="says nothing"):
        check_request(EditRequest(images=[Image.new("RGB", (32, 32))], prompt=prompt))


def test_32_bit_images_scale_by_their_range_instead_of_saturating():
    from diffsynth_qie.data.images import to_rgb

    ramp = np.linspace(0, 1_000_000, 64 * 64, dtype=np.int32).reshape(64, 64)
    out = np.asarray(to_rgb(Image.fromarray(ramp, mode="I")))[..., 0]
    assert out.min() == 0 and out.max() == 255 and 100 < out.mean() < 155
    sixteen = np.asarray(to_rgb(Image.fromarray(np.full((4, 4), 65535, dtype=np.int32), mode="I")))
    assert (sixteen == 255).all()  # a 16-bit white stays white


# --- LoRA files ----------------------------------------------------------------------------------------------
@pytest.fixture
def lora_file(tmp_path):
    from diffsynth_qie.lora.export import save_lora
    from diffsynth_qie.lora.state import LoraModule, LoraState

    g = torch.Generator().manual_seed(0)
    state = LoraState(modules={"transformer_blocks.0.attn.to_q": LoraModule(
        A=torch.randn(4, 64, generator=g) * 0.1, B=torch.randn(64, 4, generator=g) * 0.1, alpha=8.0)})
    return save_lora(tmp_path / "l.safetensors", state)


def _recast(path: Path, dtype: torch.dtype) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    out = path.with_name(f"{str(dtype).split('.')[-1]}.safetensors")
    save_file({k: (v.to(dtype) if v.ndim == 2 else v) for k, v in tensors.items()}, str(out), metadata=meta)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn])
def test_float64_and_float8_loras_are_read_as_fp32(lora_file, dtype):
    from diffsynth_qie.lora.formats import load_lora_state

    ref = load_lora_state(lora_file).modules["transformer_blocks.0.attn.to_q"]
    got = load_lora_state(_recast(lora_file, dtype)).modules["transformer_blocks.0.attn.to_q"]
    assert got.A.dtype == torch.float32
    tol = 1e-6 if dtype == torch.float64 else 0.07
    assert (got.A - ref.A).abs().max() <= tol * ref.A.abs().max()


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_integer_or_boolean_lora_weights_are_refused_by_key(lora_file, tmp_path, dtype):
    from diffsynth_qie.lora.export import export_lora

    with pytest.raises(ValueError, match=r"tensor .*to_q.*lora_[AB].* is (int8|bool)"):
        export_lora(_recast(lora_file, dtype), tmp_path / "out.safetensors", "comfyui")
    assert not (tmp_path / "out.safetensors").exists()


def test_the_diffusers_export_metadata_matches_its_folded_weights(lora_file, tmp_path):
    from safetensors import safe_open

    from diffsynth_qie.lora.export import export_lora
    from diffsynth_qie.lora.formats import load_lora_state

    out = export_lora(lora_file, tmp_path / "d.safetensors", "diffusers")
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["rank"] == meta["alpha"] == "4" and meta["alpha_folded_into_lora_A"] == "true"
    src, back = load_lora_state(lora_file), load_lora_state(out)
    name = "transformer_blocks.0.attn.to_q"
    assert torch.allclose(back.modules[name].delta(), src.modules[name].delta(), atol=1e-6)


# --- flags ----------------------------------------------------------------------------------------------------
def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)
        else:
            yield action


def test_every_number_flag_of_every_command_is_checked():
    floats = [a for a in _actions(build_parser()) if a.type is float or getattr(a.type, "__name__", "") == "float"]
    assert floats and all(getattr(a.type, "qie_checked", False) for a in floats)
    assert all(getattr(a.type, "qie_checked", False) for a in _actions(build_parser()) if a.dest == "seed")


@pytest.mark.parametrize("argv, flag", [
    (["edit", "--cfg", "nan"], "--cfg: 'nan' is not a finite number"),
    (["edit", "--lora_scale", "inf"], "--lora_scale: 'inf' is not a finite number"),
    (["edit", "--lbm_noise", "nan"], "--lbm_noise: 'nan' is not a finite number"),
    (["plan", "--gpu_memory_gb", "-1"], "--gpu_memory_gb: -1 is out of range"),
    (["plan", "--gpu_memory_gb", "0"], "--gpu_memory_gb: 0 is out of range"),
    (["plan", "--prompt_tokens", "-5"], "--prompt_tokens: -5 is out of range"),
    (["edit", "--seed", str(2 ** 64)], "--seed: 18446744073709551616 is out of range"),
    (["edit", "--mask_feather", "1e9"], "--mask_feather: 1e9 is out of range"),
    (["train", "--learning_rate", "nan"], "--learning_rate: 'nan' is not a finite number"),
])
def test_a_non_finite_or_out_of_range_flag_is_a_usage_error_naming_it(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_the_web_ui_flags_are_checked_too(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import app_gradio

    with pytest.raises(SystemExit) as e:
        app_gradio.main(["--max_upload_mb", "nan"])
    assert e.value.code == 2 and "--max_upload_mb: 'nan' is not a finite number" in capsys.readouterr().err


def test_an_edit_larger_than_the_cap_or_on_a_missing_device_is_refused_up_front():
    from diffsynth_qie.inference.checks import check_request
    from diffsynth_qie.inference.editor import EditRequest
    from diffsynth_qie.models.load.devices import check_device_name

    big = EditRequest(images=[Image.new("RGB", (32, 32))], prompt="x", width=16384, height=16384)
    with pytest.raises(ValueError, match=r"16384x16384 is 268\.4 MP, more than max_output_pixels"):
        check_request(big)
    big.max_output_pixels = 16384 * 16384
    check_request(big)  # the override
    with pytest.raises(ValueError, match=r"--device tpu:7 is not a device of this machine; choose one of cpu"):
        check_device_name("tpu:7")
    for bad in (dict(cfg=math.nan), dict(lbm_noise=math.inf), dict(mask_feather=-1.0)):
        with pytest.raises(ValueError, match="must be"):
            check_request(EditRequest(images=[Image.new("RGB", (32, 32))], prompt="x", **bad))


# --- distributed corner cases ------------------------------------------------------------------------------
def test_an_empty_micro_batch_is_a_zero_loss_that_reaches_every_trainable_weight(tiny_model_dir):
    from diffsynth_qie.models.load.loading import load_pipeline
    from diffsynth_qie.training.accumulation import micro_loss_scale
    from diffsynth_qie.training.config import LoRAConfig, RunConfig, TrainConfig
    from diffsynth_qie.training.module import QIETrainingModule

    cfg = RunConfig(train=TrainConfig(cache_dir="c", output_dir="o"), lora=LoRAConfig(lora_rank=2))
    from diffsynth_qie.models.presets import get_preset

    preset = get_preset("tiny")
    dit = load_pipeline("tiny", model_dir=tiny_model_dir, components=("dit",), device="cpu",
                        torch_dtype=torch.float32).dit
    module = QIETrainingModule(dit, cfg.resolved(preset), preset.name)
    loss, metrics = module({"target_latents": [], "edit_latents": [], "prompt_emb": []})
    loss.backward()
    grads = [p.grad for p in module.trainable_modules()]
    assert float(loss) == 0.0 and metrics == {} and all(g is not None and not g.any() for g in grads)
    assert micro_loss_scale(0, 6, 2, 2) == 0.0
    with pytest.raises(ValueError, match="no sample on any rank"):
        micro_loss_scale(0, 0, 1, 2)


def test_a_write_failure_on_one_rank_ends_the_save_on_every_rank(monkeypatch):
    """Rank 1's disk is full: rank 0 (which wrote its part) raises at the exchange instead of waiting."""
    import accelerate.utils

    from diffsynth_qie.utils.atomic import DiskFullError, is_disk_full
    from diffsynth_qie.utils.collective import raise_on_every_rank

    class Rank:
        num_processes = 2

        def __init__(self, index):
            self.process_index = index

    full = DiskFullError("/node2/run/.checkpoint-40.tmp/state/rng_1.pkl")
    told = [("rank 1: " + str(full), full.errno)]
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda mine: [None] + told)
    with pytest.raises(OSError, match="another rank failed .*no space left on /node2") as e:
        raise_on_every_rank(Rank(0), None)
    assert is_disk_full(e.value)  # so save_checkpoint names the newest complete checkpoint on rank 0 too
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda mine: [None, ("rank 1: bad value", None)])
    with pytest.raises(RuntimeError, match="another rank failed \\(rank 1: bad value\\)"):
        raise_on_every_rank(Rank(0), None)


# --- found by a second attack pass ---------------------------------------------------------------------------
def test_a_damaged_loss_log_is_skipped_line_by_line_by_report_and_resume(tmp_path, caplog):
    from diffsynth_qie.training.report import build_report
    from diffsynth_qie.training.tracking import read_loss_log

    log_file = tmp_path / "loss.jsonl"
    log_file.write_bytes(b'{"step": 1, "loss": 1.0}\n[1, 2]\n\xff\xfe garbage\n{"step": "x", "loss": 2.0}\n'
                         b'{"step": 2, "loss": 0.5}\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING):
        records = read_loss_log(log_file)
    assert [r["step"] for r in records] == [1, 2]
    assert f"{log_file}: skipped 4 line(s)" in caplog.text
    assert "loss" in build_report(tmp_path)  # the report page renders from the two good records


@pytest.mark.parametrize("argv, message", [
    (["export-lora", "{d}/a.safetensors", "{d}/a.safetensors", "--format", "comfyui"],
     "OUT .* is the input IN .*: it would be written over while it is read"),  # (utils/paths.py, every command)
    (["export-lora", "{d}/a.safetensors", "{d}/file.png/o.safetensors", "--format", "comfyui"], "is a file, not a directory"),
    (["edit", "--image", "{d}/file.png", "--prompt", "x", "--out", "{d}/file.png/o.png"], "is a file, not a directory"),
    (["eval-edits", "--dataset_metadata", "{d}/m.json", "--grid", "{d}"], "--grid .* is a directory"),
])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, argv, message, capsys):
    Image.new("RGB", (32, 32)).save(tmp_path / "file.png")
    (tmp_path / "a.safetensors").write_bytes(b"x")
    (tmp_path / "m.json").write_text("[]")
    assert main([a.format(d=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err
    assert (tmp_path / "a.safetensors").read_bytes() == b"x"


def test_duplicate_csv_columns_and_a_source_that_is_the_target_are_refused(tmp_path):
    from diffsynth_qie.data.folders import FolderSpec, match_folders
    from diffsynth_qie.data.formats import read_rows

    (tmp_path / "m.csv").write_text("prompt,image,edit_image,prompt\nmake it pink,a.png,a.png,\n")
    with pytest.raises(ValueError, match=r"m\.csv: the header names column\(s\) 'prompt' more than once"):
        read_rows(tmp_path / "m.csv", tmp_path)
    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    with pytest.raises(ValueError, match="is the --target folder itself"):
        match_folders(FolderSpec(target=tmp_path, sources=[tmp_path], prompt="x"))
    (tmp_path / "p.csv").write_bytes("stem,prompt\na,caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"p\.csv: not UTF-8 text .* save the prompts file as UTF-8"):
        from diffsynth_qie.data.folders import read_prompts

        read_prompts(tmp_path / "p.csv")


def test_a_cache_divisor_the_dit_cannot_take_is_refused_and_a_missing_metadata_file_writes_nothing(tmp_path):
    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.formats import DatasetConfig

    (tmp_path / "m.json").write_text("[]")
    with pytest.raises(ValueError, match="--divisor 7: image sides must be multiples of 16"):
        write_cache(CacheConfig(cache_dir=str(tmp_path / "c"), model="tiny", divisor=7,
                                dataset=DatasetConfig(dataset_metadata=str(tmp_path / "m.json"))))
    with pytest.raises(FileNotFoundError, match="metadata file not found"):
        write_cache(CacheConfig(cache_dir=str(tmp_path / "c2"), model="tiny",
                                dataset=DatasetConfig(dataset_metadata=str(tmp_path / "typo.json"))))
    assert not (tmp_path / "c").exists() and not (tmp_path / "c2").exists()


def test_a_bad_train_flag_leaves_no_output_directory(cache_dir, tiny_model_dir, tmp_path):
    from diffsynth_qie.training.loop import train

    out = tmp_path / "run"
    with pytest.raises(ValueError):
        train(_train_config(cache_dir, tiny_model_dir, out, lora_rank=0))
    assert not out.exists()


def test_the_web_ui_refuses_a_missing_lightning_lora_at_startup(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import app_gradio

    with pytest.raises(SystemExit) as e:
        app_gradio.main(["--lightning_lora", str(tmp_path / "missing.safetensors")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--lightning_lora {tmp_path / 'missing.safetensors'} is not a file" in err


def test_plan_and_export_say_when_the_files_are_not_what_the_flags_claim(tiny_model_dir, tmp_path, capsys):
    from safetensors.torch import save_file

    assert main(["plan", "--model", "2511", "--model_dir", str(tiny_model_dir)]) == 0
    assert (f"--model_dir {tiny_model_dir} holds a DiT of width 64 with 2 blocks, but 2511 has width 3072 with 60 "
            "blocks") in capsys.readouterr().err
    save_file({"foo.bar.lora_A.weight": torch.zeros(2, 8), "foo.bar.lora_B.weight": torch.zeros(8, 2)},
              str(tmp_path / "other.safetensors"))
    assert main(["export-lora", str(tmp_path / "other.safetensors"), str(tmp_path / "o.safetensors"),
                 "--format", "diffusers"]) == 2  # another model's LoRA: refused, nothing written
    assert "names 1 module(s) that no Qwen-Image DiT has (a LoRA of another model?): foo.bar" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


def test_the_same_cache_twice_is_refused(cache_dir, tiny_model_dir, tmp_path):
    from diffsynth_qie.training.loop import train

    cfg = _train_config(cache_dir, tiny_model_dir, tmp_path / "run", max_steps=1)
    cfg.train.cache_dir = [str(cache_dir), str(cache_dir)]
    with pytest.raises(ValueError, match=r"--cache_dir names .* twice as one dataset; .* --dataset_weights"):
        train(cfg)
