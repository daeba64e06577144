"""``app_gradio.py``'s startup: a busy port, the shared temp folder, a fast ``--help``, the served tiny model,
torch's CPU threads (``diffsynth_qie/ui/startup.py``)."""
from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app_gradio.py"


def _run_app(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


# --- port ---------------------------------------------------------------------------------------
def test_busy_port_exits_with_one_line_and_keeps_the_temp_folder(tmp_path):
    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.startup import check_port_free, port_in_use_message

    port = free_port()
    temp_dir = UIConfig(port=port, temp_dir=str(tmp_path)).resolved_temp_dir
    temp_dir.mkdir(parents=True)
    served = temp_dir / "abc123" / "edit.png"  # a file the running UI serves for download
    served.parent.mkdir()
    served.write_bytes(b"first user's result")
    with socket.socket() as running:  # the first instance
        running.bind(("127.0.0.1", port))
        running.listen()
        assert not check_port_free("127.0.0.1", port)
        proc = _run_app(str(APP), "--port", str(port), "--temp_dir", str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [port_in_use_message(port)]
    assert f"port {port} is in use" in proc.stderr and "--port" in proc.stderr and "Traceback" not in proc.stderr
    assert served.read_bytes() == b"first user's result"
    assert check_port_free("127.0.0.1", port)  # closed again: free


def test_the_app_starter_names_an_app_that_exits_with_its_log(tmp_path):
    """ui/running.py, the one start of the app for the browser test, the first-result benchmark and the screenshots:
    an app that stops (here: its port is taken) is said at once, with the end of its log."""
    from diffsynth_qie.ui.running import AppNotServing, running_app
    from diffsynth_qie.ui.startup import port_in_use_message

    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(AppNotServing, match="exited with 2") as caught:
            with running_app(["--temp_dir", tmp_path / "tmp"], tmp_path / "app.log", port=port, timeout=60):
                pass
    assert port_in_use_message(port) in str(caught.value)


def test_port_check_names_a_bad_host():
    with pytest.raises(ValueError, match="--host no-such-host.invalid"):
        from diffsynth_qie.ui.startup import check_port_free

        check_port_free("no-such-host.invalid", free_port())


# --- temp folder lock ------------------------------------------------------------------------------
def _folder_with_a_leftover(path: Path) -> Path:
    left = path / "old" / "upload.png"
    left.parent.mkdir(parents=True, exist_ok=True)
    left.write_bytes(b"x" * 100)
    return left


def _ui_holding(path: Path, then: str = "time.sleep(30)") -> subprocess.Popen:
    """Another process (a running UI) that takes ``path``'s temp-folder lock, says so, then runs ``then``."""
    code = ("import sys, time\nfrom diffsynth_qie.utils.dir_lock import UITempLock\n"
            f"UITempLock({str(path)!r}).acquire()\nprint('held', flush=True)\n{then}\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_claim_temp_dir_leaves_a_live_owners_files_alone(tmp_path, caplog):
    from diffsynth_qie.ui.startup import claim_temp_dir

    other = _ui_holding(tmp_path / "ui")
    try:
        left = _folder_with_a_leftover(tmp_path / "ui")
        with caplog.at_level(logging.WARNING, logger="diffsynth_qie.ui.startup"):
            assert claim_temp_dir(tmp_path / "ui") is False
        assert left.exists()
        assert str(other.pid) in caplog.text and "--temp_dir" in caplog.text
        free = _folder_with_a_leftover(tmp_path / "ui-other")  # another --temp_dir: unaffected
        assert claim_temp_dir(tmp_path / "ui-other") and not free.exists()
    finally:
        other.kill()
        other.wait()


def test_claim_temp_dir_empties_a_folder_of_a_dead_owner(tmp_path):
    from diffsynth_qie.ui.startup import claim_temp_dir
    from diffsynth_qie.utils.dir_lock import UITempLock

    _ui_holding(tmp_path / "ui", then="").wait()  # a UI that ended (killed or not): its lock is gone with it
    left = _folder_with_a_leftover(tmp_path / "ui")
    assert claim_temp_dir(tmp_path / "ui") is True
    assert not left.exists() and UITempLock(tmp_path / "ui").holder()["pid"] == os.getpid()
    again = _folder_with_a_leftover(tmp_path / "ui")
    assert claim_temp_dir(tmp_path / "ui") is True and not again.exists()  # this process is not "another UI"
    assert claim_temp_dir(tmp_path / "fresh") and UITempLock(tmp_path / "fresh").holder()["pid"] == os.getpid()


def test_pruning_keeps_the_lock_file(tmp_path):
    from diffsynth_qie.ui.startup import claim_temp_dir
    from diffsynth_qie.ui.uploads import prune_temp_files
    from diffsynth_qie.utils.dir_lock import UITempLock

    assert claim_temp_dir(tmp_path)
    left = _folder_with_a_leftover(tmp_path)
    removed = prune_temp_files(tmp_path, 0, keep_seconds=0)
    assert removed == [left] and UITempLock(tmp_path).holder()["pid"] == os.getpid()


# --- fast --help ----------------------------------------------------------------------------------
def test_help_imports_neither_gradio_nor_torch():
    proc = _run_app("-X", "importtime", str(APP), "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--threads" in proc.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:") and line.count("|") == 2}
    assert "diffsynth_qie.ui.config" in imported  # the parse worked
    heavy = {name for name in imported if name.split(".")[0] in ("gradio", "torch", "diffsynth")}
    assert not heavy, sorted(heavy)[:20]


# --- the served model -----------------------------------------------------------------------------
def test_tiny_ui_serves_the_pretrained_base(tmp_path, monkeypatch):
    from diffsynth_qie.tiny import pretrained as tiny_pretrained
    from diffsynth_qie.training.pretrain_tiny import recipe_fingerprint
    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.startup import model_label, resolve_model_dir

    monkeypatch.setenv("QIE_HOME", str(tmp_path / "home"))
    got = resolve_model_dir(UIConfig())
    assert got is not None and Path(got).is_relative_to(tmp_path / "home")
    assert tiny_pretrained.is_pretrained(got, recipe_fingerprint(0))
    assert model_label(got) == "pretrained tiny base" and model_label(None) == ""

    def no_install(*_a, **_k):
        raise AssertionError("an installed base must be reused, not installed again")

    monkeypatch.setattr(tiny_pretrained, "install_shipped", no_install)
    assert resolve_model_dir(UIConfig()) == got

    # What the UI loads and says: plain `python app_gradio.py` gets this base, not random weights.
    from diffsynth_qie.inference.editor import Editor
    from diffsynth_qie.ui.handlers import UIHandlers

    loaded = {}
    monkeypatch.setattr(Editor, "from_preset", classmethod(lambda cls, **kw: loaded.update(kw) or object()))
    handlers = UIHandlers(UIConfig(examples=""))
    handlers.editor()
    assert loaded["model_dir"] == got and loaded["model"] == "tiny"
    assert "(pretrained tiny base)" in handlers.model_status() and got in handlers.model_status()


def test_explicit_model_dir_and_other_presets_are_used_as_given(tmp_path, monkeypatch):
    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.startup import resolve_model_dir

    monkeypatch.setenv("QIE_HOME", str(tmp_path / "home"))
    mine = str(tmp_path / "my-tiny")
    assert resolve_model_dir(UIConfig(model_dir=mine)) == mine
    assert resolve_model_dir(UIConfig(model="2511")) is None  # the preset's own location
    assert resolve_model_dir(UIConfig(model="tiny-2.1")) is None
    assert not (tmp_path / "home").exists()  # nothing built


def test_unusable_shipped_weights_fall_back_to_the_random_tiny_model(tmp_path, monkeypatch, caplog):
    from diffsynth_qie.tiny import pretrained as tiny_pretrained
    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.startup import resolve_model_dir

    monkeypatch.setenv("QIE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tiny_pretrained, "install_shipped", lambda *_a, **_k: False)
    with caplog.at_level(logging.WARNING, logger="diffsynth_qie.ui.startup"):
        assert resolve_model_dir(UIConfig()) is None
    assert "random tiny model" in caplog.text and "qie make-tiny --pretrained" in caplog.text


# --- threads ----------------------------------------------------------------------------------------
@pytest.fixture
def keep_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_threads_flag(keep_threads, monkeypatch):
    import torch

    from diffsynth_qie.ui.config import UIConfig
    from diffsynth_qie.ui.startup import apply_threads, auto_threads
    from diffsynth_qie.utils.cli_checks import check_numbers
    from diffsynth_qie.utils.config_cli import add_dataclass_args, dataclass_from_args

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, UIConfig)
    assert dataclass_from_args(UIConfig, parser.parse_args([])).threads == 0
    config = dataclass_from_args(UIConfig, parser.parse_args(["--threads", "3"]))
    assert apply_threads(config) == 3 and torch.get_num_threads() == 3
    with pytest.raises(SystemExit):
        check_numbers(parser).parse_args(["--threads", "-1"])
    with pytest.raises(ValueError, match="--threads -2"):
        UIConfig(threads=-2)

    n = auto_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= n <= max(1, cores // 2) and n <= 4
    assert apply_threads(UIConfig(device="cpu")) == n and torch.get_num_threads() == n
    torch.set_num_threads(2)
    import diffsynth_qie.models.load.devices as devices

    monkeypatch.setattr(devices, "check_device_flags", lambda values: None)  # as on a machine with a GPU
    assert apply_threads(UIConfig(device="cuda")) is None and torch.get_num_threads() == 2  # a GPU: left alone
