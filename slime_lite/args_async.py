"""Flag checks of the rollouts that run ahead of the trainer or past a rollout's end: --async (one rollout ahead),
--fully-async with its staleness bound, and over-sampling with --partial-rollout."""

from __future__ import annotations

import argparse
import logging

from slime_lite.errors import SlimeLiteError
from slime_lite.hooks import DEFAULT_ROLLOUT_FUNCTION

log = logging.getLogger("slime_lite.args")


def offload_rollout_flag(args: argparse.Namespace) -> str:
    """The flag that turned on --offload-rollout, for errors to name: slime's --offload sets it too."""
    return "--offload" if args.offload else "--offload-rollout"


def check_partial_rollout(args: argparse.Namespace) -> None:
    """--partial-rollout continues the samples over-sampling aborted, in generated rollouts that may differ run to
    run; --mask-offpolicy-in-partial-rollout acts on those samples only."""
    if args.mask_offpolicy_in_partial_rollout and not args.partial_rollout:
        raise SlimeLiteError("--mask-offpolicy-in-partial-rollout masks the tokens continued by --partial-rollout: "
                             "add --partial-rollout, or drop it.")
    if not args.partial_rollout:
        return
    if args.group_rm:
        raise SlimeLiteError("--group-rm scores a prompt's group at once, but --partial-rollout finishes a carried "
                             "group's samples over two rollouts: drop one of them.")
    if args.debug_train_only:
        raise SlimeLiteError("--partial-rollout continues aborted samples in the next generated rollout, but "
                             "--debug-train-only (or --load-debug-rollout-data) generates none: drop --partial-rollout "
                             "(a replayed dump already holds the continued samples).")
    if args.deterministic_mode:
        raise SlimeLiteError("--partial-rollout cannot be used with --deterministic-mode: which samples are aborted "
                             "depends on the engines' timing, so two runs would differ. Drop one of them.")
    if args.over_sampling_batch_size is None or args.over_sampling_batch_size <= args.rollout_batch_size:
        given = ("no --over-sampling-batch-size" if args.over_sampling_batch_size is None
                 else f"--over-sampling-batch-size {args.over_sampling_batch_size}")
        raise SlimeLiteError(f"--partial-rollout needs over-sampling, but {given} with --rollout-batch-size "
                             f"{args.rollout_batch_size} aborts nothing: set --over-sampling-batch-size above "
                             f"{args.rollout_batch_size} (e.g. {args.rollout_batch_size * 2}).")


def check_async_train(args: argparse.Namespace) -> None:
    """--async overlaps generation with training: it needs both, on different GPUs, and engines that stay up."""
    if not args.async_train:
        return
    refuse = None
    if args.colocate:
        refuse = ("--colocate puts the engines on the trainer's GPUs, so there is nothing to overlap: drop --async, "
                  "or drop --colocate and give the engines their own GPUs (--rollout-num-gpus)")
    elif args.debug_rollout_only:
        refuse = "--debug-rollout-only builds no trainer, so there is no training to overlap with: drop --async"
    elif args.debug_train_only or args.load_debug_rollout_data:
        refuse = ("--debug-train-only / --load-debug-rollout-data start no engine, so nothing generates while the "
                  "trainer trains: drop --async")
    elif args.offload_rollout:
        flag = offload_rollout_flag(args)
        refuse = (f"{flag} releases the engines' memory while the trainer trains, and under --async they generate "
                  f"then: drop {flag}")
    elif args.lora_rank is not None and args.rollout_backend == "sglang":
        refuse = ("--lora-rank on SGLang servers: a push unloads the adapter the requests in flight still use, and "
                  "SGLang waits for them to finish while the push holds them paused, so the push would wait out its "
                  "timeout: use --rollout-backend embedded (it merges the adapters into the weights it serves)")
    elif args.use_fault_tolerance or args.debug_inject_fault == "kill-engine":
        refuse = ("--use-fault-tolerance / --debug-inject-fault kill-engine are not supported with --async yet "
                  "(an engine restart mid-overlap is untested): drop one of them")
    if refuse:
        raise SlimeLiteError(f"--async: {refuse}.")


def check_fully_async(args: argparse.Namespace) -> None:
    """--fully-async keeps the engines generating through training and weight pushes: it needs engines and a
    trainer on their own GPUs, and the built-in rollout (its background generation loop)."""
    # the advice names every flag the run then needs, so following it gives a run that is accepted
    to_fully = "drop --async and add --fully-async" if args.async_train else "add --fully-async"
    if args.max_weight_staleness is None and args.max_weight_staleness_mode != "drop":
        need = "" if args.fully_async else f"{to_fully} and "
        raise SlimeLiteError(f"--max-weight-staleness-mode {args.max_weight_staleness_mode} has no effect without "
                             f"a bound: {need}add --max-weight-staleness K (samples more than K weight versions "
                             "behind the trainer are handled by it), or drop it.")
    if not args.fully_async:
        if args.max_weight_staleness is not None:
            raise SlimeLiteError(f"--max-weight-staleness (--max-policy-version-lag) {args.max_weight_staleness} "
                                 "bounds the lag of samples generated while the trainer trains, which only "
                                 f"--fully-async does: {to_fully}, or drop it.")
        return
    refuse = None
    if args.async_train:
        refuse = "--async is one-step-off training, and --fully-async replaces it: drop --async"
    elif args.colocate:
        refuse = ("--colocate puts the engines on the trainer's GPUs, so they cannot generate while it trains: drop "
                  "--colocate and give the engines their own GPUs (--rollout-num-gpus)")
    elif args.debug_rollout_only:
        refuse = "--debug-rollout-only builds no trainer and pushes no weights: drop --fully-async"
    elif args.debug_train_only or args.load_debug_rollout_data:
        refuse = "--debug-train-only / --load-debug-rollout-data start no engine to generate: drop --fully-async"
    elif args.deterministic_mode:
        refuse = ("which groups finish first and which weights generate each token depend on timing, so two runs "
                  "cannot match under --deterministic-mode: drop one of them")
    elif args.offload_rollout:
        flag = offload_rollout_flag(args)
        refuse = f"{flag} releases the engines' memory while they would generate: drop {flag}"
    elif args.partial_rollout or args.over_sampling_batch_size is not None:
        refuse = ("requests are never aborted (they continue across weight pushes), so --partial-rollout and "
                  "--over-sampling-batch-size have nothing to do: drop them")
    elif args.rollout_function_path != DEFAULT_ROLLOUT_FUNCTION:
        refuse = (f"--rollout-function-path {args.rollout_function_path} replaces the built-in rollout, whose "
                  "background generation loop --fully-async is: drop one of them (--custom-generate-function-path "
                  "works with --fully-async)")
    elif args.lora_rank is not None and args.rollout_backend == "sglang":
        refuse = ("--lora-rank on SGLang servers: a push unloads the adapter the requests in flight still use, and "
                  "SGLang waits for them to finish while the push holds them paused, so the push would wait out its "
                  "timeout: use --rollout-backend embedded (it merges the adapters into the weights it serves)")
    elif args.use_fault_tolerance or args.debug_inject_fault == "kill-engine":
        refuse = "--use-fault-tolerance / --debug-inject-fault kill-engine are not supported with --fully-async yet"
    elif args.rollout_sample_filter_path or args.rollout_all_samples_process_path:
        refuse = ("--rollout-sample-filter-path and --rollout-all-samples-process-path are called by the default "
                  "rollout function at the end of a rollout, and --fully-async's background loop replaces it: drop "
                  "them (a generate hook may set remove_sample)")
    if refuse:
        raise SlimeLiteError(f"--fully-async: {refuse}.")
    if args.rollout_backend == "sglang":
        log.warning("--fully-async with --rollout-backend sglang: SGLang reports one weight version per request, so "
                    "the tokens of a request in flight across a push all count as the version it ended with "
                    "(--max-weight-staleness sees them younger than they are); the embedded engine reports each "
                    "token's version")
