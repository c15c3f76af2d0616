#!/usr/bin/env bash
# Rollout-only debugging with real SGLang engines (no trainer: Megatron is never imported), rollouts dumped and then
# shown. With ENGINE_ADDRS=host:port[,host:port...] it starts no engine and rolls out against SGLang servers that
# are already running (zero GPUs placed by the job). With RAY_ADDRESS (the head's dashboard, http://HEAD_IP:8265)
# the job goes through `ray job submit`. Extra arguments are appended to the `slime-lite train` line; the dumps
# shown are those it wrote.
# For an illegal memory access, run the same flags through `slime-lite ima-bisect` instead of `train`:
#   IMA_BISECT=1 bash scripts/run-rollout-only-sglang.sh --core-dump /shared/cuda-dumps
#
#   HF_CHECKPOINT  model folder (tokenizer; and the engines' weights)   [required]
#   PROMPT_DATA    prompt/label JSONL                                    [required]
#   OUT            dumps and metrics (default: runs/rollout-only-sglang)
#   NUM_GPUS       rollout GPUs (default: 8); GPUS_PER_ENGINE (default: 1) = SGLang --tp-size
set -euo pipefail
: "${HF_CHECKPOINT:?set HF_CHECKPOINT to the model folder}"
: "${PROMPT_DATA:?set PROMPT_DATA to a prompt/label JSONL file}"
OUT=${OUT:-runs/rollout-only-sglang}
NUM_GPUS=${NUM_GPUS:-8}
GPUS_PER_ENGINE=${GPUS_PER_ENGINE:-1}
SLIME_LITE=${SLIME_LITE:-slime-lite}
source "$(dirname "$0")/lib.sh"

MODEL_ARGS=(--hf-checkpoint "$HF_CHECKPOINT")
ROLLOUT_ARGS=(
  --prompt-data "$PROMPT_DATA" --input-key prompt --label-key label --apply-chat-template
  --rm-type math --num-rollout 2 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 1024 --rollout-temperature 1.0
)
if [ -n "${ENGINE_ADDRS:-}" ]; then
  CLUSTER_ARGS=(--rollout-backend sglang --rollout-external-engine-addrs "$ENGINE_ADDRS")
  SGLANG_ARGS=()
else
  CLUSTER_ARGS=(--rollout-backend sglang --rollout-num-gpus "$NUM_GPUS" --rollout-num-gpus-per-engine "$GPUS_PER_ENGINE")
  SGLANG_ARGS=(--sglang-mem-fraction-static 0.8)
fi
DEBUG_ARGS=(--debug-rollout-only --save-debug-rollout-data "$OUT/data_{rollout_id}.pt")

if [ -n "${IMA_BISECT:-}" ]; then
  exec "$SLIME_LITE" ima-bisect "${MODEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${SGLANG_ARGS[@]}" \
    --out "$OUT/ima-bisect" "$@"
fi
CMD=("$SLIME_LITE" train "${MODEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${SGLANG_ARGS[@]}"
     "${DEBUG_ARGS[@]}" --metrics-path "$OUT/metrics.jsonl" "$@")
mkdir -p "$OUT"
run_here "${CMD[@]}"
"$SLIME_LITE" display-rollouts --load-debug-rollout-data "$(arg_value --save-debug-rollout-data "" "${CMD[@]}")" \
  --max-samples 4
