#!/usr/bin/env bash
# The test command: sets up the environment (idempotent), then runs the whole suite on CPU.
#   bash scripts/test.sh [extra pytest args]
# Two pytest-xdist workers (QIE_TEST_WORKERS; 0 runs in one process), one test file per worker at a
# time: the slow tests are single-threaded subprocesses (launchers, DDP, ZeRO, the browser), so two
# run side by side on two cores, and module-scoped fixtures are built once. Files are handed out in
# collection order, which tests/conftest.py starts with the files of `slow` tests (xdist's default
# order, most tests first, would start those few-test, minutes-long files last).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
bash scripts/install_chromium.sh || echo "test.sh: Chromium unavailable; the browser test will be skipped with its reason."
# One OpenMP thread in every process the tests start (launchers, kill-and-resume runs): with two workers on two
# cores, a second thread per process only waits for a core the other worker holds (tests/conftest.py one_thread).
export DIFFSYNTH_SKIP_DOWNLOAD=True WANDB_MODE=offline TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
WORKERS="${QIE_TEST_WORKERS:-2}"
XDIST=()
[ "$WORKERS" = 0 ] || XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
exec "${QIE_VENV:-$ROOT/.venv}/bin/python" -m pytest tests -q "${XDIST[@]}" "$@"
