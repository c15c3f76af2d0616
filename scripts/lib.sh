# Shared by the run-*.sh scripts: run `slime-lite train` here, or through `ray job submit` when RAY_ADDRESS is set
# (the address of a running cluster's dashboard, e.g. http://127.0.0.1:8265 after `ray start --head`; on a CPU-only
# cluster start it with logical GPU slots: `ray start --head --num-cpus 8 --resources '{"slot": 4}'`).
run_train() {
  RAY=.venv/bin/ray run_here .venv/bin/slime-lite train "$@"
}

# Run a command here, or with RAY_ADDRESS set through `ray job submit` ($RAY, default `ray`) in this same folder, so
# relative paths in its arguments name the same files either way (a job's own working directory is Ray's).
run_here() {
  if [ -n "${RAY_ADDRESS:-}" ]; then
    "${RAY:-ray}" job submit --address "$RAY_ADDRESS" -- bash -c "cd $(printf %q "$PWD") &&$(printf ' %q' "$@")"
  else
    "$@"
  fi
}

# The value the train line will get for a flag: its last occurrence in the given arguments, as --flag VALUE or
# --flag=VALUE (argparse's rule: the last one wins), else the default. Scripts read their output paths with it
# from the arguments they pass on, so `bash scripts/run-tiny-grpo.sh --metrics-path m.jsonl` plots m.jsonl.
# Usage: arg_value --metrics-path DEFAULT "${ARGS[@]}"
arg_value() {
  local flag=$1 value=$2
  shift 2
  while [ $# -gt 0 ]; do
    case $1 in
      "$flag")
        if [ $# -ge 2 ]; then value=$2; shift; fi ;;
      "$flag"=*) value=${1#*=} ;;
    esac
    shift
  done
  printf '%s\n' "$value"
}

# The --metrics-path file and its optimizer steps' file beside it before a run: removed for a fresh run, kept for a
# resumed one (--load naming a folder with a checkpoint), which appends to them, so the rollouts before the
# checkpoint keep their metrics and the plot shows them.
# Usage: reset_metrics "$METRICS" "${ARGS[@]}"
reset_metrics() {
  local metrics=$1 load steps
  shift
  load=$(arg_value --load "" "$@")
  if [ -z "$load" ] || [ ! -e "$load/latest" ]; then
    steps=$(.venv/bin/python -c 'import sys; from slime_lite.metrics import train_steps_path
print(train_steps_path(sys.argv[1]) or "")' "$metrics")
    rm -f "$metrics" "$steps"
  fi
}
