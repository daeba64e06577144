#!/usr/bin/env bash
# The whole GPU benchmark batch in one command: install what a bare GPU machine lacks, then run every
# measurement of benchmarks/README.md, each stage under its own time limit, writing one JSON + Markdown table.
#
#   bash benchmarks/gpu_all.sh            # on an H100/H200: full-size random weights, ≈13 minutes
#   bash benchmarks/gpu_all.sh --tiny     # the same stages on the CPU with the tiny models (a smoke test)
#   bash benchmarks/gpu_all.sh --ladder   # the speed ladder (docs/SPEED.md), ≈8 minutes: the time model's
#              prediction of every rung, then 2511 and 2.1 measured at baseline (autocast, as on 2026-11-26,
#              with DiffSynth's stock step), 1 (pure bf16), 1+2 (--compile_blocks --checkpoint_policy
#              selective), 1+2+3 and +4 (each skipped, saying so, while its flag does not exist)
#
# Environment:
#   RUN_DIR    where results/ (<gpu>-<date>.json/.md) and log.txt go (default: benchmarks/results/run-<time>)
#   WHEELS     a folder of wheels to install first with --no-deps into /tmp/site (default: .whl if present;
#              for a machine with torch but no registry access: diffsynth, modelscope, transformers, ...)
#   STAGES     which stages to run, in order (default: "calibrate train infer train21 infer21 preflight predict":
#              calibrate measures this GPU's time-model table first, predict prints the time model's prediction
#              beside every measured row, with the shipped table and with the one just measured)
#   LIMIT_SCALE  an integer that multiplies every stage's time limit (default 1; the limits are about 1.5x what each stage
#              took on an H200, where the whole batch ran in about 13 minutes)
# Each stage's failure is logged and the next stage still runs; rows are written as they are measured, so a
# stage stopped at its limit keeps what it finished.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TINY=""
LADDER=""
for arg in "$@"; do
  case "$arg" in
    --tiny) TINY="--tiny" ;;
    --ladder) LADDER=1 ;;
    *) echo "unknown argument $arg (use --tiny, --ladder)"; exit 2 ;;
  esac
done
RUN_DIR="${RUN_DIR:-benchmarks/results/run-$(date +%Y%m%d-%H%M%S)}"
RESULTS="$RUN_DIR/results"
LOG="$RUN_DIR/log.txt"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && [ -n "$TINY" ] && PY=.venv/bin/python
WHEELS="${WHEELS:-.whl}"
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1 && [ -z "$TINY" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl 2>&1 | tail -3
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$ROOT:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 DIFFSYNTH_SKIP_DOWNLOAD=True
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,power.draw --format=csv 2>/dev/null || true
  "$PY" -c "import torch, transformers, diffsynth, peft, accelerate; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, '| transformers', transformers.__version__, '| peft', peft.__version__, '| accelerate', \
accelerate.__version__)"
} 2>&1 | tee -a "$LOG"

stage() {  # stage NAME LIMIT_S COMMAND...
  local name="$1" limit; limit=$(( $2 * ${LIMIT_SCALE:-1} )); shift 2
  echo "== stage $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== stage $name: rc=$rc after $((SECONDS - t0))s" | tee -a "$LOG"
}

if [ -n "$TINY" ]; then S1="--steps 1 --warmup 0"; MODEL=tiny; SWAP="--blocks_to_swap 1"
else S1="--steps 4 --warmup 1"; MODEL=2511; SWAP="--blocks_to_swap 16 30"; fi
TABLE="$RESULTS/gpu-table.json"
has_flag() {  # has_flag MODULE FLAG: whether benchmarks.MODULE takes --FLAG (a rung whose flag is absent is skipped)
  "$PY" -m "benchmarks.$1" --help 2>/dev/null | grep -q -- "--$2"
}
rung() {  # rung NAME MODULE FLAG [ARGS...]: a ladder row, or a line saying why it is skipped
  local name="$1" module="$2" flag="$3"; shift 3
  if [ -n "$flag" ] && ! has_flag "$module" "$flag"; then
    echo "== ladder $name ($module): skipped, benchmarks.$module has no --$flag yet" | tee -a "$LOG"; return
  fi
  stage "ladder-$name" "$@"
}
if [ -n "$LADDER" ]; then
  R1="$TINY $S1 --lora_ranks 32 --checkpointing on --out_dir $RESULTS"
  STAGES="${STAGES:-ladder}"
fi
for s in ${STAGES:-calibrate train infer train21 infer21 preflight predict}; do
  case "$s" in
    calibrate) stage calibrate 300 "$PY" -m benchmarks.calibrate_gpu ${TINY:+--cpu} --out "$TABLE" ;;
    predict) stage predict 60 "$PY" -m benchmarks.timemodel_fit --compare "$RESULTS" --table "$TABLE"
             cat "$RESULTS/timemodel-compare.md" 2>/dev/null ;;
    train) stage train 420 "$PY" -m benchmarks.train_step $TINY $S1 --lora_ranks 32 --checkpointing on off \
             $SWAP --sdpa_rows cudnn flash --fp8_row --numerics --out_dir "$RESULTS" ;;
    infer) stage infer 200 "$PY" -m benchmarks.inference $TINY --repeats 1 --parity_steps 4 \
             --lightning_steps 4 8 --out_dir "$RESULTS" ;;
    train21) stage train21 150 "$PY" -m benchmarks.train21 $TINY $S1 --refs 1 3 --out_dir "$RESULTS" ;;
    infer21) stage infer21 120 "$PY" -m benchmarks.inference21 $TINY --refs 1 3 --out_dir "$RESULTS" ;;
    preflight)  # the fake-device verify of the defaults, on a machine with the real GPU beside it
      stage preflight-train 120 "$PY" -m diffsynth_qie plan --model $MODEL --verify
      stage preflight-edit 90 "$PY" -m diffsynth_qie plan --model $MODEL --task edit --verify ;;
    ladder)  # each rung's prediction first (seconds of CPU per rung), then the measured rows
      stage ladder-predict 240 "$PY" -m benchmarks.ladder_predict ${TINY:+--rungs 1} --gpus h200 h100
      rung 2511-baseline train_step "" 90 "$PY" -m benchmarks.train_step $R1 --cases ours stock --compute_precision autocast
      rung 2511-1 train_step "" 60 "$PY" -m benchmarks.train_step $R1 --cases ours
      rung 2511-1+2 train_step checkpoint_policy 150 "$PY" -m benchmarks.train_step $R1 --cases ours --compile_blocks \
        --checkpoint_policy selective --tag ladder
      rung 2511-1+2+3 train_step checkpoint_blocks 150 "$PY" -m benchmarks.train_step $R1 --cases ours --compile_blocks \
        --checkpoint_policy selective --checkpoint_blocks auto --tag ladder
      rung 2511-+4 train_step fp8_compute 150 "$PY" -m benchmarks.train_step $R1 --cases ours --compile_blocks \
        --checkpoint_policy selective --fp8_compute --tag ladder
      rung 2.1-baseline train21 "" 60 "$PY" -m benchmarks.train21 $TINY $S1 --refs 1 --batch 0 --compute_precision autocast \
        --out_dir "$RESULTS"
      rung 2.1-1 train21 "" 45 "$PY" -m benchmarks.train21 $TINY $S1 --refs 1 --batch 0 --out_dir "$RESULTS"
      rung 2.1-1+2 train21 checkpoint_policy 120 "$PY" -m benchmarks.train21 $TINY $S1 --refs 1 --batch 0 --compile_blocks \
        --checkpoint_policy selective --out_dir "$RESULTS"
      echo "== ladder: qie train under ZeRO-2 / ZeRO-3 at world size 1: not run (the launcher loads the real weights" \
        "and a cache, which this machine does not have)" | tee -a "$LOG" ;;
    *) echo "unknown stage $s (choose from calibrate train infer train21 infer21 preflight predict)" | tee -a "$LOG" ;;
  esac
done
tail -n 60 "$RESULTS"/*.md 2>/dev/null
