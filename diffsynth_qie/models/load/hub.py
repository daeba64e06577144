"""Where model files are, and whether they can be downloaded: our own home (``$QIE_HOME``), DiffSynth's download
folder, ModelScope's cache (asked through ``snapshot_download(local_files_only=True)``), and one bounded TCP
connect to the hub, so a load that cannot succeed fails at once (``loading.resolve_model_configs``).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from ...utils.logging import library_logs_to_debug

log = logging.getLogger(__name__)

HUB_CHECK_TIMEOUT_S = 3.0


# --- locations -------------------------------------------------------------------
def qie_home() -> Path:
    """Root for our own downloads/builds: ``$QIE_HOME``, default ``~/.cache/diffsynth-qie``."""
    return Path(os.environ.get("QIE_HOME") or Path.home() / ".cache" / "diffsynth-qie").expanduser()


def default_tiny_dir() -> Path:
    return qie_home() / "models" / "Qwen-Image-Edit-tiny"


def diffsynth_model_base() -> Path:
    """The folder DiffSynth downloads into (``ModelConfig.reset_local_model_path``)."""
    return Path(os.environ.get("DIFFSYNTH_MODEL_BASE_PATH") or "./models")


def modelscope_snapshot(model_id: str) -> list[Path]:
    """ModelScope's cached snapshot folder of ``model_id`` (``[]`` if it has none), found by ModelScope's own
    ``snapshot_download(local_files_only=True)``: no network, nothing created, every cache layout it knows
    (current and pre-1.38). Not asked at all when the cache root (``$MODELSCOPE_CACHE``, default
    ``~/.cache/modelscope``) does not exist, which keeps a hopeless load fast."""
    root = Path(os.environ.get("MODELSCOPE_CACHE") or Path.home() / ".cache" / "modelscope").expanduser()
    if not root.is_dir():
        return []
    try:  # modelscope >= 1.38 delegates to the light modelscope-hub package (no torch import)
        from modelscope_hub.compat.snapshot_download import snapshot_download
    except ImportError:
        from modelscope.hub.snapshot_download import snapshot_download
    with library_logs_to_debug("modelscope", "modelscope_hub"):  # "using cached revision ..." is not news
        try:
            return [Path(snapshot_download(model_id=model_id, local_files_only=True))]
        except Exception as e:  # CacheNotFound and friends: not cached here
            log.debug("no ModelScope cache of %s: %s", model_id, e)
            return []


def skip_download() -> bool:
    return os.environ.get("DIFFSYNTH_SKIP_DOWNLOAD", "").strip().lower() == "true"


# --- can we download? ------------------------------------------------------------
def _hub_address() -> tuple[str, int]:
    """Host/port a download would connect to first (the proxy if one is set)."""
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        if os.environ.get(var):
            url = urlparse(os.environ[var] if "://" in os.environ[var] else "http://" + os.environ[var])
            return url.hostname or "", url.port or 80
    if os.environ.get("DIFFSYNTH_DOWNLOAD_SOURCE", "").lower() == "huggingface":
        url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    else:
        url = urlparse(os.environ.get("MODELSCOPE_ENDPOINT") or os.environ.get("MODELSCOPE_DOMAIN")
                       or "https://www.modelscope.cn")
        if not url.hostname:  # MODELSCOPE_DOMAIN may be a bare host name
            url = urlparse("https://" + (os.environ.get("MODELSCOPE_DOMAIN") or "www.modelscope.cn"))
    return url.hostname or "", url.port or (443 if url.scheme != "http" else 80)


def hub_reachable(timeout: float = HUB_CHECK_TIMEOUT_S) -> bool:
    """One TCP connect to the hub (DNS included) bounded by ``timeout`` seconds.

    Not a ModelScope API call: ``HubApi(timeout=..., max_retries=0).get_model`` still
    takes about 16 s to give up on a refused connection, which is the wait this check
    exists to avoid."""
    host, port = _hub_address()
    result: list[bool] = []

    def probe():
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    # A daemon thread bounds a hanging DNS lookup too (create_connection's timeout doesn't).
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def why_no_download() -> str | None:
    if skip_download():
        return "DIFFSYNTH_SKIP_DOWNLOAD is set"
    host, port = _hub_address()
    if not hub_reachable():
        return f"the model hub ({host}:{port}) is unreachable"
    return None
