#!/usr/bin/env bash
# What --deterministic-mode makes bitwise-reproducible on one GPU (H200), and what it costs. In one call:
#   1. the full GRPO loop (colocated: embedded engine + Megatron trainer on one GPU, bf16) twice without the flag
#      and twice with it: do the metrics (timings excluded) and the rollout dumps repeat byte for byte?
#   2. the same replay (no engines) twice without and twice with the flag: do the grad-norms repeat?
#   3. the step time of each (perf/step_time, perf/rollout_time, perf/train_time, mean over rollouts 1..N-1).
# Needs Ray and megatron-core packed as .gpu-carry/site.tar.xz (site-packages for a machine without network).
# Results: $OUT/*.jsonl, $OUT/summary.txt.
# Usage: bash bench/gpu_determinism.sh   (OUT=/tmp/out by default; ~8 minutes: each loop run took 85-100 s on an H200)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu-carry/site.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .gpu-carry/site.tar.xz -C /tmp/site
  export PYTHONPATH=/tmp/site:$PWD
fi
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$PY - <<'PYEOF'
from slime_lite.tiny_model import make_tiny_model
from slime_lite.tasks import make_data
make_tiny_model("/tmp/q05", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                warm_start_steps=0, tie_word_embeddings=True)
make_data("addition", "/tmp/data/addition.jsonl", n_train=2048, n_eval=64)
PYEOF
COMMON=(--hf-checkpoint /tmp/q05 --prompt-data /tmp/data/addition.jsonl --rm-type addition --rollout-shuffle
        --rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 64 --use-kl-loss
        --kl-loss-coef 0.001 --lr 1e-6 --bf16 --engine-dtype bfloat16 --micro-batch-size 32 --num-steps-per-rollout 2
        --colocate --num-rollout 4)
run() {  # name, extra flags...
  local name=$1; shift
  rm -rf "$OUT/$name"; mkdir -p "$OUT/$name"
  timeout 300 $PY -m slime_lite.cli train "$@" --metrics-path "$OUT/$name/m.jsonl" \
    --ci-save-grad-norm "$OUT/$name/grad_norms.json" > "$OUT/$name/log" 2>&1
  echo "$name rc=$?"
}
run loop_a "${COMMON[@]}" --save-debug-rollout-data "$OUT/loop_a/dumps/{rollout_id}.pt"
run loop_b "${COMMON[@]}" --save-debug-rollout-data "$OUT/loop_b/dumps/{rollout_id}.pt"
run loop_det_a "${COMMON[@]}" --deterministic-mode --save-debug-rollout-data "$OUT/loop_det_a/dumps/{rollout_id}.pt"
run loop_det_b "${COMMON[@]}" --deterministic-mode --save-debug-rollout-data "$OUT/loop_det_b/dumps/{rollout_id}.pt"
REPLAY=(--hf-checkpoint /tmp/q05 --load-debug-rollout-data "$OUT/loop_det_a/dumps/{rollout_id}.pt"
        --rollout-batch-size 32 --n-samples-per-prompt 8 --use-kl-loss --kl-loss-coef 0.001 --lr 1e-6 --bf16
        --micro-batch-size 32 --num-steps-per-rollout 2 --num-rollout 4)
run replay_a "${REPLAY[@]}"
run replay_b "${REPLAY[@]}"
run replay_det_a "${REPLAY[@]}" --deterministic-mode
run replay_det_b "${REPLAY[@]}" --deterministic-mode
{
  for pair in loop loop_det replay replay_det; do
    echo "== $pair: metrics (timings excluded)"
    $PY -m slime_lite.cli compare-runs "$OUT/${pair}_a/m.jsonl" "$OUT/${pair}_b/m.jsonl" | tail -25
    cmp -s "$OUT/${pair}_a/grad_norms.json" "$OUT/${pair}_b/grad_norms.json" && echo "grad-norms: identical" \
      || echo "grad-norms: differ"
    if [ -d "$OUT/${pair}_a/dumps" ]; then
      same=0; total=0
      for f in "$OUT/${pair}_a/dumps"/*.pt; do
        total=$((total + 1)); cmp -s "$f" "$OUT/${pair}_b/dumps/$(basename "$f")" && same=$((same + 1))
      done
      echo "rollout dumps byte-identical: $same of $total"
    fi
  done
  echo "== mean seconds over rollouts 1..3 (rollout 0 warms up)"
  $PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
keys = ("perf/step_time", "perf/rollout_time", "perf/train_time")
print(f"{'run':<14}" + "".join(f"{k:>22}" for k in keys))
for name in ("loop_a", "loop_det_a", "replay_a", "replay_det_a"):
    try:
        rows = [json.loads(l) for l in open(f"{out}/{name}/m.jsonl")]
    except OSError:
        print(f"{name:<14} (no metrics)"); continue
    rows = [r for r in rows if r.get("rollout_id", -1) >= 1]
    cells = []
    for k in keys:
        vals = [r[k] for r in rows if k in r]
        cells.append(f"{sum(vals) / len(vals):22.3f}" if vals else f"{'-':>22}")
    print(f"{name:<14}" + "".join(cells))
PYEOF
} | tee "$OUT/summary.txt"
