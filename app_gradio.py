"""Mask-edit web UI for Qwen-Image-Edit: ``python app_gradio.py`` -> http://127.0.0.1:7999.

With no flags it serves the pretrained tiny base (installed on first use), with LoRAs
from ``./outputs``; see ``--help``. The layout is ``diffsynth_qie/ui/app.py``, the logic
``diffsynth_qie/ui/handlers.py``.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path


def _use_project_venv() -> None:
    """`python app_gradio.py` with a system python: re-run under the project's .venv if it exists.

    Looks the packages up without importing them (gradio alone takes seconds), so `--help` stays fast.
    """
    if not all(importlib.util.find_spec(name) for name in ("diffsynth_qie", "gradio")):
        venv = Path(__file__).resolve().parent / ".venv"
        venv_python = venv / "bin" / "python"
        if venv_python.exists() and Path(sys.prefix).resolve() != venv.resolve():
            os.execv(str(venv_python), [str(venv_python), *sys.argv])
        sys.exit("app_gradio.py: diffsynth-qie is not installed; run `bash scripts/setup.sh` first")


_use_project_venv()

from diffsynth_qie.ui.config import UIConfig  # noqa: E402
from diffsynth_qie.ui.startup import check_port_free, claim_temp_dir, port_in_use_message  # noqa: E402
from diffsynth_qie.utils.cli_checks import check_numbers  # noqa: E402
from diffsynth_qie.utils.config_cli import add_dataclass_args, dataclass_from_args  # noqa: E402
from diffsynth_qie.utils.logging import setup_logging  # noqa: E402

log = logging.getLogger("app_gradio")


def build_parser() -> argparse.ArgumentParser:
    """The UI's flags: one per :class:`UIConfig` field, plus the logging level."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_dataclass_args(parser, UIConfig)
    parser.add_argument("--log_level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), help="logging level (default: INFO)")
    return check_numbers(parser)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        config = dataclass_from_args(UIConfig, args)
    except ValueError as exc:
        parser.error(str(exc))

    try:  # before anything is touched: a second UI on the same port must not empty the first one's temp folder
        port_free = check_port_free(config.host, config.port)
    except ValueError as exc:
        print(f"app_gradio.py: {exc}", file=sys.stderr)
        return 2
    if not port_free:
        print(port_in_use_message(config.port), file=sys.stderr)
        return 2

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no phoning home
    temp_dir = config.resolved_temp_dir
    os.environ["GRADIO_TEMP_DIR"] = str(temp_dir)  # before gradio is imported: uploads and outputs go there
    claim_temp_dir(temp_dir)  # emptied unless another live UI owns it
    from diffsynth_qie.ui.app import build_ui, launch
    from diffsynth_qie.ui.handlers import UIHandlers
    from diffsynth_qie.ui.startup import quiet_client_disconnects

    handlers = UIHandlers(config)
    if config.preload:
        handlers.start_background_load()  # ready by the time a mask is painted
    demo = build_ui(handlers)
    quiet_client_disconnects()
    log.info("serving on http://%s:%d (model %s, LoRAs from %s)", config.host, config.port, config.model,
             config.lora_dir)
    launch(demo, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
