#!/usr/bin/env bash
# GRPO on Qwen2.5-0.5B-Instruct with real SGLang engines, on one GPU node (or a Ray cluster: set RAY_ADDRESS to the
# head's dashboard, e.g. http://HEAD_IP:8265, and the job goes through `ray job submit`). Meant for the image built
# from docker/Dockerfile (SGLang + megatron-core + slime_lite installed). Extra arguments are appended to the
# `slime-lite train` line, e.g. `--sglang-disable-cuda-graph` or `--debug-env CUDA_LAUNCH_BLOCKING=1`.
#
# Paths come from the environment:
#   HF_CHECKPOINT  Qwen2.5-0.5B-Instruct folder (config.json, tokenizer, safetensors)       [required]
#   PROMPT_DATA    JSONL with {"prompt": ..., "label": ...} per line (math answers)         [required]
#   EVAL_DATA      JSONL for eval (optional)
#   SAVE_DIR       checkpoints and dumps (default: runs/qwen2.5-0.5B-grpo)
#   NUM_GPUS       GPUs on the node, shared by trainer and engines (default: 8)
set -euo pipefail
: "${HF_CHECKPOINT:?set HF_CHECKPOINT to the Qwen2.5-0.5B-Instruct folder}"
: "${PROMPT_DATA:?set PROMPT_DATA to a prompt/label JSONL file}"
SAVE_DIR=${SAVE_DIR:-runs/qwen2.5-0.5B-grpo}
NUM_GPUS=${NUM_GPUS:-8}
SLIME_LITE=${SLIME_LITE:-slime-lite}
source "$(dirname "$0")/lib.sh"

CLUSTER_ARGS=(
  --actor-num-nodes 1 --actor-num-gpus-per-node "$NUM_GPUS"
  --rollout-num-gpus "$NUM_GPUS" --rollout-num-gpus-per-engine 1
  --colocate --offload-train --offload-rollout
  --rollout-backend sglang
)
MODEL_ARGS=(--hf-checkpoint "$HF_CHECKPOINT" --ref-load "$HF_CHECKPOINT" --bf16)
CKPT_ARGS=(--save "$SAVE_DIR/ckpt" --save-interval 20)
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --micro-batch-size 4)
ROLLOUT_ARGS=(
  --prompt-data "$PROMPT_DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
  --rm-type math
  --num-rollout 200 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 1024 --rollout-temperature 1.0
  --global-batch-size 256
)
EVAL_ARGS=()
if [ -n "${EVAL_DATA:-}" ]; then
  EVAL_ARGS=(--eval-interval 10 --eval-prompt-data eval "$EVAL_DATA" --n-samples-per-eval-prompt 4
             --eval-max-response-len 1024 --eval-temperature 0)
fi
GRPO_ARGS=(
  --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.0 --kl-loss-type low_var_kl
  --entropy-coef 0.0 --eps-clip 0.2 --eps-clip-high 0.28
)
OPTIMIZER_ARGS=(--lr 1e-6 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0)
SGLANG_ARGS=(--sglang-mem-fraction-static 0.5)
DEBUG_ARGS=(--save-debug-rollout-data "$SAVE_DIR/rollouts/data_{rollout_id}.pt")
LOG_ARGS=(--metrics-path "$SAVE_DIR/metrics.jsonl" --use-tensorboard --tensorboard-dir "$SAVE_DIR/tb")

CMD=("$SLIME_LITE" train "${CLUSTER_ARGS[@]}" "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${PARALLEL_ARGS[@]}"
     "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}"
     "${DEBUG_ARGS[@]}" "${LOG_ARGS[@]}" "$@")
mkdir -p "$SAVE_DIR"
run_here "${CMD[@]}"
