"""Data safety of everything we write: file modes under the umask, disk full, leftovers of
killed writes in the output directory."""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diffsynth_qie.training import checkpoint as ckpt
from diffsynth_qie.utils.atomic import (DiskFullError, atomic_save, atomic_write_json, finished_files,
                                        is_temp_name)


@pytest.fixture
def umask():
    """Set the process umask for one test, then restore it."""
    old = os.umask(0o022)
    os.umask(old)

    def set_(mask: int) -> int:
        os.umask(mask)
        return mask

    yield set_
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---------------------------------------------------------------- file modes

@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_files_follow_the_umask(tmp_path, umask, mask):
    umask(mask)
    want = 0o666 & ~mask
    tensors = {"a": torch.arange(4.0)}
    atomic_save(tmp_path / "lora.safetensors", lambda p: save_file(tensors, str(p)))  # safetensors recreates
    atomic_save(tmp_path / "state.pt", lambda p: torch.save(tensors, p))
    atomic_write_json(tmp_path / "trainer_state.json", {"step": 1})
    for name in ("lora.safetensors", "state.pt", "trainer_state.json"):
        assert _mode(tmp_path / name) == want, (name, oct(_mode(tmp_path / name)), oct(want))


def test_lora_and_checkpoint_files_follow_the_umask(tmp_path, umask):
    """The real LoRA writer, not only atomic_save itself."""
    from diffsynth_qie.lora import save_lora

    umask(0o022)
    save_lora(tmp_path / "out.safetensors", {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 4),
                                             "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(4, 2)})
    assert _mode(tmp_path / "out.safetensors") == 0o644


def test_tiny_model_dir_follows_the_umask(tmp_path, umask, monkeypatch):
    from diffsynth_qie.tiny import build as tiny

    def build(out_dir, seed=0):  # the real build takes seconds; its files are written atomically too
        atomic_write_json(Path(out_dir) / "tiny_info.json", {"seed": seed})
        atomic_save(Path(out_dir) / "transformer" / "w.safetensors", lambda p: save_file({"w": torch.ones(2)}, str(p)))

    monkeypatch.setattr(tiny, "build_tiny", build)
    umask(0o027)
    out = tiny.ensure_tiny(tmp_path / "tiny")
    assert _mode(out) == 0o750
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and {_mode(p) for p in files} == {0o640}


# ---------------------------------------------------------------- leftovers in the output directory

def _checkpoint(out: Path, step: int, marker: str = "") -> Path:
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / ckpt.TRAINER_STATE).write_text(json.dumps({"step": step, "marker": marker}))
    return d


def test_remove_leftovers_keeps_finished_files(tmp_path):
    out = tmp_path / "out"
    _checkpoint(out, 2)
    (out / "lora.safetensors").write_bytes(b"done")
    (out / "train_log.jsonl").write_text("{}\n")
    leftovers = [out / ".lora.k2j_x9a.tmp.safetensors", out / ".train_log.abcd1234.tmp.jsonl",
                 out / ".checkpoint-4.tmp", out / ".checkpoint-2.old"]
    for p in leftovers[:2]:
        p.write_bytes(b"half")
    for p in leftovers[2:]:
        p.mkdir()
        (p / "lora.safetensors").write_bytes(b"half")
    removed = ckpt.remove_leftovers(out)
    assert sorted(removed) == sorted(leftovers)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "lora.safetensors", "train_log.jsonl"]
    assert ckpt.list_checkpoints(out) == [out / "checkpoint-2"]
    assert ckpt.remove_leftovers(tmp_path / "absent") == []


@pytest.mark.parametrize("new_complete", [True, False])
def test_remove_leftovers_restores_a_checkpoint_killed_between_its_renames(tmp_path, new_complete):
    """Saving an existing step moves the old directory aside, then renames the new one in."""
    out = tmp_path / "out"
    _checkpoint(out, 3)
    os.replace(out / "checkpoint-3", out / ".checkpoint-3.old")
    (out / ".checkpoint-3.old" / ckpt.TRAINER_STATE).write_text(json.dumps({"step": 3, "marker": "old"}))
    new = out / ".checkpoint-3.tmp"
    new.mkdir()
    if new_complete:
        (new / ckpt.TRAINER_STATE).write_text(json.dumps({"step": 3, "marker": "new"}))
    ckpt.remove_leftovers(out)
    assert [p.name for p in out.iterdir()] == ["checkpoint-3"]
    marker = json.loads((out / "checkpoint-3" / ckpt.TRAINER_STATE).read_text())["marker"]
    assert marker == ("new" if new_complete else "old")


def test_temp_names():
    assert is_temp_name(".lora.k2j_x9a.tmp.safetensors") and is_temp_name(".checkpoint-4.tmp")
    assert is_temp_name(".r0000-20240101-abc.q1w2e3.tmp.json")
    assert not is_temp_name("lora.safetensors") and not is_temp_name("checkpoint-4")
    assert not is_temp_name("r0000-x.json") and not is_temp_name(".hidden")


# ---------------------------------------------------------------- disk full

def _enospc(p):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(p))


def _torch_short_write(p):
    Path(p).write_bytes(b"PK\x03\x04partial")
    try:
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    except RuntimeError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def _safetensors_full(p):
    Path(p).write_bytes(b"\x00" * 8)
    from safetensors import SafetensorError

    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })')


@pytest.mark.parametrize("fail", [_enospc, _torch_short_write, _safetensors_full])
def test_disk_full_is_one_clear_error_and_keeps_the_old_file(tmp_path, fail):
    target = tmp_path / "ckpt" / "trainable.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"previous complete file")
    with pytest.raises(DiskFullError) as info:
        atomic_save(target, fail)
    err = info.value
    assert err.errno == errno.ENOSPC and isinstance(err, OSError)
    assert f"no space left on {target.parent}" in str(err) and "trainable.safetensors" in str(err)
    assert "safe" in str(err) and "\n" not in str(err)
    assert err.__cause__ is None and err.__suppress_context__  # no chained tracebacks
    assert target.read_bytes() == b"previous complete file"
    assert sorted(p.name for p in target.parent.iterdir()) == ["trainable.safetensors"]  # temp file removed


def test_other_write_errors_are_not_called_disk_full(tmp_path):
    def broken(p):
        raise ValueError("bad tensor")

    with pytest.raises(ValueError, match="bad tensor"):
        atomic_save(tmp_path / "x.safetensors", broken)
    with pytest.raises(PermissionError):
        atomic_save(tmp_path / "y.json", lambda p: (_ for _ in ()).throw(PermissionError(errno.EACCES, "denied")))
    assert finished_files(tmp_path) == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["torch", "atomic"])
def test_disk_full_while_checkpointing_names_the_newest_complete_checkpoint(tmp_path, monkeypatch, kind):
    out = tmp_path / "out"
    _checkpoint(out, 2)

    def full(accelerator, module, optimizer, engine, out_dir, state, keep_last, metadata):
        tmp = out_dir / f".checkpoint-{state.step}.tmp"
        (tmp / "state").mkdir(parents=True)
        if kind == "atomic":
            atomic_save(tmp / "trainable.safetensors", _enospc)
        _torch_short_write(tmp / "state" / "optimizer.bin")  # accelerate's save_state writes with torch.save

    monkeypatch.setattr(ckpt, "_save_checkpoint", full)
    with pytest.raises(DiskFullError) as info:
        ckpt.save_checkpoint(None, None, None, None, out, ckpt.TrainerState(step=4))
    msg = str(info.value)
    assert f"no space left on {out / '.checkpoint-4.tmp'}" in msg
    assert f"newest complete checkpoint is {out / 'checkpoint-2'}" in msg and "checkpoint-4 was not saved" in msg
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]  # the unfinished one is removed


# ---------------------------------------------------------------- damaged checkpoints

@pytest.fixture(scope="module")
def saved_run(cache_dir, tiny_model_dir, tmp_path_factory):
    """A short real run that saved checkpoint-1 and checkpoint-2 (the pinned config, 2 steps)."""
    import copy

    from accelerate.state import AcceleratorState, GradientState

    from conftest import curve_script
    from diffsynth_qie.training.loop import train

    pinned = json.loads((Path(__file__).parent / "assets" / "train_loss_curve.json").read_text())
    sections = copy.deepcopy(pinned["config"])
    sections["train"].update(max_steps=2, save_every=1)
    out = tmp_path_factory.mktemp("saved-run")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    train(curve_script.run_config(sections, cache_dir, out, tiny_model_dir))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return out


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "truncated_lora": ("lora.safetensors", _truncate),
    "truncated_trainable": ("trainable.safetensors", _truncate),
    "missing_trainable": ("trainable.safetensors", Path.unlink),
    "bad_json": ("trainer_state.json", lambda p: p.write_text('{"format_version": 1, "step": 2,')),
    "missing_optimizer": ("state/optimizer.bin", Path.unlink),
    "truncated_optimizer": ("state/optimizer.bin", _truncate),
    "empty_scheduler": ("state/scheduler.bin", lambda p: p.write_bytes(b"")),
    "lora_bad_header": ("lora.safetensors", lambda p: p.write_bytes(b"\xff" * 64)),
}


def test_intact_checkpoints_pass_the_checks(saved_run):
    assert [p.name for p in ckpt.list_checkpoints(saved_run)] == ["checkpoint-1", "checkpoint-2"]
    for c in ckpt.list_checkpoints(saved_run):
        assert ckpt.checkpoint_problem(c) is None
    assert ckpt.resolve_resume("latest", saved_run) == saved_run / "checkpoint-2"


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_latest_skips_a_damaged_newest_checkpoint(saved_run, tmp_path, caplog, damage):
    import logging
    import shutil

    out = tmp_path / "out"
    shutil.copytree(saved_run, out)
    rel, fn = DAMAGE[damage]
    fn(out / "checkpoint-2" / rel)
    with caplog.at_level(logging.WARNING, logger="diffsynth_qie.training.checkpoint"):
        assert ckpt.resolve_resume("latest", out) == out / "checkpoint-1"
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(out / "checkpoint-2" / rel) in warning and "damaged" in warning
    with pytest.raises(ValueError, match=f"damaged checkpoint: {out / 'checkpoint-2' / rel}"):
        ckpt.resolve_resume(str(out / "checkpoint-2"), out)

    fn(out / "checkpoint-1" / rel)  # none intact: one clear error naming both
    with pytest.raises(ValueError) as info:
        ckpt.resolve_resume("latest", out)
    msg = str(info.value)
    assert "every checkpoint" in msg and str(out / "checkpoint-1" / rel) in msg and str(out / "checkpoint-2" / rel) in msg


def test_training_resumes_from_the_newest_intact_checkpoint(saved_run, cache_dir, tiny_model_dir, tmp_path):
    """End to end: `--resume latest` with a truncated newest optimizer state trains on from step 1,
    and a leftover temp LoRA of the killed run is removed at the start."""
    import copy
    import shutil

    from accelerate.state import AcceleratorState, GradientState

    from conftest import curve_script
    from diffsynth_qie.training.loop import train

    out = tmp_path / "out"
    shutil.copytree(saved_run, out)
    _truncate(out / "checkpoint-2" / "state" / "optimizer.bin")
    leftover = out / ".lora.k2j_x9a.tmp.safetensors"
    leftover.write_bytes(b"half")
    pinned = json.loads((Path(__file__).parent / "assets" / "train_loss_curve.json").read_text())
    sections = copy.deepcopy(pinned["config"])
    sections["train"].update(max_steps=2, save_every=1, resume="latest")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    result = train(curve_script.run_config(sections, cache_dir, out, tiny_model_dir))
    assert len(result.losses) == 1  # step 2 again, from checkpoint-1
    assert not leftover.exists()
    assert ckpt.checkpoint_problem(out / "checkpoint-2") is None  # saved again, intact
