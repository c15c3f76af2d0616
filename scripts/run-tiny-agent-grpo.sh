#!/usr/bin/env bash
# The calculator task trained through a black-box agent: examples/calc_agent.py, written against the official openai
# client (chat completions with one tool), runs against the per-trajectory OpenAI-compatible endpoint of the rollout
# (slime_lite/rollout/agent_endpoint.py); samples are built from the engine's tokens that endpoint recorded.
# Same model, data and settings as run-tiny-tool-grpo.sh (which builds them); extra arguments are appended.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/tiny/agent_grpo} exec bash scripts/run-tiny-tool-grpo.sh \
  --custom-generate-function-path examples.calc_agent.generate "$@"
