# Shared by the run-*.sh scripts: run `slime-lite train` here, or through `ray job submit` when RAY_ADDRESS is set.
run_train() {
  if [ -n "${RAY_ADDRESS:-}" ]; then
    .venv/bin/ray job submit --address "$RAY_ADDRESS" --working-dir . -- "$PWD/.venv/bin/slime-lite" train "$@"
  else
    .venv/bin/slime-lite train "$@"
  fi
}
