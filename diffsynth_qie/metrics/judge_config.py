"""How a judge is asked (``qie eval-edits --judge``, ``qie train --val_judge`` / ``--reward_judge``): one flag group.

Torch-free: ``qie train`` and ``qie eval-edits`` build their flags from it (``utils/config_cli.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..utils.config_cli import cli_help


@dataclass(frozen=True)
class JudgeConfig:
    """A judge's requests: how many at once, how long each may take, retries, reply length, a dead judge."""

    judge_workers: int = field(default=4, metadata=cli_help(
        "requests to the judge at once (its rows are scored while the next edits are made)", min=1, max=256))
    judge_timeout: float = field(default=60.0, metadata=cli_help(
        "seconds one judge request may take, from connecting to the last byte of its answer; always in force",
        min=0.01, max=86400))
    judge_retries: int = field(default=2, metadata=cli_help(
        "tries again after a timeout, a dropped connection, HTTP 408, 429 or 5xx, waiting 1, 2, 4, ... s (or the "
        "server's Retry-After, at most 60 s)", min=0, max=20))
    judge_max_tokens: int = field(default=2048, metadata=cli_help(
        "the longest reply asked for (room for a reasoning judge's reasoning); a reply cut there gives no score",
        min=16, max=1 << 20))
    judge_on_dead: Literal["stop", "skip"] = field(default="stop", metadata=cli_help(
        "when the judge does not answer (at the start, or 3 requests in a row later): stop the run with one line, "
        "or skip: go on without it (no judge score from then on; the run ends naming the rows without one). "
        "A reward judge is never left out: down, it stops the run"))
