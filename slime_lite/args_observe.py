"""The flags that watch a run rather than shape it: the --ci-test precision checks, logging (metrics sinks, pass@k,
the custom log hooks) and profiling. Added to the ``train`` parser by args.py; defaults live here only."""

from __future__ import annotations

import argparse
import datetime
import logging
import os

from slime_lite.flag_types import nonneg_float as _nonneg_float
from slime_lite.flag_types import positive_int as _positive_int
from slime_lite.config import LOGPROB_DIFF_BY_DTYPE
from slime_lite.errors import SlimeLiteError
from slime_lite.logging_setup import LOG_LEVELS
from slime_lite.profiling import PROFILE_TARGETS

log = logging.getLogger("slime_lite.args")


def add_observability_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CI", "precision checks of --ci-test (slime-lite doctor shows the same checks)")
    g.add_argument("--ci-test", action="store_true",
                   help="stop the run at the first failed precision check (step-1 KL, log-prob diff, grad norm)")
    g.add_argument("--ci-nll-threshold", type=_nonneg_float, default=2.0,
                   help="advisory bound on the first rollout's mean NLL per token (default: %(default)s)")
    g.add_argument("--ci-logprob-diff-threshold", "--ci-train-rollout-logprob-abs-diff-threshold",
                   dest="ci_logprob_diff_threshold", type=_nonneg_float, default=None,
                   help="bound on train/train_rollout_logprob_abs_diff (slime's name is the second; default: by the "
                        "precision of engine and trainer, " + ", ".join(f"{k} {v:g}" for k, v in
                                                                       LOGPROB_DIFF_BY_DTYPE.items())
                        + "; the tighter one when they differ; slime's is 0.1)")
    g.add_argument("--ci-disable-kl-checker", action="store_true",
                   help="--ci-test: leave out the zero-KL checks of the first step (step1_kl_zero, "
                        "first_step_ppo_kl_zero); the other checks stay")
    g.add_argument("--ci-grad-norm-threshold", type=_nonneg_float, default=100.0,
                   help="bound on the first step's grad norm (default: %(default)s)")
    g.add_argument("--ci-save-grad-norm", default=None, metavar="PATH",
                   help="write every optimizer step's grad-norm as JSON to PATH (slime's placeholders {role}, "
                        "{rollout_id}, {step_id} split it into files)")
    g.add_argument("--ci-load-grad-norm", default=None, metavar="PATH",
                   help="stop at the first step whose grad-norm differs from the one --ci-save-grad-norm wrote "
                        "to PATH by more than --ci-grad-norm-rtol")
    g.add_argument("--ci-grad-norm-rtol", type=_nonneg_float, default=None,
                   help="relative tolerance of --ci-load-grad-norm (default: 1e-4 in float32, 2e-2 with --bf16)")
    g.add_argument("--logprob-diff-jump-factor", type=_nonneg_float, default=10.0,
                   help="warn when train_rollout_logprob_abs_diff grows by more than this factor between rollouts "
                        "(default: %(default)s)")

    g = p.add_argument_group("logging")
    g.add_argument("--metrics-path", default=None,
                   help="append every rollout's metrics record as one JSON line; each optimizer step's train "
                        "metrics go to a file beside it, named after it (m.jsonl: m.train_steps.jsonl), "
                        "at slime's train/step")
    g.add_argument("--use-tensorboard", action="store_true", help="also log metrics to TensorBoard")
    g.add_argument("--tensorboard-dir", default=None,
                   help="TensorBoard folder (default: tensorboard/ under --save, or ./tensorboard)")
    g.add_argument("--use-wandb", action="store_true", help="also log metrics to wandb (offline unless WANDB_MODE)")
    g.add_argument("--wandb-project", default="slime_lite", help="wandb project (default: %(default)s)")
    g.add_argument("--wandb-dir", default=None, help="wandb folder (default: wandb's)")
    g.add_argument("--wandb-group", default=None, help="wandb run group")
    g.add_argument("--wandb-team", default=None, help="wandb entity (team) the run belongs to")
    g.add_argument("--wandb-host", default=None, help="wandb server URL (WANDB_BASE_URL)")
    g.add_argument("--wandb-mode", choices=("online", "offline", "disabled"), default=None,
                   help="wandb mode, set as WANDB_MODE (default: the environment's WANDB_MODE, else offline)")
    g.add_argument("--wandb-key", default=None,
                   help="wandb API key: wandb.login with it (and --wandb-host) unless the mode is offline or "
                        "disabled")
    g.add_argument("--wandb-run-id", default=None,
                   help="wandb run id: log to (resume) the run of this id (default: a new run; slime overwrites "
                        "the value with its new run's id)")
    g.add_argument("--disable-wandb-random-suffix", dest="wandb_random_suffix", action="store_false",
                   help="name the wandb run --wandb-group exactly (default: wandb's random run name)")
    g.add_argument("--wandb-always-use-train-step", action="store_true",
                   help="wandb x-axis of the rollouts' metrics: the train step (rollout_id x "
                        "--num-steps-per-rollout, logged as train_step) instead of rollout_id (each optimizer step's "
                        "train metrics are against train/step either way)")
    g.add_argument("--tb-project-name", default=None,
                   help="TensorBoard folder tensorboard_log/PROJECT/EXPERIMENT, as slime (instead of "
                        "--tensorboard-dir)")
    g.add_argument("--tb-experiment-name", default=None,
                   help="with --tb-project-name: EXPERIMENT (default: the start time, YYYYmmdd_HHMMSS)")
    g.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                   default="INFO", help="Python logging level (default: %(default)s)")
    g.add_argument("--log-reward-category", default=None, metavar="KEY",
                   help="with dict rewards: log the share of each value of reward[KEY] over the rollout's samples "
                        "(e.g. why a reward function failed them) as error_cat/<value>, and of each eval set's as "
                        "eval/<name>/error_cat/<value>")
    g.add_argument("--log-passrate", action="store_true",
                   help="log pass@k (k = 1, 2, 4, ... up to the group size; a sample passes with reward 1) over the "
                        "prompt groups: passrate/pass@k of every rollout, eval/<name>-pass@k of every eval set")
    g.add_argument("--custom-rollout-log-function-path", default=None,
                   help="module.fn log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) "
                        "-> bool, called every rollout: True leaves the rollout's metrics out of the log, but for "
                        "those the run's checks read (rollout/weight_version, token drift, perf/rollout_time)")
    g.add_argument("--custom-eval-rollout-log-function-path", default=None,
                   help="module.fn log_eval_rollout_data(rollout_id, args, data, extra_metrics) -> bool, called every "
                        "eval with the eval function's data: True leaves the eval metrics out of the log")

    g = p.add_argument_group("profiling", "traces go to --tensorboard-dir (as in slime), memory snapshots to "
                                          "--memory-snapshot-dir")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="PyTorch profiler traces of --profile-target (default target: train)")
    g.add_argument("--profile-target", nargs="+", choices=PROFILE_TARGETS, default=None,
                   help="what to profile from --profile-step-start to --profile-step-end: train (every train "
                        "worker; slime's train_overall), rollout (every engine, SGLang's /start_profile), driver "
                        "(a timeline of the driver's phases, every rollout); Chrome trace JSON, open in Perfetto")
    g.add_argument("--profile-step-start", type=int, default=0,
                   help="first rollout id profiled (default: %(default)s)")
    g.add_argument("--profile-step-end", type=int, default=1,
                   help="profiling stops before this rollout id (default: %(default)s)")
    g.add_argument("--record-memory-history", action="store_true",
                   help="record the CUDA allocator's history in every train worker and dump a snapshot "
                        "(torch.cuda.memory._dump_snapshot; view at pytorch.org/memory_viz) after "
                        "--memory-snapshot-num-steps rollouts, and at a CUDA out-of-memory; CUDA only")
    g.add_argument("--memory-snapshot-dir", default=".",
                   help="folder of the --record-memory-history snapshots (default: %(default)s)")
    g.add_argument("--memory-snapshot-num-steps", type=_positive_int, default=1,
                   help="dump the snapshot after this many trained rollouts (default: %(default)s)")


WANDB_ONLY = ("wandb_mode", "wandb_key", "wandb_run_id", "wandb_always_use_train_step")


def check_logging_flags(args: argparse.Namespace) -> None:
    """slime's TensorBoard names become --tensorboard-dir (tensorboard_log/PROJECT/EXPERIMENT); the wandb flags
    act only with --use-wandb (said, not refused: slime takes them then too)."""
    if args.tb_experiment_name is not None and args.tb_project_name is None:
        raise SlimeLiteError(f"--tb-experiment-name {args.tb_experiment_name} names a folder under --tb-project-name "
                             "PROJECT (tensorboard_log/PROJECT/EXPERIMENT): add --tb-project-name, or drop it.")
    if args.tb_project_name is not None:
        if args.tensorboard_dir is not None:
            raise SlimeLiteError(f"--tb-project-name {args.tb_project_name} and --tensorboard-dir "
                                 f"{args.tensorboard_dir} both name the TensorBoard folder: give one of them.")
        experiment = args.tb_experiment_name or datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
        args.tensorboard_dir = os.path.join("tensorboard_log", args.tb_project_name, experiment)
        log.info("--tb-project-name: TensorBoard folder %s", args.tensorboard_dir)
    given = [f for f in WANDB_ONLY if getattr(args, f)] + ([] if args.wandb_random_suffix else
                                                         ["disable_wandb_random_suffix"])
    if given and not args.use_wandb:
        log.warning("%s: no effect without --use-wandb", ", ".join("--" + f.replace("_", "-") for f in given))
