#!/usr/bin/env bash
# Create .venv and install slime_lite with what it needs (idempotent: re-runs only when pyproject.toml changed).
# Usage: bash scripts/setup.sh [dev]
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-}
stamp=.venv/.slime-lite-installed${extra:+-$extra}
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ -z "$extra" ] && [ -f "$stamp-dev" ] && [ "$(cat "$stamp-dev")" = "$want" ]; then
  exit 0  # the dev install has everything the plain one installs
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# the CPU build of torch first: an unpinned torch pulls several GB of CUDA wheels
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".${extra:+[$extra]}"
echo "$want" > "$stamp"
