"""Shared fixtures: one tiny model and one demo dataset per test session.

Nothing here may reach a model hub: DIFFSYNTH_SKIP_DOWNLOAD makes DiffSynth fail
fast instead of retrying ModelScope for ~20 s.
"""
from __future__ import annotations

import os

os.environ.setdefault("DIFFSYNTH_SKIP_DOWNLOAD", "True")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MODELSCOPE_CACHE", "/nonexistent-modelscope-cache")

import contextlib
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from diffsynth_qie.ui.running import free_port  # noqa: F401 (launchers and servers the tests start take it from here)

# tests/assets/make_train_loss_curve.py: the pinned training reference (also a script that
# regenerates the pinned curve); its cache builder serves every training test file.
_spec = importlib.util.spec_from_file_location(
    "make_train_loss_curve", Path(__file__).parent / "assets" / "make_train_loss_curve.py")
curve_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(curve_script)


def _fresh_thread_pool() -> None:
    """In every child forked from a test process (the forked runs below, the warm python's server and its runs):
    rebuild torch's intra-op thread pool now, in the child's only thread. After a fork torch marks the pool as
    corrupt and rebuilds it on first use; when several threads (the cache's prefetch workers) reach that first use
    together, one of them can find no pool ("pool INTERNAL ASSERT FAILED ... Invalid thread pool!")."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(torch.get_num_threads())


os.register_at_fork(after_in_child=_fresh_thread_pool)


@contextlib.contextmanager
def fresh_accelerate():
    """Inside: no accelerate state from an earlier run in this process (each train() builds its own
    Accelerator), and none left behind for the next test."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.fixture
def fresh_accelerate_state():
    """:func:`fresh_accelerate` around a test; modules that train in this process use it for every test
    (``pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")``)."""
    with fresh_accelerate():
        yield


@pytest.fixture(scope="module")
def cache21(request, tiny21_dir, tmp_path_factory):
    """The module's own cache of the mixed-size 2.1 demo (:func:`cache_demo21`), of its ``CACHE21_SEED``."""
    module = request.module.__name__
    return cache_demo21(tiny21_dir, tmp_path_factory, seed=request.module.CACHE21_SEED, name=f"demo21-{module}")


def kill_and_resume(base: list[str], tmp_path: Path, checkpoint: str, final: str,
                    separate: bool = False) -> tuple[Path, Path]:
    """Run the ``qie train`` command ``base`` (``python -m diffsynth_qie.cli train ...``) uninterrupted into
    ``tmp_path/ref``; run it again into ``tmp_path/run``, kill -9 it once ``checkpoint`` exists (before ``final`` is
    written) and ``--resume latest``. Returns (ref, run) for the caller to compare.

    The uninterrupted run is the same command's configuration trained in this process, and the resume is the
    command's ``main`` in this process (one intra-op thread, as ``scripts/test.sh`` sets OMP_NUM_THREADS=1). The
    killed run is a process of its own: forked from this one (it inherits the imports) and running the command's
    ``main``, it stops itself right after writing ``checkpoint`` and is killed with SIGKILL there; with
    ``separate`` it is a fresh ``python -m diffsynth_qie.cli train`` process killed once ``checkpoint`` appears."""
    from diffsynth_qie.cli import build_parser, main
    from diffsynth_qie.commands.train import config_from_args
    from diffsynth_qie.training.loop import train

    assert base[1:4] == ["-m", "diffsynth_qie.cli", "train"], base
    ref, out = tmp_path / "ref", tmp_path / "run"
    with fresh_accelerate():
        train(config_from_args(build_parser().parse_args(base[3:] + ["--output_dir", str(ref)])))
    if separate or not _killed_fork(base + ["--output_dir", str(out)], out / checkpoint, tmp_path / "fork.log"):
        shutil.rmtree(out, ignore_errors=True)  # (a fork that ended by itself: the fresh process instead)
        _killed_process(base + ["--output_dir", str(out)], out / checkpoint)
    assert (out / checkpoint).is_dir() and not (out / final).exists()  # killed mid-run
    with fresh_accelerate():
        assert main(base[3:] + ["--output_dir", str(out), "--resume", "latest"]) == 0
    return ref, out


def _killed_fork(command: list[str], checkpoint: Path, log_path: Path) -> bool:
    """``command``'s ``main`` in a child forked from this process, which stops itself (SIGSTOP) once it has
    written ``checkpoint``; then kill -9. False (logged, with the end of its output in ``log_path``) when the child
    ended without stopping there (a safety net: the one cause seen, torch's thread pool after a fork, is handled by
    ``_fresh_thread_pool``), and the caller then runs the fresh process."""
    import logging
    import signal

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            from diffsynth_qie.cli import main
            from diffsynth_qie.training import checkpoint as ckpt

            _output_to(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND))
            save = ckpt.save_checkpoint

            def save_then_stop(*args, **kwargs):
                path = save(*args, **kwargs)
                if Path(path).resolve() == checkpoint.resolve():
                    os.kill(os.getpid(), signal.SIGSTOP)
                return path

            ckpt.save_checkpoint = save_then_stop
            with fresh_accelerate():
                code = main(command[3:])
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, os.WUNTRACED)  # returns once the child stopped (or ended)
    if not os.WIFSTOPPED(status):
        tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        logging.getLogger(__name__).warning("the forked run ended (status %s) before stopping at %s; running a fresh "
                                            "process instead. Its output's end:\n%s", status, checkpoint, tail)
        return False
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return True


def _output_to(fd: int) -> None:
    """In a forked child: its output, at the file-descriptor and at Python's level (pytest's capture replaces
    ``sys.stdout``/``sys.stderr``), and its log handlers' streams go to ``fd``."""
    import logging

    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)
    for handler in logging.root.handlers + logging.getLogger("diffsynth_qie").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setStream(sys.stderr)


def _killed_process(command: list[str], checkpoint: Path) -> None:
    """``command`` as a fresh Python process, killed -9 once ``checkpoint`` exists."""
    import signal
    import subprocess
    import time

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not checkpoint.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def cache_demo21(tiny21_dir, tmp_path_factory, seed: int, name: str) -> Path:
    """The mixed-size demo (masks, one row with two references) of ``seed``, cached for the tiny 2.1."""
    from diffsynth_qie.cache.writer import CacheConfig, write_cache
    from diffsynth_qie.data.demo import make_demo_data
    from diffsynth_qie.data.formats import DatasetConfig

    data = make_demo_data(tmp_path_factory.mktemp(f"demo-{name}"), num_pairs=4, seed=seed, mixed_sizes=True)
    out = tmp_path_factory.mktemp(f"cache-{name}")
    write_cache(CacheConfig(cache_dir=str(out), model="tiny-2.1", model_dir=str(tiny21_dir), max_pixels=128 * 128,
                            num_workers=1, device="cpu", dtype="float32",
                            dataset=DatasetConfig(dataset_metadata=str(data / "metadata.json"))), rank=0, world_size=1)
    return out


@contextlib.contextmanager
def chat_server(reply, models=None, lifetime: float = 120.0):
    """A stand-in OpenAI-compatible chat endpoint on 127.0.0.1 for the judge tests: each POST is recorded in
    ``seen`` as (path, Authorization header, JSON body) and answered with ``reply(seen)``: the message content (a
    string), or a dict with any of ``content``, ``status`` (default 200), ``delay`` (seconds before answering),
    ``finish_reason`` ("length": a reply cut at max_tokens), ``body`` (raw bytes instead of a chat completion) and
    ``headers``. ``GET /v1/models`` lists ``models`` (404 without). Requests are served concurrently (``active``:
    the most at once); the server stops at the end of the block, or after ``lifetime`` seconds, whichever is
    first, and a delayed answer ends when it stops. Yields ``(base_url, seen)``; ``seen.active`` holds the peak."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Seen(list):
        active = 0

    seen, lock, stop, now = Seen(), threading.Lock(), threading.Event(), [0]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            with lock:
                seen.append((self.path, self.headers.get("Authorization"),
                             json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                now[0] += 1
                seen.active = max(seen.active, now[0])
                answer = reply(seen)
            try:
                self._answer(answer if isinstance(answer, dict) else {"content": answer})
            finally:
                with lock:
                    now[0] -= 1

        def _answer(self, a: dict):
            if stop.wait(a.get("delay", 0)):
                return  # the server is stopping: no answer
            body = a.get("body") or json.dumps({"choices": [{"message": {"content": a.get("content")},
                                                             "finish_reason": a.get("finish_reason", "stop")}]}).encode()
            self.send_response(a.get("status", 200))
            for k, v in {"Content-Type": "application/json", **a.get("headers", {})}.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802
            if models is None or not self.path.endswith("/models"):
                self.send_error(404)
                return
            body = json.dumps({"data": [{"id": m} for m in models]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    timer = threading.Timer(lifetime, lambda: (stop.set(), httpd.shutdown()))
    timer.daemon = True
    timer.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", seen
    finally:
        stop.set()
        timer.cancel()
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One intra-op thread for the whole run: tiny tensors gain nothing from more, and on a busy 2-core machine
    OpenMP's spinning threads made tiny runs up to 10-15x slower (an edit 0.4 s -> 3.7 s, the LBM toy training
    7 s -> 130 s). Subprocess tests set OMP_NUM_THREADS=1 for the same reason. Thread count does not change
    the numbers the tests pin (the pinned loss curve is identical with 1 and 2 threads)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fake_lpips_home(tmp_path, monkeypatch):
    """TORCH_HOME whose hub cache holds an AlexNet backbone file with random values: LPIPS's real loading path,
    with no download (real LPIPS values need the real torchvision weights, which tests cannot fetch)."""
    import torch
    import torchvision

    from diffsynth_qie.metrics import lpips

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    path = lpips.backbone_weights_path("alex")
    path.parent.mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(torchvision.models.alexnet(weights=None).state_dict(), path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of a tiny Qwen-Image-Edit built once per session (real repo layout)."""
    from diffsynth_qie.tiny.build import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny-model") / "Qwen-Image-Edit-tiny", seed=0)


@pytest.fixture(scope="session")
def tiny21_dir(tmp_path_factory):
    """Path of a tiny Qwen-Image-2.1 built once per session (real repo layout, DiffSynth's real 2.1 classes)."""
    from diffsynth_qie.tiny.qwen21 import build_tiny21

    return build_tiny21(tmp_path_factory.mktemp("tiny21") / "Qwen-Image-2.1-tiny", seed=0)


@pytest.fixture(scope="module")
def warm_venv(tmp_path_factory):
    """A folder laid out as a virtual environment whose ``bin/python`` runs ``-m``/``-c`` in forks of a process that
    has imported torch, DiffSynth and every ``qie`` command (tests/warm_python.py): a launch script pointed at it
    (``QIE_VENV``) runs its ~5 Python processes in about a second each instead of ~12 s of imports."""
    from warm_python import warm_python

    with warm_python(tmp_path_factory.mktemp("warm-venv")) as folder:
        yield folder


@pytest.fixture(scope="session")
def demo_data_dir(tmp_path_factory):
    """A small synthetic editing dataset (DiffSynth metadata.json + images + masks)."""
    from diffsynth_qie.data.demo import make_demo_data

    return make_demo_data(tmp_path_factory.mktemp("demo-data"), num_pairs=8, seed=0)


@pytest.fixture(scope="session")
def tiny_pipe(tiny_model_dir):
    """Full tiny pipeline (text encoder + DiT + VAE), fp32 on CPU. Treat as read-only."""
    import torch

    from diffsynth_qie.models.load.loading import load_pipeline

    return load_pipeline("tiny", model_dir=tiny_model_dir, device="cpu", torch_dtype=torch.float32)


@pytest.fixture(scope="session")
def cache_dir(tiny_pipe, demo_data_dir, tmp_path_factory):
    """The training tests' phase-1 cache of the demo data (built once; read-only)."""
    return curve_script.build_cache(tiny_pipe, Path(demo_data_dir), tmp_path_factory.mktemp("train-cache"))


#: slow files handed out first, in this order (worker 1, worker 2, worker 1, worker 2; then each as it frees up)
FIRST_FILES = ("test_train_ddp.py", "test_zero3.py", "test_ema_zero3.py", "test_train_zero_schedule_free.py",
               "test_launchers.py", "test_launchers_more.py", "test_ui_browser.py")


def pytest_collection_modifyitems(config, items):
    """Files with ``slow`` tests (subprocess launches, minutes each) run first, each file's tests in their own order.

    Under ``scripts/test.sh`` (two xdist workers, one file at a time, ``--no-loadscope-reorder``) files are handed
    out in this order: the long files start at once and the many short ones fill in around them, instead of the
    long ones starting last and one worker finishing them alone.

    The two-rank runs (DDP, ZeRO-3) come first, beside each other, then the launchers (one subprocess at a time),
    and the browser test (which keeps more than one core busy: Chromium, the app, the test) last of these: a two-rank
    run's collectives wait whenever a rank loses its core, and beside the browser test the ZeRO-3 schedule-free run
    took 122 s instead of 23 s. xdist gives each worker two files at the start and another whenever it has two tests
    or fewer left, so with the launchers between them the browser test starts after the last two-rank file."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    first = {name: i for i, name in enumerate(FIRST_FILES)}

    def order(item):
        return item.path not in slow_files, first.get(item.path.name, len(first))

    items.sort(key=order)  # stable: the rest keep the collection order


def forked_ranks(argv: list[str], world_size: int, logs: Path, timeout: float = 300) -> None:
    """``qie`` ``argv`` (``main``) as a real ``world_size``-process torch.distributed run (gloo on CPU) whose ranks
    are children forked from this process, with the variables torchrun gives its workers: the ranks inherit this
    process's imports instead of each paying them. Each rank's output goes to ``logs/rank<i>.log``; every rank
    must exit 0 within ``timeout`` seconds."""
    import signal
    import time

    from diffsynth_qie.ui.running import free_port

    logs.mkdir(parents=True, exist_ok=True)
    port, pids = free_port(), []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:  # a rank: never returns into pytest
            code = 1
            try:
                from diffsynth_qie.cli import main

                log = os.open(logs / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                _output_to(log)
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                                  LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port), OMP_NUM_THREADS="1")
                with fresh_accelerate():
                    code = main(argv)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    deadline, codes = time.monotonic() + timeout, {}
    while len(codes) < world_size and time.monotonic() < deadline:
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for rank, pid in enumerate(pids):
        if rank not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    tails = "\n".join(f"--- rank {r}\n" + (logs / f"rank{r}.log").read_text()[-3000:] for r in range(world_size))
    assert codes == {r: 0 for r in range(world_size)}, f"exit codes {codes} (missing: timed out)\n{tails}"
