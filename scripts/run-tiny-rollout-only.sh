#!/usr/bin/env bash
# Rollout-only debugging on the tiny model: engines only (Megatron is never imported), rollouts dumped to disk.
# Extra arguments are appended to the `slime-lite train` line; the dumps shown are those it wrote.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
bash scripts/prepare-tiny.sh
OUT=${OUT:-runs/tiny/rollout_only}

MODEL_ARGS=(--hf-checkpoint runs/tiny/model)
ROLLOUT_ARGS=(
  --prompt-data runs/tiny/data/addition.jsonl --input-key prompt --label-key label --rollout-shuffle
  --rm-type addition --num-rollout 2 --rollout-batch-size 16 --n-samples-per-prompt 4
  --rollout-max-response-len 8 --rollout-temperature 1.0
)
EVAL_ARGS=(--eval-interval 1 --eval-prompt-data addition runs/tiny/data/addition_eval.jsonl --eval-temperature 0)
CLUSTER_ARGS=(--rollout-num-gpus 1 --rollout-num-gpus-per-engine 1)
DEBUG_ARGS=(--debug-rollout-only --save-debug-rollout-data "$OUT/data_{rollout_id}.pt")

ARGS=("${MODEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${DEBUG_ARGS[@]}" \
      --metrics-path "$OUT/metrics.jsonl" "$@")
run_train "${ARGS[@]}"
.venv/bin/slime-lite display-rollouts --load-debug-rollout-data "$(arg_value --save-debug-rollout-data "" "${ARGS[@]}")" \
  --max-samples 4
