#!/usr/bin/env bash
# REINFORCE++-baseline on the tiny addition model, CPU only: Ray driver, one embedded engine, one Megatron trainer.
# Extra arguments are appended to the `slime-lite train` line (e.g. --metrics-path m.jsonl, --num-rollout 5);
# the plot is drawn from the metrics file the train line writes, next to it (reward.png).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
bash scripts/prepare-tiny.sh
OUT=${OUT:-runs/tiny/reinforce}

MODEL_ARGS=(--hf-checkpoint runs/tiny/model)
CKPT_ARGS=(--save "$OUT/ckpt" --save-interval 50)
ROLLOUT_ARGS=(
  --prompt-data runs/tiny/data/addition.jsonl --input-key prompt --label-key label --rollout-shuffle
  --rm-type addition --num-rollout 100 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 6 --rollout-temperature 1.0
)
EVAL_ARGS=(--eval-interval 20 --eval-prompt-data addition runs/tiny/data/addition_eval.jsonl --eval-temperature 0)
RPP_ARGS=(--advantage-estimator reinforce_plus_plus_baseline --kl-coef 0.001 --kl-loss-type k3
           --eps-clip 0.2 --eps-clip-high 0.28)
OPTIMIZER_ARGS=(--lr 1e-4 --weight-decay 0.0 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0)
PERF_ARGS=(--actor-num-gpus-per-node 1 --rollout-num-gpus 1 --micro-batch-size 64 --num-steps-per-rollout 2)
LOG_ARGS=(--metrics-path "$OUT/metrics.jsonl" --ci-test)

ARGS=("${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${RPP_ARGS[@]}" \
      "${OPTIMIZER_ARGS[@]}" "${PERF_ARGS[@]}" "${LOG_ARGS[@]}" "$@")
METRICS=$(arg_value --metrics-path "" "${ARGS[@]}")
reset_metrics "$METRICS" "${ARGS[@]}"
run_train "${ARGS[@]}"
.venv/bin/slime-lite plot-metrics --metrics-path "$METRICS" --out "$(dirname "$METRICS")/reward.png" --title "tiny REINFORCE++-baseline (addition)"
