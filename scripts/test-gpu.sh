#!/usr/bin/env bash
# The GPU test suite: every test marked `gpu` (CUDA-graph decode, the precision checks in bf16, ...), run with the
# machine's own python3 and torch on a machine with CUDA. Extra arguments go to pytest, e.g. `-k doctor`.
#   bash scripts/test-gpu.sh [--quick] [--slice K/N] [pytest args]
# --slice K/N: the K-th of N parts of the suite, the same every time, balanced by the seconds each test took in the
#   run recorded in tests/gpu_durations.json (`--record-durations FILE` writes them). The default split is
#   --slice 1/4 .. 4/4 (about 260 s of tests each by the recorded seconds), each meant to finish under 7 minutes on
#   one H200 (BENCHMARKS.md: "The GPU suite in slices").
# --quick: the engine's captured decode steps and fused kernels, the log-prob kernels, the bf16 precision checks and
#   the colocated loop of a half-billion shape under --ci-test, offload, the colocated push by CUDA IPC.
# On a GPU machine without network: Ray and megatron-core packed (site-packages) as .gpu-carry/site.tar.xz on a
# machine with network; this script unpacks it when present.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu-carry/site.tar.xz ]; then
  mkdir -p /tmp/slime-lite-site && tar -xJf .gpu-carry/site.tar.xz -C /tmp/slime-lite-site
  export PYTHONPATH=/tmp/slime-lite-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false
python=${PYTHON:-python3}  # the machine's own torch with CUDA (not .venv's CPU build)
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'test-gpu.sh: no CUDA device here')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# only the files that hold gpu tests are collected: the others may import what a GPU image lacks
mapfile -t files < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)
# --quick and a -k of the caller's are joined with "and" (pytest keeps only the last -k it is given)
args=() quick="" k=""
while [ $# -gt 0 ]; do
  case $1 in
    --quick)
      quick="test_cuda_graph_gpu or test_fused_layer or test_decode_attention_gpu or test_logprobs or half_billion"
      quick="($quick or offload_frees or test_colocated_push or (bf16 and not test_doctor))" ;;
    -k) k=${2:?test-gpu.sh: -k needs an expression}; shift ;;
    -k*) k=${1#-k} ;;
    *) args+=("$1") ;;
  esac
  shift
done
k=$quick${quick:+${k:+ and }}${k:+($k)}
[ -z "$k" ] || args+=(-k "$k")
exec "$python" -m pytest -q -p no:cacheprovider -m gpu --timeout 900 "${files[@]}" "${args[@]}"
