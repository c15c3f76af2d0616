#!/usr/bin/env bash
# One GPU machine (H200), in one call: the calculator tool task's GRPO loop (multi-turn samples: model turns that call
# the calculator, tool turns with its results at loss_mask 0) on a Qwen2.5-0.5B-shaped model (24 layers, hidden 896,
# 14/2 heads, tied embeddings; the tiny char vocabulary), colocated on one GPU in bf16, --ci-test on.
# The model is warm-started on calculator transcripts on the GPU first (a random model never calls the tool).
# Needs Ray and megatron-core packed as .gpu-carry/site.tar.xz (site-packages for a machine without network).
#   bash bench/gpu_tool_loop.sh [extra train flags]
# Results: $OUT/tool_loop.jsonl (metrics), $OUT/tool_loop.log, and a per-rollout table on stdout.
set -uo pipefail
mkdir -p /tmp/site && tar -xJf .gpu-carry/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # the warm start runs with deterministic algorithms
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 - <<'PY'
import json
from slime_lite.tiny_model import make_tiny_model
from slime_lite.tasks import make_data
r = make_tiny_model("/tmp/tool05", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                    intermediate_size=4864, tie_word_embeddings=True, task="tool_math", warm_start_steps=400,
                    warm_start_target=0.5, warm_start_lr=1e-4, device="cuda")
print("warm start:", json.dumps({k: r.get(k) for k in ("params", "steps", "kept_step", "dev_accuracy", "accuracy",
                                                         "first_loss", "final_loss", "train_seconds")}))
make_data("tool_math", "/tmp/data/tool_math.jsonl")
PY
ARGS=(--hf-checkpoint /tmp/tool05 --prompt-data /tmp/data/tool_math.jsonl --input-key prompt --label-key label
      --rollout-shuffle --apply-chat-template
      --custom-generate-function-path slime_lite.rollout.calc_task.generate
      --custom-rm-path slime_lite.rollout.calc_task.reward
      --num-rollout 6 --rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 256
      --rollout-temperature 1.0 --max-turns 5
      --eval-interval 5 --eval-prompt-data tool_math /tmp/data/tool_math_eval.jsonl --eval-temperature 0
      --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl --eps-clip 0.2
      --eps-clip-high 0.28 --lr 1e-6 --clip-grad 1.0 --bf16 --engine-dtype bfloat16 --micro-batch-size 64
      --colocate --update-weight-transport distributed --ci-test
      --metrics-path "$OUT/tool_loop.jsonl" --save-debug-rollout-data "/tmp/tool_dumps/data_{rollout_id}.pt" "$@")
timeout 420 python3 -m slime_lite.cli train "${ARGS[@]}" > "$OUT/tool_loop.log" 2>&1
rc=$?
grep -v "pid=.*\t" "$OUT/tool_loop.log" | tail -15
echo "tool loop rc=$rc"
OUT=$OUT python3 - <<'PY'
import json, os
from slime_lite.rollout.dumps import load_rollout_dump
from slime_lite.rollout.turns import inserted_and_trained
rows = [json.loads(l) for l in open(os.path.join(os.environ["OUT"], "tool_loop.jsonl"))]
keys = ("rollout/turns/mean", "rollout/turns/max", "rollout/tool_calls", "rollout/tool_errors", "rollout/masked_token_share",
        "rollout/raw_reward", "eval/tool_math", "perf/rollout_time", "perf/step_time", "rollout/response_len/mean")
print("rollout | " + " | ".join(keys))
for r in rows:
    print(r.get("rollout_id"), "|", " | ".join(f"{r[k]:.3f}" if isinstance(r.get(k), (int, float)) else "-" for k in keys))
tool, model = inserted_and_trained(load_rollout_dump("/tmp/tool_dumps/data_0.pt").samples)
print(f"rollout 0 dump: {tool} tool tokens, all at loss_mask 0; {model} model tokens at loss_mask 1")
PY
