#!/usr/bin/env bash
# Few-step distillation of a Qwen-Image-2.1 task LoRA with DMD2 (docs/DISTILL.md): the teacher is the base with
# the task LoRA at the family's steps and CFG; the student, a LoRA trained on top of it, edits in STUDENT_STEPS
# steps at CFG 1 on the fixed grid it declares. Teacher and student reuse the prompt's prefix KV cache.
#   phase 1  `qie cache`: reuses the 2.1 run's cache (outputs/qie-2.1/cache) when it exists
#   phase 2  `qie train --loss dmd --teacher_lora $TEACHER_LORA --student_steps N --merge_teacher`
#   then     the student (lora.safetensors, with the teacher: lora_merged.safetensors) and, on the CPU demo, the
#            held-out scorecard: base | teacher | naive (the teacher at the student's steps) | student
# With no environment set: the CPU demo: the 2.1 demo's LoRA ("make the red circle blue"; trained first by
# Qwen-Image-2.1.sh if missing) distilled to 1 step, and also to 4 steps, on the pretrained tiny 2.1 base.
# Real use: MODEL=2.1 (or a directory) DATASET_METADATA=... TEACHER_LORA=task.safetensors [STUDENT_STEPS=4
# DATASET_BASE CACHE_DIR OUTPUT_DIR NUM_GPUS NNODES NODE_RANK MASTER_ADDR MASTER_PORT DS_CONFIG CACHE_ARGS]
# bash Qwen-Image-2.1-Distill.sh [qie train flags]
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch_lib.sh"
FAMILY_FLAGS=()
distillation Qwen-Image-2.1.sh qie-2.1 qie-2.1-distill 2.1 tiny-2.1 "$@"
