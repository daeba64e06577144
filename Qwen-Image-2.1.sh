#!/usr/bin/env bash
# Split training of a Qwen-Image-2.1 LoRA (a second model family; non-commercial licence, see the README).
#   phase 1  `qie cache`: Qwen3-VL prompt embeddings with the references + VAE latents -> safetensors cache
#   phase 2  `qie train`: DiT-only LoRA training from the cache (references conditioned at t=0 by the model)
# With no environment set: the CPU demo: a LoRA teaches the pretrained tiny 2.1 base (DiffSynth's real 2.1
# classes at small sizes, shipped with the package) "make the red circle blue" (a few minutes), then prints
# the held-out PSNR without and with the LoRA.
# Real use: MODEL=2.1 (or 2.1-turbo, or a directory) DATASET_METADATA=... [DATASET_BASE CACHE_DIR OUTPUT_DIR
# NUM_GPUS NNODES NODE_RANK MASTER_ADDR MASTER_PORT DS_CONFIG CACHE_ARGS] bash Qwen-Image-2.1.sh [qie train flags]
# (all documented in scripts/launch_lib.sh and the README).
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch_lib.sh"
launch_defaults qie-2.1 2.1 tiny-2.1

TRAIN_FLAGS=(--gradient_accumulation_steps 16 --gradient_checkpointing)
EDIT_FLAGS=()
DEMO_TRAIN=(--max_steps 400 --batch_size 4 --gradient_accumulation_steps 1 --no-gradient_checkpointing --cfg_dropout 0 --save_every 200 --validate_every 0 --lora_rank 16 --learning_rate 1e-3)
split_training "$@"
