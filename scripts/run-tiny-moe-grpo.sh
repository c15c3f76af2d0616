#!/usr/bin/env bash
# GRPO on a tiny Mixture-of-Experts addition model, CPU only: the quickstart's job (run-tiny-grpo.sh, same budget)
# on a warm-started Qwen3-MoE (4 layers, 4 experts of FFN size 96, top 2) with rollout routing replay: the trainer
# routes every token to the experts the engine chose. Extra arguments go to the `slime-lite train` line.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/prepare-tiny.sh
if [ ! -f runs/tiny/moe_model/model.safetensors ]; then
  .venv/bin/slime-lite make-tiny-model --out runs/tiny/moe_model --task addition --arch qwen3_moe
fi
export OUT=${OUT:-runs/tiny/moe_grpo}
bash scripts/run-tiny-grpo.sh --hf-checkpoint runs/tiny/moe_model --use-rollout-routing-replay "$@"
