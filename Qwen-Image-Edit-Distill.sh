#!/usr/bin/env bash
# Few-step distillation of a Qwen-Image-Edit-2511 task LoRA with DMD2 (docs/DISTILL.md): the teacher is the base
# with the task LoRA at 40 steps CFG 4; the student, a LoRA trained on top of it, edits in STUDENT_STEPS steps at
# CFG 1 on the fixed grid it declares.
#   phase 1  `qie cache`: reuses the 2511 run's cache (outputs/qie-2511/cache) when it exists
#   phase 2  `qie train --loss dmd --teacher_lora $TEACHER_LORA --student_steps N --merge_teacher`: the student,
#            a fake score (a second adapter on the same DiT) and the teacher's CFG pass; DDP or ZeRO-2 on several
#            GPUs (ZeRO-3 is refused: the two adapters are switched on whole LoRA layers)
#   then     the student (lora.safetensors, with the teacher: lora_merged.safetensors) and, on the CPU demo, the
#            held-out scorecard: base | teacher | naive (the teacher at the student's steps) | student
# With no environment set: the CPU demo: the 2511 demo's LoRA ("make the red circle blue"; trained first by
# Qwen-Image-Edit-2511.sh if missing) distilled to 1 step, and also to 4 steps, on the pretrained tiny base.
# Real use: MODEL=<preset or dir> DATASET_METADATA=... TEACHER_LORA=task.safetensors [STUDENT_STEPS=4 DATASET_BASE
# CACHE_DIR OUTPUT_DIR NUM_GPUS NNODES NODE_RANK MASTER_ADDR MASTER_PORT DS_CONFIG CACHE_ARGS]
# bash Qwen-Image-Edit-Distill.sh [qie train flags]
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch_lib.sh"
TASK_RUN="$ROOT/outputs/qie-2511"
if [ -n "${TEACHER_LORA:-}" ]; then TEACHER_LORA="$(abs_from_caller "$TEACHER_LORA")"; fi
if [ -z "${TEACHER_LORA:-}" ]; then
  if [ -n "${DATASET_METADATA:-}" ]; then
    echo "distillation: set TEACHER_LORA to the task LoRA to distil (trained with qie train)" >&2
    exit 2
  fi
  TEACHER_LORA="$TASK_RUN/lora.safetensors"
  if [ ! -f "$TEACHER_LORA" ]; then
    echo "distillation: no task LoRA at $TEACHER_LORA yet: training it first (Qwen-Image-Edit-2511.sh)"
    QIE_SKIP_SETUP=1 bash "$ROOT/Qwen-Image-Edit-2511.sh"
  fi
  if [ -z "${CACHE_DIR:-}" ] && [ -f "$TASK_RUN/cache/manifest.json" ]; then CACHE_DIR="$TASK_RUN/cache"; fi
fi
if [ -z "${DS_CONFIG+x}" ] && [ "$(gpu_count)" -gt 1 ]; then DS_CONFIG="$ROOT/deepspeed_configs/zero2.yaml"; fi
launch_defaults qie-distill 2511

STUDENT_STEPS="${STUDENT_STEPS:-1}"
TRAIN_FLAGS=(--loss dmd --teacher_lora "$TEACHER_LORA" --zero_cond_t --gradient_checkpointing --cfg_dropout 0
             --merge_teacher --dmd_fake_updates 5 --learning_rate 1e-5)
# CPU demo: the cache sizes of Qwen-Image-Edit-2511.sh (its cache is reused), the task LoRA's rank
DEMO_TRAIN=(--max_steps 60 --batch_size 4 --gradient_accumulation_steps 1 --no-gradient_checkpointing
            --dmd_fake_updates 2 --save_every 30 --validate_every 0 --lora_rank 16 --learning_rate 1e-3)
demo_cache=(); demo_train=()
if is_tiny "$MODEL"; then demo_cache=(--max_pixels 16384); demo_train=("${DEMO_TRAIN[@]}"); fi
qie_launch cache "${MODEL_ARGS[@]}" "${DATASET_ARGS[@]}" --cache_dir "$CACHE_DIR" "${demo_cache[@]}" ${CACHE_ARGS:-}
train_student() {   # train_student STEPS OUT [qie train flags]
  local steps="$1" out="$2"; shift 2
  qie_launch train "${MODEL_ARGS[@]}" --cache_dir "$CACHE_DIR" --output_dir "$out" "${TRAIN_FLAGS[@]}" \
    "${demo_train[@]}" --student_steps "$steps" "$@"
}
train_student "$STUDENT_STEPS" "$OUTPUT_DIR" "$@"
students=(--student "$OUTPUT_DIR/lora.safetensors")
if [ -n "$DEMO_DATA" ] && [ "$STUDENT_STEPS" != 4 ]; then   # CPU demo: a 4-step student too
  train_student 4 "$OUTPUT_DIR-4steps" "$@"
  students+=(--student "$OUTPUT_DIR-4steps/lora.safetensors")
fi
if [ -n "$DEMO_DATA" ] && [ "$NODE_RANK" = 0 ]; then   # CPU demo: held-out scorecard and grid
  "$PY" -m diffsynth_qie.inference.distill_eval "${MODEL_ARGS[@]}" --zero_cond_t \
    --dataset_metadata "$DEMO_DATA/heldout.json" --teacher "$TEACHER_LORA" "${students[@]}" \
    --grid "$OUTPUT_DIR/heldout_grid.png" --scorecard "$OUTPUT_DIR/scorecard.json"
  echo "held-out grid: $OUTPUT_DIR/heldout_grid.png (source | base | teacher | naive@N | student@N ... | target)"
  echo "scorecard:     $OUTPUT_DIR/scorecard.json"
fi
echo "student LoRA:  $OUTPUT_DIR/lora.safetensors (declares its schedule: qie edit picks it; stack it on $TEACHER_LORA)"
echo "one file:      $OUTPUT_DIR/lora_merged.safetensors (teacher + student: qie edit --lora it alone)"
