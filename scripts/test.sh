#!/usr/bin/env bash
# The test command: sets up the environment (idempotent), then runs the whole suite on CPU.
#   bash scripts/test.sh [extra pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
bash scripts/install_chromium.sh || echo "test.sh: Chromium unavailable; the browser test will be skipped with its reason."
export DIFFSYNTH_SKIP_DOWNLOAD=True WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
exec "${QIE_VENV:-$ROOT/.venv}/bin/python" -m pytest tests -q "$@"
