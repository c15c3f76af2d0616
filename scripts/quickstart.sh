#!/usr/bin/env bash
# The main job from a fresh clone: install into .venv, build the tiny warm-started model and the addition data,
# run a tiny GRPO job on CPU (Ray + embedded engine + Megatron trainer), and report the eval accuracy and a plot.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
bash scripts/prepare-tiny.sh
bash scripts/run-tiny-grpo.sh "$@"
source scripts/lib.sh
METRICS=$(arg_value --metrics-path "${OUT:-runs/tiny/grpo}/metrics.jsonl" "$@") .venv/bin/python - <<'PY'
import json, os
path = os.environ["METRICS"]
rows = [json.loads(l) for l in open(path)]
evals = [(r["rollout_id"] + 1, r["eval/addition"]) for r in rows if "eval/addition" in r]
print("held-out exact-match accuracy by rollouts trained:", ", ".join(f"{i}: {a:.3f}" for i, a in evals))
print(f"before training {evals[0][1]:.3f} -> after {evals[-1][1]:.3f}; plot: {os.path.join(os.path.dirname(path), 'reward.png')}")
PY
echo "quickstart finished in $(( $(date +%s) - start )) s"
