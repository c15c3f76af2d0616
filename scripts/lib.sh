# Shared by the run-*.sh scripts: run `slime-lite train` here, or through `ray job submit` when RAY_ADDRESS is set
# (the address of a running cluster's dashboard, e.g. http://127.0.0.1:8265 after `ray start --head`; on a CPU-only
# cluster start it with logical GPU slots: `ray start --head --num-cpus 8 --resources '{"slot": 4}'`).
run_train() {
  if [ -n "${RAY_ADDRESS:-}" ]; then
    local cmd
    cmd="cd $(printf %q "$PWD") && .venv/bin/slime-lite train$(printf ' %q' "$@")"
    .venv/bin/ray job submit --address "$RAY_ADDRESS" -- bash -c "$cmd"
  else
    .venv/bin/slime-lite train "$@"
  fi
}
