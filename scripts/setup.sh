#!/usr/bin/env bash
# Create .venv and install slime_lite with what it needs (idempotent: re-runs only when pyproject.toml changed, or
# for dev, when .venv lacks the SGLang version the launcher pins).
# Usage: bash scripts/setup.sh [dev]
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-}
# dev: the browser test of `slime-lite explain --html` renders the page with Debian's Chromium; installed quietly,
# only as root with apt-get and only when missing (else that test skips and says how to install it)
if [ "$extra" = dev ] && ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-liberation; }
  { apt_install || { apt-get update -qq && apt_install; }; } >/dev/null 2>&1 \
    || echo "setup.sh: could not install chromium (apt-get install chromium); the HTML page test will be skipped" >&2
fi
stamp=.venv/.slime-lite-installed${extra:+-$extra}
want=$(sha256sum pyproject.toml | cut -c1-16)
sglang_version= sglang_have=
if [ "$extra" = dev ]; then
  # the SGLang release the launcher targets (pinned once, in the launcher); the dev install puts it in .venv as the
  # tests' oracle (tests/sglang_oracle.py), without its GPU dependencies
  sglang_version=$(sed -n 's/^SGLANG_VERSION = "\(.*\)"$/\1/p' slime_lite/backends/sglang/launcher.py)
  sglang_have=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ "$sglang_have" = "$sglang_version" ]; then
  exit 0
fi
if [ -z "$extra" ] && [ -f "$stamp-dev" ] && [ "$(cat "$stamp-dev")" = "$want" ]; then
  exit 0  # the dev install has everything the plain one installs
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# the CPU build of torch first: an unpinned torch pulls several GB of CUDA wheels
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q --no-warn-conflicts -e ".${extra:+[$extra]}"
if [ "$extra" = dev ]; then
  # SGLang's own code, without its GPU stack (torch pins, CUDA kernels): the small packages its modules import are
  # in the dev extra; the GPU/notebook modules it imports are faked by the tests' harness only
  .venv/bin/python -m pip install -q --no-deps "sglang==$sglang_version"
  # Triton for its interpreter: the CPU tests run the project's Triton kernels with TRITON_INTERPRET=1 in child
  # processes (tests/triton_interpreter.py). Kept out of site-packages, in its own folder on those processes' path
  # only: the tests' own process stays a machine without Triton (the SGLang oracle fakes it).
  .venv/bin/python -m pip install -q --no-deps --upgrade --target .venv/triton-interpreter "triton==3.9.0"
fi
echo "$want" > "$stamp"
