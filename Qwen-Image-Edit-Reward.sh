#!/usr/bin/env bash
# Reward tuning of a Qwen-Image-Edit-2511 LoRA with DiffusionNFT (docs/REWARD.md): no targets are trained on.
#   phase 1  `qie cache`: reuses the 2511 run's cache (outputs/qie-2511/cache) when it exists (only its sources,
#            prompts and masks are used; the reward may compare with its targets), else builds $OUTPUT_DIR/cache
#   phase 2  `qie train --loss nft --reward $REWARD`: per source, K edits sampled with the old policy, decoded,
#            scored by the reward, group-normalised, then DiffusionNFT's implicit-policy loss on them; DDP or
#            ZeRO-2 on several GPUs (ZeRO-3 is refused: rollouts need the whole LoRA on each rank)
#   then     `qie edit` with the new LoRA, and on the CPU demo the held-out reward and scorecard, base vs LoRA
# With no environment set: the CPU demo: on the pretrained tiny base, a reward that prefers "what is inside
# the mask turned blue" (diffsynth_qie.metrics.demo_reward:blue_inside) plus "nothing outside changed"
# (preserve) teaches it to turn the red circle bluish in about two minutes on 2 cores.
# Real use: MODEL=<preset or dir> DATASET_METADATA=... REWARD='preserve:0.5,judge:1' [REWARD_JUDGE=URL#MODEL
# DATASET_BASE CACHE_DIR OUTPUT_DIR NUM_GPUS NNODES NODE_RANK MASTER_ADDR MASTER_PORT DS_CONFIG CACHE_ARGS]
# bash Qwen-Image-Edit-Reward.sh [qie train flags] (README "Reward tuning": GPU counts, the published recipes).
source "$(dirname "${BASH_SOURCE[0]}")/scripts/launch_lib.sh"
SFT_CACHE="$ROOT/outputs/qie-2511/cache"
if [ -z "${CACHE_DIR:-}" ] && [ -z "${DATASET_METADATA:-}" ] && [ -f "$SFT_CACHE/manifest.json" ]; then
  CACHE_DIR="$SFT_CACHE"
  echo "reward tuning: reusing the phase-1 cache of Qwen-Image-Edit-2511.sh: $CACHE_DIR"
fi
if [ -z "${DS_CONFIG+x}" ] && [ "$(gpu_count)" -gt 1 ]; then DS_CONFIG="$ROOT/deepspeed_configs/zero2.yaml"; fi
launch_defaults qie-reward 2511

REWARD="${REWARD:-preserve:1,diffsynth_qie.metrics.demo_reward:blue_inside:1}"
judge=()
[ -z "${REWARD_JUDGE:-}" ] || judge=(--reward_judge "$REWARD_JUDGE")
TRAIN_FLAGS=(--loss nft --reward "$REWARD" "${judge[@]}" --zero_cond_t --gradient_checkpointing
             --nft_group_size 8 --nft_rollout_steps 8 --learning_rate 3e-4 --gradient_accumulation_steps 4)
EDIT_FLAGS=(--zero_cond_t)
EVAL_FLAGS=(--reward "$REWARD")
# CPU demo: the same cache sizes as Qwen-Image-Edit-2511.sh, so its cache is reused.
DEMO_TRAIN=(--max_steps 600 --batch_size 2 --gradient_accumulation_steps 1 --no-gradient_checkpointing
            --nft_rollout_steps 4 --save_every 300 --validate_every 0 --lora_rank 16 --learning_rate 3e-3)
split_training "$@"
