# shellcheck shell=bash
# Shared by Qwen-Image-Edit-2511.sh, Qwen-Image-Edit-2509.sh, Qwen-Image-Edit-LBM.sh, Qwen-Image-2.1.sh,
# Qwen-Image-2.1-LBM.sh, Qwen-Image-Edit-Distill.sh and Qwen-Image-2.1-Distill.sh:
# environment defaults and the `accelerate launch` wrapper. All logic lives in Python
# (`qie cache`, `qie train`, `qie edit`); this file only picks defaults.
#
# Environment (all optional):
#   MODEL             tiny (default; tiny-2.1 for Qwen-Image-2.1.sh) | edit | 2509 | 2511 | 2.1 | 2.1-turbo, or a
#                     local directory holding the script's model
#                     in the repo layout (transformer/ text_encoder/ vae/ tokenizer/ processor/)
#   DATASET_BASE      base directory of the dataset's relative paths (default: the metadata file's directory)
#   DATASET_METADATA  metadata .json/.jsonl/.csv (default with MODEL=tiny: generated demo data)
#   CACHE_DIR         phase-1 cache (default: $OUTPUT_DIR/cache)
#   OUTPUT_DIR        checkpoints, LoRA, logs, validation images (default: outputs/<run name>)
#   NUM_GPUS          processes per node (default: number of visible GPUs, 1 on CPU)
#   NNODES NODE_RANK MASTER_ADDR MASTER_PORT   multi-node rendezvous (defaults: 1 0 127.0.0.1, and a free
#                     port on one node, 29500 across nodes); with several nodes CACHE_DIR and OUTPUT_DIR must be
#                     on storage every node shares (checked at start)
# Relative paths (MODEL as a directory, DATASET_*, CACHE_DIR, OUTPUT_DIR, DS_CONFIG) are taken relative to the
# directory the script is run from.
#   DS_CONFIG         accelerate config YAML, e.g. deepspeed_configs/zero2.yaml (default: deepspeed_configs/zero3.yaml
#                     with more than one GPU process in all, none (a single process, no ZeRO) on one GPU or on
#                     CPU; the LBM launcher defaults to none: DDP on several GPUs). DS_CONFIG= (empty) asks for none
#   CACHE_ARGS        extra flags for phase 1 (`qie cache`), e.g. "--max_pixels 589824"
#   QIE_SKIP_SETUP=1  don't run scripts/setup.sh first
#   QIE_VENV          the virtual environment to run (default: .venv in the repository)
#   QIE_GPU_MEMORY_GB the memory of one GPU in GiB for the ZeRO-2/ZeRO-3 choice and for qie plan's options
#                     (default: what torch reports)
#   QIE_PLAN_FLAGS=0  on a GPU, keep the launcher's own checkpointing and compile settings instead of the fastest
#                     options `qie plan` finds that fit (see plan_flags below)
#   QIE_HOME          where the pretrained tiny base is installed (default: ~/.cache/diffsynth-qie)
#   TEACHER_LORA      the Distill scripts: the task LoRA to distil (CPU demo: the family demo's, trained if missing)
#   STUDENT_STEPS     the Distill scripts: the student's sampling steps, 1-8 (default 1)
# Extra command-line arguments of the launcher go to phase 2 (`qie train`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Paths the user gives are relative to where they ran the script, not to the repository: resolve them before
# the cd. MODEL stays a preset name unless such a path exists; DS_CONFIG may also name a file under $ROOT.
CALLER_DIR="$(pwd)"
abs_from_caller() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s/%s' "$CALLER_DIR" "$1" ;; esac; }
for _var in DATASET_BASE DATASET_METADATA CACHE_DIR OUTPUT_DIR; do
  if [ -n "${!_var:-}" ]; then printf -v "$_var" '%s' "$(abs_from_caller "${!_var}")"; fi
done
if [ -n "${MODEL:-}" ] && [ -e "$(abs_from_caller "$MODEL")" ]; then MODEL="$(abs_from_caller "$MODEL")"; fi
if [ -n "${DS_CONFIG:-}" ] && [ -e "$(abs_from_caller "$DS_CONFIG")" ]; then DS_CONFIG="$(abs_from_caller "$DS_CONFIG")"; fi
cd "$ROOT"

[ "${QIE_SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
VENV="${QIE_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"

gpu_count() {
  "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0
}

# GPUs the driver lists (0 without nvidia-smi)
driver_gpu_count() {
  command -v nvidia-smi >/dev/null 2>&1 || { echo 0; return; }
  nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
}

# check_torch_sees_gpus GPUS: stop when the driver lists GPUs but this torch sees none (a CUDA build newer
# than the driver), instead of falling back to the CPU with a 20 B model.
check_torch_sees_gpus() {
  local seen="$1" listed
  listed="$(driver_gpu_count)"
  if [ "$seen" -eq 0 ] && [ "$listed" -gt 0 ]; then
    local info
    info="$("$PY" -c "import torch; print(f'torch {torch.__version__} (CUDA {torch.version.cuda})')" 2>/dev/null || echo torch)"
    echo "nvidia-smi lists $listed GPU(s) but $info sees none: the NVIDIA driver" \
         "($(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)) is too old for this torch build." >&2
    echo "Reinstall torch for your driver, e.g.: rm \"$VENV/.qie-setup-stamp\"; QIE_TORCH_SPEC='torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cu128' bash scripts/setup.sh" >&2
    echo "(scripts/setup.sh picks that index itself on a fresh install; CUDA 12.8 builds need driver >= 570.)" >&2
    exit 2
  fi
}

# free_port: a TCP port nothing listens on (single-node runs; a second launch on one host must not collide)
free_port() {
  "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

# is_tiny NAME: the tiny presets, which run the CPU demo when no dataset is given.
is_tiny() { [ "$1" = tiny ] || [ "$1" = tiny-2.1 ]; }
# The CPU demo's phase-1 sizes: one for every launcher, so the LBM, Reward and Distill demos reuse the SFT demo's cache.
DEMO_CACHE=(--max_pixels 16384)

# launch_defaults RUN_NAME PRESET [DEMO_MODEL] : fills MODEL (default DEMO_MODEL, else tiny), OUTPUT_DIR,
# CACHE_DIR, dataset, launcher settings.
launch_defaults() {
  local run_name="$1" preset="$2" demo_model="${3:-tiny}"
  MODEL="${MODEL:-$demo_model}"
  DEMO_DATA=""
  OUTPUT_DIR="${OUTPUT_DIR:-$ROOT/outputs/$run_name}"
  CACHE_DIR="${CACHE_DIR:-$OUTPUT_DIR/cache}"
  MODEL_ARGS=(--model "$MODEL")
  if [ -d "$MODEL" ]; then MODEL_ARGS=(--model "$preset" --model_dir "$MODEL"); fi
  if [ -z "${DATASET_METADATA:-}" ]; then
    if ! is_tiny "$MODEL"; then
      echo "$run_name: set DATASET_METADATA (and DATASET_BASE) to train $MODEL; see README 'Your own data'." >&2
      exit 2
    fi
    # CPU demo: a tiny model learns one edit, "make the red circle blue", on its pretrained tiny base (installed
    # once in $QIE_HOME from the weights shipped with the package): Qwen-Image-Edit's, or Qwen-Image-2.1's.
    DEMO_DATA="$ROOT/outputs/demo-red-circle-blue"
    DATASET_METADATA="$DEMO_DATA/metadata.json"
    [ -f "$DATASET_METADATA" ] || "$PY" -m diffsynth_qie.cli make-demo-data --task red_circle_blue --out "$DEMO_DATA"
    local base_name=Qwen-Image-Edit-tiny-pretrained
    [ "$MODEL" != tiny-2.1 ] || base_name=Qwen-Image-2.1-tiny-pretrained
    local base="${QIE_HOME:-$HOME/.cache/diffsynth-qie}/models/$base_name"
    "$PY" -m diffsynth_qie.cli --log_level WARNING make-tiny --model "$MODEL" --pretrained --out "$base"
    MODEL_ARGS=(--model "$MODEL" --model_dir "$base")
  fi
  DATASET_ARGS=(--dataset_metadata "$DATASET_METADATA")
  [ -z "${DATASET_BASE:-}" ] || DATASET_ARGS+=(--dataset_base "$DATASET_BASE")

  NNODES="${NNODES:-1}"; NODE_RANK="${NODE_RANK:-0}"
  MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
  if [ -z "${MASTER_PORT:-}" ]; then
    if [ "$NNODES" = 1 ]; then MASTER_PORT="$(free_port)"; else MASTER_PORT=29500; fi
  fi
  local gpus; gpus="$(gpu_count)"
  check_torch_sees_gpus "$gpus"
  NUM_GPUS="${NUM_GPUS:-$(( gpus > 0 ? gpus : 1 ))}"
  GPU_COUNT="$gpus"
  if [ -z "${DS_CONFIG+x}" ]; then   # ZeRO only where it shards something: several GPU processes
    if [ "$gpus" -gt 0 ] && [ $(( NUM_GPUS * NNODES )) -gt 1 ]; then
      DS_CONFIG="$ROOT/deepspeed_configs/$(choose_zero "$preset" $(( NUM_GPUS * NNODES )))"
    else
      DS_CONFIG=""
    fi
  fi
}

# choose_zero PRESET PROCESSES: zero2.yaml when `qie plan` says the unsharded run fits this GPU (only the LoRA's
# optimizer state is sharded, no weight all-gathers), zero3.yaml below that; the reason goes to stderr.
choose_zero() {
  local memory="${QIE_GPU_MEMORY_GB:-}"   # override: the memory of one GPU in GiB
  [ -n "$memory" ] || memory="$("$PY" -c "import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30)")"
  "$PY" -m diffsynth_qie.cli --log_level WARNING plan --model "$1" --num_gpus "$2" --gpu_memory_gb "$memory" \
    --distribution | tail -n 1   # the last line: libraries may print to stdout before it
}

# qie_launch SUBCOMMAND ARGS... : run a `qie` subcommand on every process of every node.
qie_launch() {
  if [ -z "$DS_CONFIG" ] && [ "$NNODES" = 1 ] && [ "$NUM_GPUS" = 1 ]; then
    "$PY" -m diffsynth_qie.cli "$@"   # single process (CPU demo): no launcher needed
    return
  fi
  local cfg=()
  if [ -n "$DS_CONFIG" ]; then
    cfg=(--config_file "$DS_CONFIG")
  elif [ "${GPU_COUNT:-0}" -gt 0 ]; then
    cfg=(--multi_gpu --mixed_precision bf16)   # DDP: every GPU holds the whole (bf16) DiT
  fi
  accelerate launch "${cfg[@]}" \
    --num_machines "$NNODES" --machine_rank "$NODE_RANK" \
    --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
    --num_processes "$(( NUM_GPUS * NNODES ))" \
    -m diffsynth_qie.cli "$@"
}

# after_training OUTPUT_DIR [qie edit flags]: print the LoRA path and try it on the first dataset row,
# (the launcher's EVAL_FLAGS array, if set, goes to the CPU demo's `qie eval-edits` alone, e.g. --reward),
# writing OUTPUT_DIR/before_after.png (reference | without LoRA | with LoRA), and the training report.
after_training() {
  local out="$1"; shift
  local lora="$out/lora.safetensors"
  if [ ! -f "$lora" ]; then echo "no LoRA at $lora" >&2; exit 1; fi
  local rows="$DATASET_METADATA"
  [ -z "$DEMO_DATA" ] || rows="$DEMO_DATA/heldout.json"   # CPU demo: a pair the LoRA never saw
  if [ "$NODE_RANK" = 0 ]; then
    "$PY" -m diffsynth_qie.cli edit "${MODEL_ARGS[@]}" --dataset_metadata "$rows" --row 0 \
      --lora "$lora" --out "$out/after.png" --before_after "$out/before_after.png" "$@"
  fi
  if [ -n "$DEMO_DATA" ] && [ "$NODE_RANK" = 0 ]; then   # CPU demo: held-out PSNR, base vs LoRA
    "$PY" -m diffsynth_qie.cli eval-edits "${MODEL_ARGS[@]}" --dataset_metadata "$DEMO_DATA/heldout.json" \
      --lora "$lora" --grid "$out/heldout_grid.png" --scorecard "$out/scorecard.json" "$@" ${EVAL_FLAGS[@]+"${EVAL_FLAGS[@]}"}
  fi
  local report="not written (see the error above)"   # a failed report does not fail the finished run
  if [ "$NODE_RANK" = 0 ] && "$PY" -m diffsynth_qie.cli report "$out"; then report="$out/report.html"; fi
  echo
  echo "LoRA:          $lora"
  echo "checkpoints:   $out/checkpoint-*/"
  echo "loss log:      $out/loss.jsonl"
  echo "before/after:  $out/before_after.png"
  [ -z "$DEMO_DATA" ] || echo "held-out grid: $out/heldout_grid.png (source | base | LoRA [| sub-stream] | target)"
  if [ -n "$DEMO_DATA" ] && [ -f "$out/scorecard.json" ]; then
    echo "scorecard:     $out/scorecard.json (also in the report)"   # base vs LoRA, with the win rate
    "$PY" -c "import sys; from diffsynth_qie.inference.scorecard_table import summary_text; \
sys.stdout.write(summary_text(sys.argv[1]))" "$out/scorecard.json"
  fi
  echo "try it:        python app_gradio.py ${MODEL_ARGS[*]} --lora_dir $out --examples $rows"
  local exported=""   # qie train --export: lora_<format>.safetensors (vllm-omni: a PEFT folder) beside the LoRA
  for f in "$out"/lora_*; do
    case "$(basename "$f")" in lora_ema.safetensors) ;; *) [ -e "$f" ] && exported="$exported $f" ;; esac
  done
  [ -z "$exported" ] || echo "exports:      $exported  (qie inspect-lora FILE: where each loads)"
  [ "$NODE_RANK" != 0 ] || echo "report:        $report"
}

# plan_flags N TRAIN_FLAG_1..N [qie train args...]: sets PLAN_FLAGS to the fastest options `qie plan` finds that fit
# 90 % of this GPU's memory (its time model on the fake device: about a minute on the CPU, several for --loss dmd),
# as `qie train` flags: --gradient_checkpointing, --checkpoint_policy, --checkpoint_blocks, --compile,
# --blocks_to_swap, and --fp8_base only where no set on the bf16 base fits. Only on a GPU without ZeRO (DDP counts
# as one GPU) and when the user's arguments set none of those (PLAN_CHOSEN); the launcher's flags and the user's
# --loss, --lora_rank, --batch_size and --optimizer shape the plan. None (the launcher's own settings) on the CPU,
# with QIE_PLAN_FLAGS=0, or when qie plan finds nothing.
PLAN_CHOSEN=" --gradient_checkpointing --no-gradient_checkpointing --checkpoint_policy --checkpoint_blocks --compile \
--no-compile --fp8_base --no-fp8_base --fp8_compute --no-fp8_compute --blocks_to_swap "
plan_flags() {
  local n="$1"; shift
  local launcher=("${@:1:$n}") user=("${@:$((n + 1))}")
  PLAN_FLAGS=()
  if [ "${GPU_COUNT:-0}" = 0 ] || is_tiny "$MODEL" || [ -n "$DS_CONFIG" ] || [ "${QIE_PLAN_FLAGS:-1}" = 0 ]; then
    return 0
  fi
  local arg prev="" shape=()
  for arg in ${user[@]+"${user[@]}"}; do
    case "$PLAN_CHOSEN" in *" ${arg%%=*} "*)
      echo "launcher: $arg given: qie plan's choice of options is not used"; return 0 ;; esac
  done
  for arg in ${launcher[@]+"${launcher[@]}"} ${user[@]+"${user[@]}"}; do
    case "$prev" in --loss|--lora_rank|--batch_size|--optimizer) shape+=("$prev" "$arg") ;; esac
    prev="$arg"
  done
  local memory budget name line gpu   # (one python for the three: QIE_GPU_MEMORY_GB, else torch's, and the name)
  read -r memory budget name <<< "$("$PY" -c "import os, torch
m = float(os.environ.get('QIE_GPU_MEMORY_GB') or torch.cuda.get_device_properties(0).total_memory / 2**30)
print(round(m, 1), round(0.9 * m, 1), torch.cuda.get_device_name(0))")"
  if [ -z "$name" ]; then
    echo "launcher: could not read the GPU's memory and name; the launcher's own settings are kept" >&2
    return 0
  fi
  echo "launcher: asking qie plan for the fastest options that fit 90 % of $name's $memory GiB (its time model on" \
       "the CPU: about a minute, several with --loss dmd; QIE_PLAN_FLAGS=0 skips it)"
  for gpu in "$name" "$memory"; do   # (a GPU without a time table: the table of the nearest memory)
    if line="$("$PY" -m diffsynth_qie.cli --log_level WARNING plan "${MODEL_ARGS[@]}" ${shape[@]+"${shape[@]}"} \
                 --gpu "$gpu" --gpu_memory_gb "$budget" --launch_flags | tail -n 1)" && [ -n "$line" ]; then
      read -r -a PLAN_FLAGS <<< "$line"
      echo "launcher: qie plan's choice: ${PLAN_FLAGS[*]} (QIE_PLAN_FLAGS=0 keeps the launcher's own settings)"
      return 0
    fi
  done
  echo "launcher: qie plan chose nothing; the launcher's own settings are kept" >&2
}

# split_training [qie train args...]: phase 1 (`qie cache`), phase 2 (`qie train`), then after_training.
# The launcher sets TRAIN_FLAGS (its fixed `qie train` flags), EDIT_FLAGS (its `qie edit` flags) and
# DEMO_TRAIN (the tiny CPU demo's `qie train` sizes); arguments go to `qie train` last, so they win.
split_training() {
  local demo_cache=() demo_train=() demo_edit=()
  if is_tiny "$MODEL"; then   # CPU demo sizes
    demo_cache=("${DEMO_CACHE[@]}"); demo_train=("${DEMO_TRAIN[@]}"); demo_edit=(--steps 8 --cfg 1)
  fi
  qie_launch cache "${MODEL_ARGS[@]}" "${DATASET_ARGS[@]}" --cache_dir "$CACHE_DIR" \
    "${demo_cache[@]}" ${CACHE_ARGS:-}
  plan_flags "${#TRAIN_FLAGS[@]}" "${TRAIN_FLAGS[@]}" "$@"
  qie_launch train "${MODEL_ARGS[@]}" --cache_dir "$CACHE_DIR" --output_dir "$OUTPUT_DIR" \
    "${TRAIN_FLAGS[@]}" "${demo_train[@]}" ${PLAN_FLAGS[@]+"${PLAN_FLAGS[@]}"} "$@"
  after_training "$OUTPUT_DIR" "${EDIT_FLAGS[@]}" "${demo_edit[@]}"
}

# distillation TASK_SCRIPT TASK_RUN RUN_NAME PRESET DEMO_MODEL [qie train args...]: the body of the Distill
# launchers (docs/DISTILL.md). The teacher is TEACHER_LORA, or on the CPU demo the LoRA TASK_SCRIPT writes to
# outputs/TASK_RUN (trained first if missing; its cache is reused). The launcher sets FAMILY_FLAGS (flags of
# `qie train` and of the scorecard that belong to the family, e.g. --zero_cond_t). Phase 1 `qie cache`; phase 2
# `qie train --loss dmd` to STUDENT_STEPS steps (the CPU demo also to 4 steps); then, on the CPU demo, the
# held-out scorecard base | teacher | naive@N | naive@N/own | student@N.
distillation() {
  local task_script="$1" task_run="$ROOT/outputs/$2" run_name="$3" preset="$4" demo_model="$5"; shift 5
  if [ -n "${TEACHER_LORA:-}" ]; then TEACHER_LORA="$(abs_from_caller "$TEACHER_LORA")"; fi
  if [ -z "${TEACHER_LORA:-}" ]; then
    if [ -n "${DATASET_METADATA:-}" ]; then
      echo "distillation: set TEACHER_LORA to the task LoRA to distil (trained with qie train)" >&2
      exit 2
    fi
    TEACHER_LORA="$task_run/lora.safetensors"
    if [ ! -f "$TEACHER_LORA" ]; then
      echo "distillation: no task LoRA at $TEACHER_LORA yet: training it first ($task_script)"
      QIE_SKIP_SETUP=1 bash "$ROOT/$task_script"
    fi
    if [ -z "${CACHE_DIR:-}" ] && [ -f "$task_run/cache/manifest.json" ]; then CACHE_DIR="$task_run/cache"; fi
  fi
  if [ -z "${DS_CONFIG+x}" ] && [ "$(gpu_count)" -gt 1 ]; then DS_CONFIG="$ROOT/deepspeed_configs/zero2.yaml"; fi
  launch_defaults "$run_name" "$preset" "$demo_model"

  local steps="${STUDENT_STEPS:-1}"
  local train_flags=(--loss dmd --teacher_lora "$TEACHER_LORA" --gradient_checkpointing --cfg_dropout 0
                     --merge_teacher --dmd_fake_updates 5 --learning_rate 1e-5 ${FAMILY_FLAGS[@]+"${FAMILY_FLAGS[@]}"})
  # CPU demo: the task launcher's cache sizes (its cache is reused), the task LoRA's rank
  local demo_cache=() demo_train=()
  if is_tiny "$MODEL"; then
    demo_cache=("${DEMO_CACHE[@]}")
    demo_train=(--max_steps 60 --batch_size 4 --gradient_accumulation_steps 1 --no-gradient_checkpointing
                --dmd_fake_updates 2 --save_every 30 --validate_every 0 --lora_rank 16 --learning_rate 1e-3)
  fi
  qie_launch cache "${MODEL_ARGS[@]}" "${DATASET_ARGS[@]}" --cache_dir "$CACHE_DIR" "${demo_cache[@]}" ${CACHE_ARGS:-}
  plan_flags "${#train_flags[@]}" "${train_flags[@]}" "$@"
  train_flags+=(${PLAN_FLAGS[@]+"${PLAN_FLAGS[@]}"})
  local runs=("$steps") students=() n out
  if [ -n "$DEMO_DATA" ] && [ "$steps" != 4 ]; then runs+=(4); fi   # CPU demo: a 4-step student too
  for n in "${runs[@]}"; do
    out="$OUTPUT_DIR"; [ "$n" = "$steps" ] || out="$OUTPUT_DIR-${n}steps"
    qie_launch train "${MODEL_ARGS[@]}" --cache_dir "$CACHE_DIR" --output_dir "$out" "${train_flags[@]}" \
      "${demo_train[@]}" --student_steps "$n" "$@"
    students+=(--student "$out/lora.safetensors")
  done
  if [ -n "$DEMO_DATA" ] && [ "$NODE_RANK" = 0 ]; then   # CPU demo: held-out scorecard and grid
    "$PY" -m diffsynth_qie.inference.distill_eval "${MODEL_ARGS[@]}" ${FAMILY_FLAGS[@]+"${FAMILY_FLAGS[@]}"} \
      --dataset_metadata "$DEMO_DATA/heldout.json" --teacher "$TEACHER_LORA" "${students[@]}" \
      --grid "$OUTPUT_DIR/heldout_grid.png" --scorecard "$OUTPUT_DIR/scorecard.json"
    echo "held-out grid: $OUTPUT_DIR/heldout_grid.png (references | base | teacher | naive@N | naive@N/own | student@N ... | target)"
    echo "scorecard:     $OUTPUT_DIR/scorecard.json"
  fi
  echo "student LoRA:  $OUTPUT_DIR/lora.safetensors (declares its schedule: qie edit picks it; stack it on $TEACHER_LORA)"
  echo "one file:      $OUTPUT_DIR/lora_merged.safetensors (teacher + student: qie edit --lora it alone)"
}
