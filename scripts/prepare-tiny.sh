#!/usr/bin/env bash
# Build the tiny warm-started model and the addition task data under runs/tiny (skipped when already there).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p runs/tiny
if [ ! -f runs/tiny/data/addition.jsonl ]; then
  .venv/bin/slime-lite make-data --task addition --out runs/tiny/data/addition.jsonl
fi
if [ ! -f runs/tiny/model/model.safetensors ]; then
  .venv/bin/slime-lite make-tiny-model --out runs/tiny/model --task addition
fi
