"""Variants of the hardening cases: damaged LoRA metadata, cache JSON and checkpoints fail
with one clear error (or warning) naming the file, the field and the fix."""
from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diffsynth_qie.cache import shards
from diffsynth_qie.utils.dir_lock import CacheLock
from diffsynth_qie.cache.store import CacheStore
from diffsynth_qie.lora.formats import load_lora_state
from diffsynth_qie.training import checkpoint as ckpt
from diffsynth_qie.utils.integrity import safetensors_problem


# ---------------------------------------------------------------- LoRA alpha and adapter metadata
def _lora(path: Path, extra: dict | None = None, metadata: dict | None = None) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {"blk.a.lora_A.weight": torch.randn(4, 8, generator=g), "blk.a.lora_B.weight": torch.randn(16, 4, generator=g)}
    save_file({**tensors, **(extra or {})}, str(path),
              metadata={"lora_adapter_metadata": json.dumps(metadata)} if metadata else None)
    return path


@pytest.mark.parametrize("alpha", [0.0, -4.0])
def test_zero_or_negative_alpha_tensor_is_refused(tmp_path, alpha):
    path = _lora(tmp_path / "l.safetensors", {"blk.a.alpha": torch.tensor(alpha)})
    with pytest.raises(ValueError, match=rf"l\.safetensors: blk\.a\.alpha is {alpha:g}; a LoRA alpha must be positive"):
        load_lora_state(path)


@pytest.mark.parametrize("config, field, says", [
    ({"r": 4, "lora_alpha": 0}, "lora_alpha", "must be positive"),
    ({"r": 4, "lora_alpha": -8}, "lora_alpha", "must be positive"),
    ({"r": 4, "lora_alpha": "eight"}, "lora_alpha", "not a number"),
    ({"r": "four", "lora_alpha": 8}, "r", "not a number"),
    ({"r": 4, "lora_alpha": 4, "alpha_pattern": {"a[": 16}}, "alpha_pattern", "not a valid regular expression"),
    ({"r": 4, "lora_alpha": 4, "rank_pattern": {"(a": 4}}, "rank_pattern", "not a valid regular expression"),
    ({"r": 4, "lora_alpha": 4, "alpha_pattern": [16]}, "alpha_pattern", "not a JSON object"),
])
def test_bad_adapter_metadata_names_file_and_field(tmp_path, config, field, says):
    path = _lora(tmp_path / "meta.safetensors", metadata=config)
    with pytest.raises(ValueError) as info:
        load_lora_state(path)
    msg = str(info.value)
    assert str(path) in msg and f"'{field}'" in msg and says in msg, msg


def test_valid_pattern_alphas_still_apply_per_module(tmp_path):
    """Regex and suffix pattern keys keep working after the checks (PEFT's matching)."""
    g = torch.Generator().manual_seed(1)
    tensors = {f"blk.{i}.a.lora_{k}.weight": torch.randn(*(4, 8) if k == "A" else (16, 4), generator=g)
               for i in range(3) for k in "AB"}
    path = tmp_path / "p.safetensors"
    save_file(tensors, str(path), metadata={"lora_adapter_metadata": json.dumps(
        {"r": 4, "lora_alpha": 4, "alpha_pattern": {r"blk\.0\.a": 16, "1.a": 2}})})
    alphas = {name: m.alpha for name, m in load_lora_state(path).modules.items()}
    assert alphas == {"blk.0.a": 16.0, "blk.1.a": 2.0, "blk.2.a": 4.0}


# ---------------------------------------------------------------- cache JSON damaged after writing
MANIFEST_DAMAGE = {
    "truncated": ('{"format_version": 1, "entr', "not readable JSON"),
    "empty": ("", "not readable JSON"),
    "binary": (b"\xff\xfe\x00", "not readable JSON"),
    "a list": ("[]", "not a JSON object"),
    "no entries": ('{"format_version": 1}', "lacks shards, entries"),
}


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_damaged_manifest_names_the_file_and_the_fix(tmp_path, damage):
    content, says = MANIFEST_DAMAGE[damage]
    path = tmp_path / "manifest.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as info:
        CacheStore.open(tmp_path)
    msg = str(info.value)
    assert str(path) in msg and says in msg and "re-run `qie cache` with the same --cache_dir" in msg, msg


def test_damaged_shard_sidecar_names_the_file(tmp_path):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "s.safetensors").write_bytes(b"x")
    sidecar = tmp_path / "shards" / "s.json"
    sidecar.write_text('{"format_version": 1, "ent')
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1, "shards": ["s.safetensors"],
                                                        "entries": [], "missing": []}))
    with pytest.raises(ValueError, match=rf"{sidecar}.*re-run `qie cache`"):
        CacheStore.open(tmp_path)


@pytest.mark.parametrize("content", ["[]", '{"format_version": 1, "shard": "s.safetensors"}', '"text"'])
def test_sidecar_of_another_shape_is_ignored_on_resume(tmp_path, content, caplog):
    """A resumed `qie cache` re-encodes the rows of a damaged sidecar instead of crashing."""
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "s.safetensors").write_bytes(b"x")
    (tmp_path / "shards" / "s.json").write_text(content)
    with caplog.at_level(logging.WARNING, logger="diffsynth_qie.cache.shards"):
        assert shards.scan_shards(tmp_path) == []
    assert "s.json" in caplog.text


def test_lock_file_holding_other_json_still_gives_the_clear_message(tmp_path):
    first = CacheLock(tmp_path)
    first.acquire()
    try:
        (tmp_path / ".qie-cache-lock.json").write_text("[1, 2]")
        with pytest.raises(ValueError, match="another `qie cache` run .* is writing into"):
            CacheLock(tmp_path).acquire()
    finally:
        first.release()


# ---------------------------------------------------------------- checkpoints
def _checkpoint(out: Path, step: int) -> Path:
    c = out / f"checkpoint-{step}"
    (c / "state").mkdir(parents=True)
    for name in ("lora.safetensors", "trainable.safetensors"):
        save_file({"w": torch.zeros(2)}, str(c / name))
    torch.save({"state": {}}, c / "state" / "optimizer.bin")
    (c / "trainer_state.json").write_text(json.dumps(ckpt.TrainerState(step=step).to_json()))
    return c


def _header(obj) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack("<Q", len(data)) + data


@pytest.mark.parametrize("header", [[1], {"w": {"dtype": "F32"}}, {"w": 1}, {"w": {"data_offsets": "x"}}])
def test_safetensors_header_of_another_shape_is_a_problem_not_a_crash(tmp_path, header, caplog):
    out = tmp_path / "out"
    _checkpoint(out, 1)
    bad = _checkpoint(out, 2) / "lora.safetensors"
    bad.write_bytes(_header(header))
    assert "unreadable header" in safetensors_problem(bad)
    with caplog.at_level(logging.WARNING, logger="diffsynth_qie.training.checkpoint"):
        assert ckpt.resolve_resume("latest", out) == out / "checkpoint-1"
    assert str(bad) in caplog.text


@pytest.mark.parametrize("damage", ["emptied", "no_trainer_state"])
def test_newer_checkpoint_without_trainer_state_is_reported(tmp_path, caplog, damage):
    out = tmp_path / "out"
    _checkpoint(out, 1)
    newest = _checkpoint(out, 2)
    if damage == "emptied":
        shutil.rmtree(newest)
        newest.mkdir()
    else:
        (newest / "trainer_state.json").unlink()
    with caplog.at_level(logging.WARNING, logger="diffsynth_qie.training.checkpoint"):
        assert ckpt.resolve_resume("latest", out) == out / "checkpoint-1"
    assert str(newest / "trainer_state.json") in caplog.text and "damaged" in caplog.text

    shutil.rmtree(out / "checkpoint-1")  # nothing intact: an error, not a silent start from step 0
    with pytest.raises(ValueError, match=rf"every checkpoint .*{newest / 'trainer_state.json'} is missing"):
        ckpt.resolve_resume("latest", out)


def test_older_leftover_of_pruning_is_not_reported(tmp_path, caplog):
    """An interrupted removal of an old checkpoint (keep_last) leaves an older partial directory: quietly ignored."""
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    _checkpoint(out, 2)
    with caplog.at_level(logging.WARNING, logger="diffsynth_qie.training.checkpoint"):
        assert ckpt.resolve_resume("latest", out) == out / "checkpoint-2"
    assert "damaged" not in caplog.text
