#!/usr/bin/env bash
# Run the test suite (installs into .venv first). Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
# Two worker processes (pytest-xdist), each taking whole test files: much of a test's time is waiting on Ray, child
# processes and sockets, so two run in about 0.7 of one's time on a 2-core machine. `-n 0` runs in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout 900 --durations=25 -n 2 --dist loadfile "$@"
