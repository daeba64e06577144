#!/usr/bin/env bash
# Latent Bridge Matching (LBM) LoRA for Qwen-Image-2.1: a 1-4-step image-to-image editor (non-commercial
# licence, see the README).
#   phase 1  `qie cache`: reuses the Qwen-Image-2.1.sh run's cache (outputs/qie-2.1/cache) when it exists:
#            re-running `qie cache` on it only checks it (unchanged rows are skipped); otherwise builds
#            $OUTPUT_DIR/cache
#   phase 2  `qie train --loss lbm`: source->target main stream + white->target sub-stream (the references stay
#            in 2.1's prefix at t=0), ProdigyPlusScheduleFree (lr 1.0), gradient clipping off; on several GPUs
#            DDP, not ZeRO (Prodigy's step-size estimate needs whole parameters on every rank)
#   then     `qie edit --lbm_steps 1` with the new LoRA: writes after.png (main) and after_sub.png (sub-stream)
# With no environment set: the CPU demo: a 1-step LBM LoRA teaches the pretrained tiny 2.1 base "make the red
# circle blue" (a few minutes), then prints the held-out PSNR without and with the LoRA.
# Real use: MODEL=2.1 (or a directory) DATASET_METADATA=... [DATASET_BASE CACHE_DIR OUTPUT_DIR NUM_GPUS
# NNODES NODE_RANK MASTER_ADDR MASTER_PORT DS_CONFIG CACHE_ARGS] bash Qwen-Image-2.1-LBM.sh [qie train flags]
# (all documented in scripts/launch_lib.sh and the README).
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch_lib.sh"
SFT_CACHE="$ROOT/outputs/qie-2.1/cache"
if [ -z "${CACHE_DIR:-}" ] && [ -f "$SFT_CACHE/manifest.json" ]; then
  CACHE_DIR="$SFT_CACHE"
  echo "LBM: reusing the phase-1 cache of Qwen-Image-2.1.sh: $CACHE_DIR"
fi
DS_CONFIG="${DS_CONFIG-}"   # unset: no DeepSpeed (a single process, or DDP on several GPUs)
launch_defaults qie-2.1-lbm 2.1 tiny-2.1

TRAIN_FLAGS=(--loss lbm --gradient_accumulation_steps 16 --gradient_checkpointing)
EDIT_FLAGS=(--lbm_steps 1)
# CPU demo: the same cache sizes as Qwen-Image-2.1.sh, so its cache is reused.
DEMO_TRAIN=(--max_steps 400 --batch_size 4 --gradient_accumulation_steps 1 --no-gradient_checkpointing --save_every 200 --lora_rank 16)
split_training "$@"
