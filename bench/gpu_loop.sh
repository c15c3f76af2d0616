#!/usr/bin/env bash
# One GPU machine (H200), in one call: a full GRPO loop on a Qwen2.5-0.5B-shaped model (24 layers, hidden 896,
# 14/2 heads; the tiny char vocabulary), colocated on one GPU (engine releases memory during training, trainer
# offloads during rollout), weight checks after every push, broadcast transport (gloo: one GPU is shared).
# Needs Ray and megatron-core packed as .gpu-carry/site.tar.xz (site-packages for a machine without network).
# Results: $OUT/*.jsonl and $OUT/log.
set -uo pipefail
mkdir -p /tmp/site && tar -xJf .gpu-carry/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 - <<'PY'
from slime_lite.tiny_model import make_tiny_model
from slime_lite.tasks import make_data
make_tiny_model("/tmp/q05", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                warm_start_steps=0, tie_word_embeddings=True)
make_data("addition", "/tmp/data/addition.jsonl", n_train=2048, n_eval=64)
PY
COMMON=(--hf-checkpoint /tmp/q05 --prompt-data /tmp/data/addition.jsonl --rm-type addition --rollout-shuffle
        --rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 64 --use-kl-loss
        --kl-loss-coef 0.001 --lr 1e-6 --bf16 --engine-dtype bfloat16 --micro-batch-size 32 --check-weight-update-equal)
timeout 200 python3 -m slime_lite.cli train "${COMMON[@]}" --num-rollout 3 --colocate --update-weight-transport distributed \
  --metrics-path "$OUT/gpu_colocate.jsonl" 2>&1 | grep -v "TrainActor pid.*\t" | tail -25
echo "colocate rc=$?"
