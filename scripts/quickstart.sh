#!/usr/bin/env bash
# The main job from a fresh clone: install into .venv, build the tiny warm-started model and the addition data,
# run a tiny GRPO job on CPU (Ray + embedded engine + Megatron trainer), and report the eval accuracy and a plot.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
bash scripts/prepare-tiny.sh
bash scripts/run-tiny-grpo.sh "$@"
.venv/bin/python - <<'PY'
import json
rows = [json.loads(l) for l in open("runs/tiny/grpo/metrics.jsonl")]
evals = [(r["rollout_id"] + 1, r["eval/addition"]) for r in rows if "eval/addition" in r]
print("held-out exact-match accuracy by rollouts trained:", ", ".join(f"{i}: {a:.3f}" for i, a in evals))
print(f"before training {evals[0][1]:.3f} -> after {evals[-1][1]:.3f}; plot: runs/tiny/grpo/reward.png")
PY
echo "quickstart finished in $(( $(date +%s) - start )) s"
