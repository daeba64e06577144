"""A stand-in for the virtual environment's ``python`` whose ``-m`` and ``-c`` runs start already imported.

Each process a launcher starts (``python -m diffsynth_qie.cli cache|train|edit|report|plan``, ``python -c "import
torch; ..."``) spends ~10-12 s of CPU importing torch, DiffSynth and transformers before its second of work. Tests
that run the real launch scripts point ``QIE_VENV`` (or ``PY``) at :func:`warm_python`'s folder instead: its
``bin/python`` is a small client that hands its arguments, environment, working directory and standard streams to a
server forked from the test process after the heavy imports; the server forks once more per run, and that child
runs the module, code or script (``python [-u] SCRIPT.py``) as ``python`` would (``__main__``, ``sys.argv``, exit
status) and exits with its status. Its ``sys.executable`` is the client, so the processes a launcher run this way starts
(``accelerate launch`` and ``torchrun`` start theirs as ``sys.executable [-u] -m MODULE`` or ``SCRIPT.py``) are warm
too. Anything else (other interpreter flags, multiprocessing's spawned children) runs the real interpreter.

What a fresh interpreter does and a fork would not, the child does: the caller's environment, directory and
streams, Python's default logging, warning and exception hooks, no accelerate state, no exit handlers of the test
process, freshly seeded random generators, default signal handlers, a rebuilt torch thread pool (conftest's
``_fresh_thread_pool``). One difference remains: a run that ends
without returning to Python (``os._exit``, a crash) exits with status 1 here, whatever its own status.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

#: what the launchers' Python processes import (the rest is imported by the child that needs it)
PRELOAD = ("torch", "diffsynth.pipelines.qwen_image", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "peft",
           "matplotlib.figure", "matplotlib.backends.backend_agg", "diffsynth_qie.cli", "diffsynth_qie.tiny.build",
           "diffsynth_qie.cache.writer", "diffsynth_qie.training.loop", "diffsynth_qie.training.module",
           "diffsynth_qie.training.validation", "diffsynth_qie.inference.editor", "diffsynth_qie.lora.manager",
           "diffsynth_qie.preflight.edit", "diffsynth_qie.training.report", "diffsynth_qie.memory.plan")

CLIENT = '''#!{python} -S
import json, os, signal, socket, sys
args = sys.argv[1:]
if args[:1] == ["-u"]:  # what torchrun starts its workers with
    args = args[1:]
    os.environ["PYTHONUNBUFFERED"] = "1"
script = args[:1] and not args[0].startswith("-") and args[0].endswith(".py") and os.path.isfile(args[0])
if not (args[:1] in (["-m"], ["-c"]) or script) or "--multiprocessing-fork" in args:
    os.execv({python!r}, [{python!r}] + sys.argv[1:])
s = socket.socket(socket.AF_UNIX)
s.connect({address!r})
request = json.dumps([args, dict(os.environ), os.getcwd()]).encode()
fds = []
for fd in (0, 1, 2):  # a closed stream is /dev/null to the run
    try:
        os.fstat(fd)
        fds.append(fd)
    except OSError:
        fds.append(os.open(os.devnull, os.O_RDWR))
socket.send_fds(s, [len(request).to_bytes(8, "big")], fds)
s.sendall(request)
f = s.makefile("rb")
pid = int(f.readline())
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda n, _: os.kill(pid, n))
status = f.readline()
os._exit(int(status) if status else 1)
'''


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the client went away")
        data += chunk
    return data


def _as_fresh_interpreter() -> None:
    """Once in the server: what the test process set up that a new interpreter would not have."""
    import atexit
    import faulthandler
    import logging
    import threading
    import warnings

    atexit._clear()  # the test process's exit handlers are not the child's
    faulthandler.disable()  # pytest's writes to the test process's stderr
    sys.excepthook, sys.unraisablehook = sys.__excepthook__, sys.__unraisablehook__
    threading.excepthook = threading.__excepthook__
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    root.__dict__.pop("_qie_configured", None)
    warnings.showwarning = warnings._showwarning_orig  # type: ignore[attr-defined]
    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    with contextlib.suppress(ImportError):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _run(argv: list[str]) -> int:
    """``python -m MODULE ARGS``, ``python -c CODE ARGS`` or ``python SCRIPT.py ARGS`` in this process; the exit
    status."""
    import runpy
    import traceback

    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path first, as python does
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] != "-c":  # a script's path
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        else:
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - what python prints and returns for an uncaught exception
        traceback.print_exception(e.with_traceback(e.__traceback__.tb_next))  # from the run's own frames
        return 130 if isinstance(e, KeyboardInterrupt) else 1


def _serve_one(conn: socket.socket) -> None:
    """In a child of the server: take over the client's streams, environment and directory, run, report."""
    import atexit
    import random

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    status = 1
    try:
        header, fds, _, _ = socket.recv_fds(conn, 8, 3)
        argv, env, cwd = json.loads(_recv_exactly(conn, int.from_bytes(header, "big")))
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False, buffering=1 if env.get("PYTHONUNBUFFERED") else -1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        random.seed()
        with contextlib.suppress(ImportError):
            import numpy
            import torch

            numpy.random.seed()
            torch.seed()
        conn.sendall(f"{os.getpid()}\n".encode())
        status = _run(argv)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(OSError):
            conn.sendall(f"{status}\n".encode())
        os._exit(status)


def _stop(*_) -> None:
    raise SystemExit


def _serve(listener: socket.socket) -> None:
    """The server: one forked child per client; SIGTERM stops it once its children have finished (waited for, so
    that their CPU time counts in the test process's)."""
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _as_fresh_interpreter()
    try:
        while True:
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                _serve_one(conn)
            conn.close()
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
    except SystemExit:
        with contextlib.suppress(ChildProcessError):
            while True:
                os.wait()


@contextlib.contextmanager
def warm_python(folder: Path, preload: tuple[str, ...] = PRELOAD, launches_warm: bool = True) -> Iterator[Path]:
    """A folder laid out as a virtual environment (``bin/python``) whose python runs ``-m``/``-c``/scripts in forks
    of a process that imported ``preload``; yields the folder, stops the server at the end. Without
    ``launches_warm`` a run's ``sys.executable`` stays the real interpreter (a run that shows its own venv's path)."""
    for name in preload:
        importlib.import_module(name)
    if "diffsynth_qie.cli" in preload:
        from diffsynth_qie.cli import build_parser

        build_parser()  # every command module
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    sockets = Path(tempfile.mkdtemp(prefix="warm-python-"))  # short: a socket's path has at most 107 bytes
    address = str(sockets / "server.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen(16)
    sys.stdout.flush()
    sys.stderr.flush()
    client = folder / "bin" / "python"
    pid = os.fork()
    if pid == 0:
        try:
            if launches_warm:
                sys.executable = str(client)  # what a run starts its own Python processes with (launchers' workers)
            _serve(listener)
        finally:
            os._exit(0)
    listener.close()
    client.write_text(CLIENT.format(python=sys.executable, address=address))
    client.chmod(0o755)
    try:
        yield folder
    finally:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60  # a run still going after its test (a timed-out test) is stopped
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
        shutil.rmtree(sockets, ignore_errors=True)
