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
# Qwen-Image-2.1: Qwen-Image-2.1-Distill.sh.
# Real use: MODEL=<preset or dir> DATASET_METADATA=... TEACHER_LORA=task.safetensors [STUDENT_STEPS=4 DATASET_BASE
# CACHE_DIR OUTPUT_DIR NUM_GPUS NNODES NODE_RANK MASTER_ADDR MASTER_PORT DS_CONFIG CACHE_ARGS]
# bash Qwen-Image-Edit-Distill.sh [qie train flags]
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch_lib.sh"
FAMILY_FLAGS=(--zero_cond_t)   # the tiny base stands in for 2511: its zero-timestep references, set explicitly
distillation Qwen-Image-Edit-2511.sh qie-2511 qie-distill 2511 tiny "$@"
