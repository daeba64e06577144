"""The test suite's time against a baseline commit's, on the same machine (CPU).

    python -m benchmarks.suite_time [--baseline c92f43d] [--runs 1] [--workers 2] [--select tests ...]

Shared machines differ by several times in speed from one day to the next, so a suite time in minutes says little
on its own. This runs the suite of ``--baseline`` and of the working tree's ``HEAD`` one after the other, ``--runs``
times each (before, after, before, after, ...), with the options and environment of ``scripts/test.sh``, and prints
each run's time and test count and the ratio of the medians (after / before). Multiply the ratio by the baseline's
time on the machine where the limit was set to compare with that limit.

Each commit is checked out with ``git archive`` into a temporary folder, and both use this environment's Python
(``QIE_VENV`` or ``.venv``): the figure is the suite's, not setup's. ``--select`` passes other pytest targets
(``tests/test_cache.py``) for a quicker comparison of a part.

The default baseline, c92f43d, is the commit whose fresh clone ran 1,115 tests in 5:25–5:53 on 2 cores, when
the suite was given its limit of 5:00.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = "c92f43d"
TEST_ENV = {"DIFFSYNTH_SKIP_DOWNLOAD": "True", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1"}  # as scripts/test.sh sets them
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?)")

log = logging.getLogger("suite_time")


def checkout(repo: Path, rev: str, into: Path) -> Path:
    """``rev``'s tracked files in ``into`` (no .git, no submodule content: the suite uses the installed DiffSynth)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev], capture_output=True)
    if archive.returncode:
        raise ValueError(f"{rev!r} is not a commit of {repo}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run_suite(tree: Path, python: str, workers: int, select: list[str]) -> dict:
    """One run of ``select`` in ``tree``: wall seconds, the test counts of pytest's last line, its exit status."""
    xdist = ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"] if workers else []
    cmd = [python, "-m", "pytest", *select, "-q", "-p", "no:cacheprovider", *xdist]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env={**os.environ, **TEST_ENV}, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    counts = {kind: int(n) for n, kind in COUNT.findall(tail)}
    if proc.returncode not in (0, 1) or not counts:
        raise RuntimeError(f"pytest in {tree} exited {proc.returncode} without a summary: {proc.stderr[-2000:]}")
    return {"seconds": seconds, "counts": counts, "returncode": proc.returncode}


def compare(baseline: str, runs: int, workers: int, select: list[str], python: str, repo: Path = REPO) -> dict:
    """``runs`` interleaved runs of the baseline's and HEAD's suites: each run's figures and the ratio of medians."""
    results: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="qie-suite-time-") as tmp:
        trees = {"before": checkout(repo, baseline, Path(tmp) / "before"),
                 "after": checkout(repo, "HEAD", Path(tmp) / "after")}
        for i in range(runs):
            for side, tree in trees.items():
                log.info("run %d/%d, %s (%s) ...", i + 1, runs, side, baseline if side == "before" else "HEAD")
                results[side].append(run_suite(tree, python, workers, select))
                log.info("  %.1f s, %s", results[side][-1]["seconds"], results[side][-1]["counts"])
    medians = {side: statistics.median(r["seconds"] for r in rows) for side, rows in results.items()}
    return {"runs": results, "medians": medians, "ratio": medians["after"] / medians["before"]}


def report(result: dict, baseline: str) -> str:
    """A Markdown table of every run and the ratio line."""
    lines = ["| run | commit | tests | seconds | m:ss |", "|---|---|---|---|---|"]
    for side, rows in result["runs"].items():
        for i, r in enumerate(rows, 1):
            counts, whole = ", ".join(f"{n} {kind}" for kind, n in r["counts"].items()), round(r["seconds"])
            lines.append(f"| {side} {i} | {baseline if side == 'before' else 'HEAD'} | {counts} | "
                         f"{r['seconds']:.1f} | {whole // 60}:{whole % 60:02d} |")
    lines.append(f"\nafter / before (medians): {result['ratio']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="the commit to compare with (default %(default)s)")
    ap.add_argument("--runs", type=int, default=1, help="runs of each suite, interleaved (default %(default)s)")
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers, 0 for one process (as test.sh)")
    ap.add_argument("--select", nargs="+", default=["tests"], help="pytest targets (default: the whole suite)")
    ap.add_argument("--python", default=str(Path(os.environ.get("QIE_VENV", REPO / ".venv")) / "bin" / "python"),
                    help="the Python both suites run under (default: QIE_VENV's or .venv's)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        raise ValueError(f"--runs {args.runs}: give at least 1")
    if not Path(args.python).exists():
        raise ValueError(f"--python {args.python} does not exist: run `bash scripts/setup.sh` first, or pass one")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = compare(args.baseline, args.runs, args.workers, args.select, args.python)
    sys.stdout.write(report(result, args.baseline) + "\n")
    return result


if __name__ == "__main__":
    main()
