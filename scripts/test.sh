#!/usr/bin/env bash
# Run the test suite (installs into .venv first). Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 --durations=25 "$@"
