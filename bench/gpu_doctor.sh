#!/usr/bin/env bash
# One GPU machine (H200), in one call: `slime-lite doctor` on bf16 runs, healthy and with each injected fault, to see
# the precision checks' values on a GPU (the issue: thresholds calibrated on float32 CPU runs cry wolf in bf16).
#   healthy_q05   Qwen2.5-0.5B shape (random weights, tiny char vocabulary), colocated, bf16 trainer + engine
#   healthy       a small warm-started model (on-task rollouts), bf16 trainer + engine
#   temperature   the same, --debug-inject-fault engine-temperature
#   skip_push     the same, --debug-inject-fault skip-weight-push
#   dtype         trainer float32, engine bfloat16 (a dtype mismatch)
# Usage (device machine): bash bench/gpu_doctor.sh [CASE ...]   (all cases by default). Needs .gpu-carry.
# Results: $OUT/<case>.json (doctor.json of each) and $OUT/<case>.log.
set -uo pipefail
mkdir -p /tmp/site && tar -xJf .gpu-carry/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cases=("$@"); [ ${#cases[@]} -gt 0 ] || cases=(healthy_q05 healthy temperature skip_push dtype)
python3 - <<'PY'
import os
from slime_lite.tasks import make_data
from slime_lite.tiny_model import make_tiny_model
if not os.path.exists("/tmp/q05/config.json"):
    make_tiny_model("/tmp/q05", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                    warm_start_steps=0, tie_word_embeddings=True)
if not os.path.exists("/tmp/warm/config.json"):
    make_tiny_model("/tmp/warm", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                    warm_start_steps=800, warm_start_target=None)
make_data("addition", "/tmp/data/addition.jsonl", n_train=512, n_eval=16)
PY
COMMON=(--prompt-data /tmp/data/addition.jsonl --rm-type addition --rollout-max-response-len 8 --use-kl-loss
        --kl-loss-coef 0.01 --colocate --engine-dtype bfloat16 --run-timeout 240)
doctor() {  # case, flags...
  local name=$1; shift
  echo "=== $name: $*"
  python3 -m slime_lite.cli doctor --out "/tmp/doctor/$name" "${COMMON[@]}" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  cp "/tmp/doctor/$name/doctor.json" "$OUT/$name.json" 2>/dev/null
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(print("no doctor.json"))
for c in r["checks"]:
    print(f"  {'PASS' if c['passed'] else 'FAIL'} {c['name']:28s} {c['value']!s:24.24s} {c['threshold'][:60]}")
loc = r.get("localization")
if loc:
    print("  localization:", loc.get("summary", "")[:400])
    for d in loc.get("layers", []):
        print(f"    {d['name']:12s} abs {d['max_abs_diff']:.3e} rel {d['rel_diff']:.3e}")
PY
  tail -3 "$OUT/$name.log"
}
for c in "${cases[@]}"; do
  case $c in
    healthy_q05) doctor healthy_q05 --hf-checkpoint /tmp/q05 --bf16 --lr 1e-6 --rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 64 --micro-batch-size 32 ;;
    healthy) doctor healthy --hf-checkpoint /tmp/warm --bf16 --lr 1e-4 ;;
    temperature) doctor temperature --hf-checkpoint /tmp/warm --bf16 --lr 1e-4 --debug-inject-fault engine-temperature ;;
    skip_push) doctor skip_push --hf-checkpoint /tmp/warm --bf16 --lr 1e-3 --entropy-coef 0.01 --debug-inject-fault skip-weight-push ;;
    dtype) doctor dtype --hf-checkpoint /tmp/warm --lr 1e-4 ;;
    *) echo "unknown case $c" ;;
  esac
done
