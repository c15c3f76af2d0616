#!/usr/bin/env bash
# Replay fixed rollouts (job 3): the GRPO trainer on the dumps of scripts/run-tiny-rollout-only.sh, no engines, so
# the same inputs every run and TP/PP/DP/micro-batch/loss settings compare on loss and grad-norm. Its own output
# folder (runs/tiny/replay), so a GRPO run's metrics and checkpoints are left alone. Extra arguments are appended
# (e.g. --micro-batch-size 8); DUMPS names another dump folder.
set -euo pipefail
cd "$(dirname "$0")/.."
DUMPS=${DUMPS:-runs/tiny/rollout_only}
[ -e "$DUMPS/data_0.pt" ] || { echo "error: no dumps in $DUMPS: run bash scripts/run-tiny-rollout-only.sh first" >&2; exit 2; }
# the dumps' settings (a replay with others is refused): 2 rollouts of 16 prompts x 4 samples
OUT=${OUT:-runs/tiny/replay} exec bash scripts/run-tiny-grpo.sh --load-debug-rollout-data "$DUMPS/data_{rollout_id}.pt" \
  --num-rollout 2 --rollout-batch-size 16 --n-samples-per-prompt 4 --micro-batch-size 32 "$@"
