"""Metrics out: an always-on ``loss.jsonl`` and, with ``--report_to wandb``, Weights & Biases.

``loss.jsonl`` has one JSON object per logged optimizer step (``step``, ``loss``,
``lr``, ``epoch`` and every metric the loss reported). On resume the lines after the
checkpoint's step are dropped first, so the file always reads as one clean curve.
Validation metrics (``val_psnr``, ...) join the line of their step, or start a line
with only ``step`` and those metrics when that step logged no loss (``--log_every``).

WandB honours ``WANDB_PROJECT`` (default ``diffsynth-qie``), ``WANDB_NAME`` and
``WANDB_MODE`` (tests use ``offline``); a resumed run continues the same WandB run
(its id is kept in ``<output_dir>/wandb_run_id``). Only the main process logs.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from ..utils.atomic import atomic_write_text

log = logging.getLogger(__name__)

LOSS_LOG = "loss.jsonl"
VALIDATION_DIR = "validation"  # validation strips and scores, one folder per step (training/validation.py)
WANDB_ID_FILE = "wandb_run_id"


def read_loss_log(path: str | os.PathLike) -> list[dict]:
    """Records of a ``loss.jsonl``: JSON objects with an integer ``step``. Anything else (a torn last line,
    a line some other tool appended, bytes that are not UTF-8) is skipped with one warning naming the file,
    so a damaged log never stops ``qie report`` or a resume."""
    records, bad = [], 0
    p = Path(path)
    if not p.is_file():
        return records
    for line in p.read_bytes().decode("utf-8", errors="replace").split("\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int) and not isinstance(record["step"], bool):
            records.append(record)
        else:
            bad += 1
    if bad:
        log.warning("%s: skipped %d line(s) that are not loss records (a torn write or another tool's lines)",
                    p, bad)
    return records


class Tracker:
    """Main-process metric sink; a no-op object on other ranks."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool, report_to: str = "none",
                 config: Optional[dict] = None, resume_step: Optional[int] = None):
        self.enabled = enabled
        self.path = Path(output_dir) / LOSS_LOG
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            kept = [r for r in read_loss_log(self.path) if r.get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        elif self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh curve
        self._file = open(self.path, "a", encoding="utf-8")
        self._last: Optional[tuple[int, dict]] = None  # (file offset, record) of the last line written
        if report_to == "wandb":
            self._wandb = self._init_wandb(Path(output_dir), config or {}, resume_step is not None)

    @staticmethod
    def _init_wandb(output_dir: Path, config: dict, resuming: bool):
        try:
            import wandb
        except ImportError as e:
            raise ValueError("--report_to wandb needs `pip install wandb` (or the project's [train] extra)") from e
        id_file = output_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "diffsynth-qie"), name=os.environ.get("WANDB_NAME"),
                         dir=str(output_dir), config=config, id=run_id, resume="allow" if run_id else None)
        atomic_write_text(id_file, run.id + "\n")
        log.info("WandB run %s (project %s, mode %s)", run.id, run.project, os.environ.get("WANDB_MODE", "online"))
        return run

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._write(record)
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in record.items() if k != "step"}, step=step)

    def log_validation(self, step: int, metrics: dict[str, Any]) -> None:
        """Validation metrics of ``step``: added to that step's line (WandB: ``validation/<name>``)."""
        if not self.enabled or not metrics:
            return
        values = {k: _plain(v) for k, v in metrics.items()}
        if self._last is not None and self._last[1].get("step") == step:
            offset, record = self._last
            self._file.seek(offset)
            self._file.truncate()
            self._write({**record, **values}, offset)
        else:
            self._write({"step": step, **values})
        if self._wandb is not None:
            self._wandb.log({f"validation/{k}": v for k, v in values.items()}, step=step)

    def _write(self, record: dict, offset: Optional[int] = None) -> None:
        offset = self._file.tell() if offset is None else offset
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._last = (offset, record)

    def log_images(self, step: int, images: dict[str, Any]) -> None:
        """PIL images by caption, to WandB when it is on (files are written by validation)."""
        if not self.enabled or self._wandb is None or not images:
            return
        import wandb

        self._wandb.log({"validation": [wandb.Image(img, caption=name) for name, img in images.items()]}, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return v
