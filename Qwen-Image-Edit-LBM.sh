#!/usr/bin/env bash
# Latent Bridge Matching (LBM) LoRA for Qwen-Image-Edit-2511: a 1-4-step image-to-image editor.
#   phase 1  `qie cache`: reuses the 2511 run's cache (outputs/qie-2511/cache) when it exists: re-running
#            `qie cache` on it only checks it (unchanged rows are skipped); otherwise builds $OUTPUT_DIR/cache
#   phase 2  `qie train --loss lbm`: source->target main stream + white->target sub-stream,
#            ProdigyPlusScheduleFree (lr 1.0), gradient clipping off; on several GPUs DDP, not ZeRO
#            (Prodigy's step-size estimate needs whole parameters on every rank)
#   then     `qie edit --lbm_steps 1` with the new LoRA: writes after.png (main) and after_sub.png (sub-stream)
# Start from an SFT LoRA of the same rank:  bash Qwen-Image-Edit-LBM.sh --lora_checkpoint outputs/qie-2511/lora.safetensors
# With no environment set: the CPU demo: a 1-step LBM LoRA teaches the pretrained tiny base "make the red
# circle blue" (a few minutes), then prints the held-out PSNR without and with the LoRA.
# Real use: MODEL=<preset or dir> DATASET_METADATA=... [DATASET_BASE CACHE_DIR OUTPUT_DIR NUM_GPUS
# NNODES NODE_RANK MASTER_ADDR MASTER_PORT DS_CONFIG CACHE_ARGS] bash Qwen-Image-Edit-LBM.sh [qie train flags]
# (all documented in scripts/launch_lib.sh and the README). Set CACHE_DIR to keep a cache of its own
# (a different dataset or model would otherwise update the 2511 run's cache).
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch_lib.sh"
SFT_CACHE="$ROOT/outputs/qie-2511/cache"
if [ -z "${CACHE_DIR:-}" ] && [ -f "$SFT_CACHE/manifest.json" ]; then
  CACHE_DIR="$SFT_CACHE"
  echo "LBM: reusing the phase-1 cache of Qwen-Image-Edit-2511.sh: $CACHE_DIR"
fi
DS_CONFIG="${DS_CONFIG-}"   # unset: no DeepSpeed (a single process, or DDP on several GPUs)
launch_defaults qie-lbm 2511

TRAIN_FLAGS=(--loss lbm --zero_cond_t --gradient_accumulation_steps 16 --gradient_checkpointing)
EDIT_FLAGS=(--zero_cond_t --lbm_steps 1)
# CPU demo: the same cache sizes as Qwen-Image-Edit-2511.sh, so its cache is reused.
DEMO_TRAIN=(--max_steps 400 --batch_size 4 --gradient_accumulation_steps 1 --no-gradient_checkpointing --save_every 200 --lora_rank 16)
split_training "$@"
