"""What ``app_gradio.py`` decides before and while the UI starts: port, temp folder, model, CPU threads.

- :func:`check_port_free` runs before anything else touches the machine, so a second
  UI on a busy port stops with one line instead of a traceback.
- :func:`claim_temp_dir`: the temp folder is emptied at startup only when no other
  running UI holds its lock (``utils.dir_lock.UITempLock``), so a second instance
  never breaks the first one's download links.
- :func:`resolve_model_dir` and :func:`apply_threads` run in the background model
  load: the page comes up first, then the pretrained tiny base is installed (once)
  and torch's CPU threads are set.

Only the standard library at module top: ``app_gradio.py --help`` stays fast.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..utils.dir_lock import DirLock
    from .config import UIConfig

log = logging.getLogger(__name__)

MAX_AUTO_THREADS = 4  # --threads 0 on the CPU: at most this many (see auto_threads)


# --- port ---------------------------------------------------------------------------------
class QuietClientDisconnect(logging.Filter):
    """Drop the server's traceback for a browser that went away in the middle of an upload (starlette's
    ``ClientDisconnect``): nothing is wrong, and a full traceback reads like a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and type(exc).__name__ == "ClientDisconnect":
            log.info("a browser disconnected during an upload")
            return False
        return True


def quiet_client_disconnects() -> None:
    """Install :class:`QuietClientDisconnect` on the loggers that report errors in ASGI requests."""
    for name in ("uvicorn.error", "uvicorn", "gradio"):
        logging.getLogger(name).addFilter(QuietClientDisconnect())


def check_port_free(host: str, port: int) -> bool:
    """True if a server could listen on ``host:port`` now; False if something already does.

    Binds a socket the way the UI's server will (``SO_REUSEADDR`` on POSIX, so a port
    left in TIME_WAIT by a UI that just stopped counts as free) and closes it at once.
    Other failures (a host that is not an interface of this machine, a privileged
    port) raise ValueError naming the flag.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host} cannot be resolved ({exc.strerror}); give an address of this "
                         "machine such as 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        if os.name == "posix":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise ValueError(f"cannot listen on --host {host} --port {port} ({exc.strerror}); pass a --host of "
                             "this machine and a --port above 1023") from None
    return True


def port_in_use_message(port: int) -> str:
    return f"app_gradio.py: port {port} is in use (another UI or program); pass --port with a free port"


# --- temp folder ----------------------------------------------------------------------------
_held: dict[Path, "DirLock"] = {}  # this process's temp-folder locks, held until it ends


def claim_temp_dir(path: str | os.PathLike) -> bool:
    """Take ``path``'s lock (``utils.dir_lock.UITempLock``) and empty it, unless another running UI holds it.

    Returns True when claimed (also when this process already holds it). False when another
    live UI holds it: its files are left alone (its users' download links keep working) and a
    warning names that UI and says the folder is shared. The operating system releases the
    lock when the process ends, also on a kill, so a dead UI never keeps the folder.
    """
    from ..utils.dir_lock import UITempLock, UnwritableDirectory
    from .uploads import prune_temp_files

    path = Path(path).resolve()
    if path not in _held:
        lock = UITempLock(path)
        try:
            lock.acquire()
        except UnwritableDirectory:
            raise
        except ValueError:
            holder = lock.holder()
            log.warning("temp folder %s belongs to another running UI (pid %s); leaving its files alone and sharing "
                        "it (pass --temp_dir to give this UI its own)", path, holder.get("pid", "unknown"))
            return False
        _held[path] = lock
    prune_temp_files(path, 0, keep_seconds=0)  # files left by an earlier run
    return True


# --- model ----------------------------------------------------------------------------------
def wants_pretrained_tiny(config: "UIConfig") -> bool:
    """True for ``--model tiny`` without ``--model_dir``: the UI then serves the pretrained tiny base."""
    from ..models.presets import get_preset

    return config.model_dir is None and get_preset(config.model).name == "tiny"


def resolve_model_dir(config: "UIConfig") -> str | None:
    """The model directory the UI loads: ``--model_dir`` as given, or for ``--model tiny`` the pretrained tiny base.

    The base lives in ``$QIE_HOME/models/Qwen-Image-Edit-tiny-pretrained`` (where
    ``qie make-tiny --pretrained`` and the launch scripts put it); it is installed
    there from the weights shipped with the package when missing (seconds). When
    they do not fit this install, None (the random tiny model, whose edits are
    noise) with a warning saying how to build the base. Slow the first time: call
    it from the background model load.
    """
    if not wants_pretrained_tiny(config):
        return config.model_dir
    from ..tiny import pretrained as tiny_pretrained
    from ..tiny.build import looks_like_tiny_dir
    from ..training.pretrain_tiny import recipe_fingerprint

    base, fp = tiny_pretrained.default_dir(), recipe_fingerprint(0)
    if tiny_pretrained.is_pretrained(base, fp):
        tiny_pretrained.register()
        return str(base)
    why = "the weights shipped with the package do not fit this install"
    if not looks_like_tiny_dir(base):
        why = f"{base} holds files that are not part of a tiny model"
    else:
        log.info("installing the pretrained tiny base in %s ...", base)
        try:
            if tiny_pretrained.install_shipped(base, fp):
                return str(base)
        except OSError as exc:
            why = f"installing it in {base} failed ({exc})"
    log.warning("serving the random tiny model (its edits look like noise): %s. Build the pretrained tiny base "
                "once with `qie make-tiny --pretrained` (a few minutes on the CPU) and restart the UI", why)
    return None


def model_label(model_dir: str | os.PathLike | None) -> str:
    """"pretrained tiny base" when ``model_dir`` holds one, else "" (for the model status line)."""
    if model_dir is None:
        return ""
    from ..tiny import pretrained as tiny_pretrained

    return "pretrained tiny base" if tiny_pretrained.info(Path(model_dir)).get("pretrained") else ""


def random_label(model: str, model_dir: str | os.PathLike | None) -> str:
    """"random weights …" for a tiny preset that is not the pretrained base (its edits are noise), else ""."""
    from ..models.presets import get_preset

    preset = get_preset(model)
    if not preset.is_tiny or model_label(model_dir):
        return ""
    if preset.name == "tiny":
        return "random weights: edits look like noise; build the base with `qie make-tiny --pretrained`"
    return "random weights: a test model, its edits look like noise (no pretrained base is shipped for it)"


# --- CPU threads ----------------------------------------------------------------------------
def auto_threads() -> int:
    """``--threads 0`` on the CPU: half the cores this process may use, at least 1, at most 4.

    Measured on 2 cores (``benchmarks/ui_threads.py``, pretrained tiny base): torch's
    default (one thread per core) was 1.06x the 1-thread time of a 64x64 8-step edit and
    0.76x at 128x128, 20 steps on an idle machine, but 3.7x and 3.9x with one busy
    neighbour process and 68x (5 s instead of 0.07 s) with two: its threads wait for
    cores another job holds. Half the cores leaves room for that job.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_AUTO_THREADS, cores // 2))


def generation_device(config: "UIConfig") -> str:
    """The device the DiT (most of the work) runs on: ``--dit_device``, ``--device`` or the default."""
    if config.dit_device or config.device:
        return str(config.dit_device or config.device)
    from ..models.load.loading import default_device

    return default_device()


def apply_threads(config: "UIConfig") -> int | None:
    """Set torch's CPU threads from ``--threads`` (0 = :func:`auto_threads` when generating on the CPU,
    torch's default on a GPU). Returns the count set, or None when left as it was."""
    import torch

    n = config.threads
    if n == 0:
        if not generation_device(config).startswith("cpu"):
            return None
        n = auto_threads()
    torch.set_num_threads(n)
    log.info("torch CPU threads: %d (--threads %d)", n, config.threads)
    return n
