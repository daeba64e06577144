#!/usr/bin/env bash
# Idempotent environment setup: creates .venv and installs diffsynth-qie with its extras.
#
#   bash scripts/setup.sh            # PyPI pin diffsynth==2.1.12 (tested default)
#   QIE_DIFFSYNTH=submodule bash scripts/setup.sh   # editable install of ./DiffSynth-Studio instead
#
# Environment:
#   PYTHON          interpreter to build the venv with (default: python3; 3.10+; 3.11 is tested)
#   QIE_VENV        venv path (default: .venv in the repo root)
#   QIE_EXTRAS      extras to install (default: train,ui,dev)
#   QIE_DIFFSYNTH   "pypi" (default) or "submodule" (needs `git submodule update --init` first)
#   QIE_TORCH_SPEC  torch/torchvision pair (default: "torch==2.14.1 torchvision==0.29.1": the
#                   pair that imports together on CPU machines and carries CUDA 13 on GPUs; with an NVIDIA
#                   driver older than 580 the cu128/cu126 index is added automatically)
# A second run with nothing changed finishes in about a second (stamp file in the venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV="${QIE_VENV:-$ROOT/.venv}"
EXTRAS="${QIE_EXTRAS:-train,ui,dev}"
SOURCE="${QIE_DIFFSYNTH:-pypi}"
TORCH_SPEC="${QIE_TORCH_SPEC:-torch==2.14.1 torchvision==0.29.1}"
# PyPI's torch 2.14.1 is the CUDA 13.0 build, which needs an NVIDIA driver >= 580; with an older driver torch
# would see no GPU at all. Pick the wheel index that matches the driver nvidia-smi reports.
if [ -z "${QIE_TORCH_SPEC:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then
  DRIVER="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | cut -d. -f1)"
  if [ -n "$DRIVER" ] && [ "$DRIVER" -lt 580 ] 2>/dev/null; then
    if [ "$DRIVER" -ge 570 ]; then CU=cu128; elif [ "$DRIVER" -ge 560 ]; then CU=cu126; else
      echo "setup.sh: NVIDIA driver $DRIVER is too old for torch 2.14 (CUDA 12.6 needs >= 560); update the driver," \
           "or set QIE_TORCH_SPEC to a torch build for it" >&2
      exit 2
    fi
    TORCH_SPEC="$TORCH_SPEC --index-url https://download.pytorch.org/whl/$CU"
    echo "setup.sh: NVIDIA driver $DRIVER: installing torch from the $CU index (PyPI's build needs driver >= 580)."
  fi
fi

case "$SOURCE" in
  pypi|submodule) ;;
  *) echo "setup.sh: QIE_DIFFSYNTH must be 'pypi' or 'submodule', got '$SOURCE'" >&2; exit 2 ;;
esac
if [ "$SOURCE" = submodule ] && [ ! -f DiffSynth-Studio/pyproject.toml ]; then
  echo "setup.sh: QIE_DIFFSYNTH=submodule but DiffSynth-Studio/ is not checked out." >&2
  echo "          Run: git submodule update --init DiffSynth-Studio   (needs access to github.com)" >&2
  exit 2
fi

stamp_input() {
  cat pyproject.toml scripts/setup.sh
  echo "$PYTHON|$EXTRAS|$SOURCE|$TORCH_SPEC"
  [ "$SOURCE" = submodule ] && git -C DiffSynth-Studio rev-parse HEAD 2>/dev/null || true
}
STAMP="$VENV/.qie-setup-stamp"
WANT="$(stamp_input | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$VENV/bin/python" -c "import diffsynth_qie, importlib.metadata as m; m.version('diffsynth'); m.version('torch')" 2>/dev/null; then
  echo "setup.sh: $VENV is up to date (diffsynth from $SOURCE)."
  exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
# torch first, pinned: a bare "torch" from other requirements would pull an unpinned build,
# and PyPI's torchvision does not import next to the machine's local torch 2.13 wheel.
# shellcheck disable=SC2086
"${PIP[@]}" install -q $TORCH_SPEC
if [ "$SOURCE" = submodule ]; then
  "${PIP[@]}" install -q -e DiffSynth-Studio
  DS_BUILD_OPS=0 "${PIP[@]}" install -q -e ".[$EXTRAS]" --no-build-isolation 2>/dev/null \
    || DS_BUILD_OPS=0 "${PIP[@]}" install -q -e ".[$EXTRAS]"
else
  DS_BUILD_OPS=0 "${PIP[@]}" install -q -e ".[$EXTRAS]"
fi
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import diffsynth, torch, torchvision, transformers  # the pair must import together
print(f"setup.sh: torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"transformers {transformers.__version__}, diffsynth {md.version('diffsynth')} from {diffsynth.__file__}")
PY
echo "$WANT" > "$STAMP"
echo "setup.sh: installed diffsynth from $SOURCE into $VENV in $(( $(date +%s) - start )) s."
