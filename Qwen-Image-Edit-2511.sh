#!/usr/bin/env bash
# Split training of a Qwen-Image-Edit-2511 LoRA.
#   phase 1  `qie cache`: text encoder + VAE -> safetensors cache (once per dataset)
#   phase 2  `qie train`: DiT-only LoRA training from the cache, zero_cond_t on (2511 needs it)
# The tiny model stands in for 2511 (zero_cond_t is passed explicitly below).
# With no environment set: the CPU demo: a LoRA teaches the pretrained tiny base "make the red circle blue"
# (a few minutes), then prints the held-out PSNR without and with the LoRA.
# Real use: MODEL=<preset or dir> DATASET_METADATA=... [DATASET_BASE CACHE_DIR OUTPUT_DIR NUM_GPUS
# NNODES NODE_RANK MASTER_ADDR MASTER_PORT DS_CONFIG CACHE_ARGS] bash Qwen-Image-Edit-2511.sh [qie train flags]
# (all documented in scripts/launch_lib.sh and the README).
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch_lib.sh"
launch_defaults qie-2511 2511

TRAIN_FLAGS=(--zero_cond_t --gradient_accumulation_steps 16 --gradient_checkpointing)
EDIT_FLAGS=(--zero_cond_t)
DEMO_TRAIN=(--max_steps 400 --batch_size 4 --gradient_accumulation_steps 1 --no-gradient_checkpointing --cfg_dropout 0 --save_every 200 --validate_every 0 --lora_rank 16 --learning_rate 1e-3)
split_training "$@"
