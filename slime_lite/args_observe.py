"""The flags that watch a run rather than shape it: the --ci-test precision checks, logging (metrics sinks, pass@k,
the custom log hooks) and profiling. Added to the ``train`` parser by args.py; defaults live here only."""

from __future__ import annotations

import argparse

from slime_lite.args_train import nonneg_float as _nonneg_float
from slime_lite.args_train import positive_int as _positive_int
from slime_lite.config import LOGPROB_DIFF_BY_DTYPE
from slime_lite.profiling import PROFILE_TARGETS


def add_observability_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CI", "precision checks of --ci-test (slime-lite doctor shows the same checks)")
    g.add_argument("--ci-test", action="store_true",
                   help="stop the run at the first failed precision check (step-1 KL, log-prob diff, grad norm)")
    g.add_argument("--ci-nll-threshold", type=_nonneg_float, default=2.0,
                   help="advisory bound on the first rollout's mean NLL per token (default: %(default)s)")
    g.add_argument("--ci-logprob-diff-threshold", type=_nonneg_float, default=None,
                   help="bound on train/train_rollout_logprob_abs_diff (default: by the precision of engine and "
                        "trainer, " + ", ".join(f"{k} {v:g}" for k, v in LOGPROB_DIFF_BY_DTYPE.items())
                        + "; the tighter one when they differ)")
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
    g.add_argument("--metrics-path", default=None, help="append every metrics record as one JSON line")
    g.add_argument("--use-tensorboard", action="store_true", help="also log metrics to TensorBoard")
    g.add_argument("--tensorboard-dir", default=None,
                   help="TensorBoard folder (default: tensorboard/ under --save, or ./tensorboard)")
    g.add_argument("--use-wandb", action="store_true", help="also log metrics to wandb (offline unless WANDB_MODE)")
    g.add_argument("--wandb-project", default="slime_lite", help="wandb project (default: %(default)s)")
    g.add_argument("--wandb-dir", default=None, help="wandb folder (default: wandb's)")
    g.add_argument("--wandb-group", default=None, help="wandb run group")
    g.add_argument("--wandb-team", default=None, help="wandb entity (team) the run belongs to")
    g.add_argument("--wandb-host", default=None, help="wandb server URL (WANDB_BASE_URL)")
    g.add_argument("--log-level", default="INFO", help="Python logging level (default: %(default)s)")
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

    g = p.add_argument_group("profiling", "traces and snapshots go to --tensorboard-dir (as in slime)")
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
