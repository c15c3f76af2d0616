"""Command-line flags of ``slime-lite train`` (slime's names), ``validate_args`` and ``parser_defaults``; nothing
else parses ``train`` flags.

Every rule is checked here, before Ray or any heavy import starts, and a broken rule is a SlimeLiteError that
names the flags and the fix. A flag's default lives only in the parser: code that needs a group of flags takes
the frozen config built from the parsed namespace (``LossConfig.from_args(args)``, ...; slime_lite/config.py),
never ``getattr(args, name, default)``. ``parser_defaults()`` gives the namespace of a run with no flags (for tests
and tools that build one without a command line).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from slime_lite.config import LOGPROB_DIFF_BY_DTYPE, EngineConfig
from slime_lite.debug.faults import FAULTS
from slime_lite.errors import SlimeLiteError
from slime_lite.rollout.rewards import RM_TYPES

log = logging.getLogger(__name__)


def _rl_math_names() -> dict[str, tuple[str, ...]]:
    """``ESTIMATORS`` and ``KL_TYPES`` as rl_math.py defines them (their one definition), read from its source:
    importing rl_math loads torch, and ``--help`` and flag errors must stay instant."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("slime_lite.rl_math")
    assert spec is not None and spec.origin is not None
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("ESTIMATORS", "KL_TYPES"):
                names[node.targets[0].id] = tuple(ast.literal_eval(node.value))
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _nonneg_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _key_value(text: str) -> str:
    key, eq, _ = text.partition("=")
    if not eq or not key or not key.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (an environment variable), got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The ``train`` flags, grouped as slime's documentation groups them."""
    rl = _rl_math_names()
    p = argparse.ArgumentParser(
        prog="slime-lite train",
        usage="%(prog)s [flags]   (any --sglang-<name> [value] goes to the SGLang servers as --<name> [value])",
        description="RL post-training (GRPO/PPO/REINFORCE++) with Megatron-core and SGLang-compatible engines.",
        allow_abbrev=False,
    )
    g = p.add_argument_group("cluster", "where each process runs (without GPUs, each 'GPU' is one logical slot)")
    g.add_argument("--actor-num-nodes", type=_positive_int, default=1,
                   help="nodes of the training actor (default: %(default)s)")
    g.add_argument("--actor-num-gpus-per-node", type=_positive_int, default=1,
                   help="GPUs per node of the training actor (default: %(default)s)")
    g.add_argument("--critic-num-nodes", type=_positive_int, default=None,
                   help="nodes of the PPO critic (default: as --actor-num-nodes)")
    g.add_argument("--critic-num-gpus-per-node", type=_positive_int, default=None,
                   help="GPUs per node of the PPO critic (default: as --actor-num-gpus-per-node)")
    g.add_argument("--rollout-num-gpus", type=_positive_int, default=1,
                   help="GPUs of all rollout engines together (default: %(default)s)")
    g.add_argument("--rollout-num-gpus-per-engine", type=_positive_int, default=1,
                   help="GPUs per engine, SGLang's tp_size (default: %(default)s; the embedded engine takes 1)")
    g.add_argument("--colocate", action="store_true",
                   help="engines and trainers share the same GPUs; turns on --offload-train and --offload-rollout")
    g.add_argument("--offload-train", action="store_true",
                   help="move the trainer's weights and optimizer state off the GPU while engines generate")
    g.add_argument("--offload-rollout", action="store_true",
                   help="release the engines' weights and KV cache while the trainer trains")
    g.add_argument("--rollout-backend", choices=("embedded", "sglang"), default="embedded",
                   help="rollout engines: slime_lite's own SGLang-compatible engine, or SGLang servers (GPU) "
                        "(default: %(default)s)")

    g = p.add_argument_group("model and checkpoint")
    g.add_argument("--hf-checkpoint", default=None,
                   help="Hugging Face model folder: tokenizer, architecture and initial weights (required)")
    g.add_argument("--load", default=None, help="resume training from this checkpoint folder (written by --save)")
    g.add_argument("--ref-load", default=None,
                   help="HF folder of the reference model for KL (default: --hf-checkpoint)")
    g.add_argument("--save", default=None, help="folder to write checkpoints to")
    g.add_argument("--save-interval", type=_positive_int, default=None,
                   help="save a checkpoint every N rollouts (needs --save; default: never)")

    g = p.add_argument_group("Megatron training and parallelism")
    g.add_argument("--tensor-model-parallel-size", type=_positive_int, default=1,
                   help="Megatron tensor-parallel size (default: %(default)s)")
    g.add_argument("--pipeline-model-parallel-size", type=_positive_int, default=1,
                   help="Megatron pipeline-parallel size (default: %(default)s)")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                   help="Megatron transformer implementation (default: %(default)s)")
    g.add_argument("--bf16", action="store_true", help="train in bfloat16 (default: float32)")
    g.add_argument("--lr", type=_nonneg_float, default=1e-6, help="actor learning rate (default: %(default)s)")
    g.add_argument("--critic-lr", type=_nonneg_float, default=None, help="critic learning rate (default: --lr)")
    g.add_argument("--weight-decay", type=_nonneg_float, default=0.0,
                   help="Adam weight decay (default: %(default)s)")
    g.add_argument("--clip-grad", type=_nonneg_float, default=1.0,
                   help="clip the global gradient norm to this value (default: %(default)s)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1 (default: %(default)s)")
    g.add_argument("--adam-beta2", type=float, default=0.98, help="Adam beta2 (default: %(default)s)")
    g.add_argument("--seed", type=int, default=1234, help="trainer random seed (default: %(default)s)")
    g.add_argument("--update-weight-transport", choices=("tensor", "distributed", "disk"), default="tensor",
                   help="how new weights reach the engines: HTTP tensors, a torch.distributed broadcast, or files "
                        "(default: %(default)s)")

    g = p.add_argument_group("rollout", "sampling and generation")
    g.add_argument("--rollout-temperature", type=_nonneg_float, default=1.0,
                   help="sampling temperature; the trainer scores log-probs at the same one (default: %(default)s)")
    g.add_argument("--rollout-top-p", type=float, default=1.0,
                   help="nucleus sampling, in (0, 1] (default: %(default)s)")
    g.add_argument("--rollout-top-k", type=int, default=-1, help="top-k sampling, -1 for off (default: %(default)s)")
    g.add_argument("--rollout-max-response-len", type=_positive_int, default=32,
                   help="max new tokens per response (default: %(default)s)")
    g.add_argument("--rollout-stop", nargs="+", default=None, help="stop strings (default: the EOS token only)")
    g.add_argument("--rollout-seed", type=int, default=42,
                   help="seed of prompt shuffling and sampling; engine i gets seed + i (default: %(default)s)")
    g.add_argument("--custom-generate-function-path", default=None,
                   help="module.fn async generate(args, sample, sampling_params) -> Sample, replacing the default")
    g.add_argument("--over-sampling-batch-size", type=_positive_int, default=None,
                   help="prompts per generation wave under dynamic sampling, >= --rollout-batch-size "
                        "(default: --rollout-batch-size)")
    g.add_argument("--dynamic-sampling-filter-path", default=None,
                   help="module.fn keep(args, samples)->bool over one group; "
                        "'slime_lite.rollout.filters.check_reward_nonzero_std' drops groups whose rewards agree")
    g.add_argument("--rollout-request-timeout", type=float, default=300.0,
                   help="seconds per engine request (default: %(default)s)")

    g = p.add_argument_group("data", "prompts and batch sizes")
    g.add_argument("--prompt-data", default=None, help="JSONL file of prompts (required unless --debug-train-only)")
    g.add_argument("--input-key", default="prompt", help="JSONL key of the prompt (default: %(default)s)")
    g.add_argument("--label-key", default="label", help="JSONL key of the label (default: %(default)s)")
    g.add_argument("--apply-chat-template", action="store_true",
                   help="render each prompt with the tokenizer's chat template")
    g.add_argument("--rollout-shuffle", action="store_true", help="shuffle the prompts every epoch")
    g.add_argument("--num-rollout", type=_positive_int, default=1,
                   help="rollouts (generate + train iterations) to run (default: %(default)s)")
    g.add_argument("--rollout-batch-size", type=_positive_int, default=8,
                   help="prompts per rollout (default: %(default)s)")
    g.add_argument("--n-samples-per-prompt", type=_positive_int, default=1,
                   help="responses per prompt, the GRPO group size (default: %(default)s)")
    g.add_argument("--global-batch-size", type=_positive_int, default=None,
                   help="samples per optimizer step; with --num-steps-per-rollout both must agree "
                        "(default: --rollout-batch-size x --n-samples-per-prompt / --num-steps-per-rollout)")
    g.add_argument("--num-steps-per-rollout", type=_positive_int, default=None,
                   help="optimizer steps per rollout (default: 1, or as --global-batch-size implies)")
    g.add_argument("--micro-batch-size", type=_positive_int, default=1,
                   help="samples per forward/backward pass on one data-parallel rank (default: %(default)s)")

    g = p.add_argument_group("eval")
    g.add_argument("--eval-interval", type=_positive_int, default=None,
                   help="evaluate every N rollouts, before training and at the end (needs --eval-prompt-data)")
    g.add_argument("--eval-prompt-data", nargs="+", default=None, metavar="NAME PATH",
                   help="eval sets as pairs NAME PATH (JSONL, same keys as --prompt-data)")
    g.add_argument("--n-samples-per-eval-prompt", type=_positive_int, default=1,
                   help="responses per eval prompt (default: %(default)s)")
    g.add_argument("--eval-temperature", type=_nonneg_float, default=None,
                   help="eval sampling temperature (default: --rollout-temperature)")
    g.add_argument("--eval-max-response-len", type=_positive_int, default=None,
                   help="max new tokens per eval response (default: --rollout-max-response-len)")

    g = p.add_argument_group("algorithm", "advantages and losses")
    g.add_argument("--advantage-estimator", choices=rl["ESTIMATORS"], default="grpo",
                   help="(default: %(default)s; ppo trains a critic)")
    g.add_argument("--use-kl-loss", action="store_true",
                   help="add --kl-loss-coef x KL(actor || reference) to the policy loss")
    g.add_argument("--kl-loss-coef", type=_nonneg_float, default=0.0,
                   help="weight of the KL loss (default: %(default)s)")
    g.add_argument("--kl-loss-type", choices=rl["KL_TYPES"], default="low_var_kl",
                   help="KL estimator of the KL loss and the reward penalty (default: %(default)s)")
    g.add_argument("--kl-coef", type=_nonneg_float, default=0.0,
                   help="KL penalty in the reward, PPO/REINFORCE++ only (default: %(default)s)")
    g.add_argument("--eps-clip", type=_nonneg_float, default=0.2,
                   help="PPO ratio clip, lower side (default: %(default)s)")
    g.add_argument("--eps-clip-high", type=_nonneg_float, default=None,
                   help="PPO ratio clip, upper side (default: --eps-clip)")
    g.add_argument("--eps-clip-c", type=float, default=None,
                   help="dual-clip bound (> 1) on the loss of negative-advantage tokens (default: off)")
    g.add_argument("--entropy-coef", type=_nonneg_float, default=0.0,
                   help="entropy bonus weight in the policy loss (default: %(default)s)")
    g.add_argument("--normalize-advantages", action="store_true",
                   help="whiten the advantages over the batch (REINFORCE++ always does)")
    g.add_argument("--disable-grpo-std-normalization", action="store_true",
                   help="GRPO: subtract the group mean only, do not divide by the group std")
    g.add_argument("--gamma", type=float, default=1.0,
                   help="discount of PPO/REINFORCE++ returns (default: %(default)s)")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda of PPO (default: %(default)s)")
    g.add_argument("--value-clip", type=_nonneg_float, default=0.2,
                   help="PPO critic: clip of the value change (default: %(default)s)")
    g.add_argument("--use-tis", action="store_true",
                   help="truncated importance sampling: weight the policy loss by exp(old - rollout log-prob), "
                        "capped at --tis-clip")
    g.add_argument("--tis-clip", type=_nonneg_float, default=2.0,
                   help="cap of the TIS weight (default: %(default)s)")

    g = p.add_argument_group("reward model")
    g.add_argument("--rm-type", choices=RM_TYPES, default=None, help="built-in reward (or give --custom-rm-path)")
    g.add_argument("--reward-key", default=None, help="key to pick when the reward is a dict")
    g.add_argument("--custom-rm-path", default=None,
                   help="module.fn async reward(args, sample) -> float or dict; replaces --rm-type")

    g = p.add_argument_group("debug")
    g.add_argument("--debug-rollout-only", action="store_true", help="engines only; Megatron is never imported")
    g.add_argument("--debug-train-only", action="store_true", help="train only; no engines")
    g.add_argument("--save-debug-rollout-data", default=None, metavar="TEMPLATE",
                   help="save each rollout's samples to TEMPLATE.format(rollout_id=i), e.g. /d/{rollout_id}.pt")
    g.add_argument("--load-debug-rollout-data", default=None, metavar="TEMPLATE",
                   help="train on saved rollouts instead of generating (implies --debug-train-only)")
    g.add_argument("--load-debug-rollout-data-subsample", type=float, default=None,
                   help="train on this fraction, in (0, 1], of each loaded rollout")
    g.add_argument("--dump-details", default=None, metavar="DIR",
                   help="save rollout and train data (log-probs, advantages) of every rollout under DIR")
    g.add_argument("--check-weight-update-equal", action="store_true",
                   help="after every weight push, check that each engine holds exactly the trainer's weights")
    g.add_argument("--debug-env", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="set an environment variable in every Ray process, e.g. CUDA_LAUNCH_BLOCKING=1 (repeatable)")
    g.add_argument("--debug-scramble-engine-weights", action="store_true",
                   help="overwrite engine weights with noise before each push, so a parameter the push skips is "
                        "caught by --check-weight-update-equal even if it equals the old value")
    g.add_argument("--debug-inject-fault", choices=tuple(FAULTS), default=None,
                   help="deliberately break one thing, to see the checks catch it (testing only): "
                        + "; ".join(f"{k}: {v}" for k, v in FAULTS.items()))

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
    g.add_argument("--log-level", default="INFO", help="Python logging level (default: %(default)s)")

    g = p.add_argument_group(
        "SGLang and engines",
        "the embedded engine (--rollout-backend embedded) or SGLang servers; any other --sglang-<name> [value] is "
        "passed to each SGLang server as --<name> [value]")
    g.add_argument("--rollout-external-engine-addrs", default=None,
                   help="host:port,... of engines already running; none are started")
    g.add_argument("--rollout-device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="device of embedded engines (auto: cuda when available)")
    g.add_argument("--engine-dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="dtype of embedded engines (auto: the checkpoint's)")
    g.add_argument("--engine-max-running-requests", type=_positive_int, default=64,
                   help="embedded engine: requests decoded together (default: %(default)s)")
    g.add_argument("--engine-kv-cache-tokens", type=_positive_int, default=None,
                   help="embedded engine: KV-cache size in tokens (default: max running requests x "
                        "min(context, 4096))")
    g.add_argument("--engine-disable-cuda-graph", action="store_true",
                   help="embedded engine on CUDA: decode eagerly instead of replaying CUDA graphs")
    g.add_argument("--engine-enable-torch-compile", action="store_true",
                   help="embedded engine on CUDA: torch.compile the layers of the CUDA-graph decode step")
    g.add_argument("--use-sglang-router", action="store_true",
                   help="--rollout-backend sglang: put SGLang's router (sglang_router) in front of the engines")
    g.add_argument("--sglang-server-module", default="sglang.launch_server",
                   help="module run as 'python -m MODULE' for each SGLang engine (not passed to SGLang)")
    return p


NOT_PASSTHROUGH = ("--sglang-server-module",)  # slime_lite's own flags that share the --sglang- prefix


def split_sglang_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Take ``--sglang-<name> [value]`` out of argv; returns (rest, passthrough as ``--<name> [value]``)."""
    rest: list[str] = []
    sglang: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--sglang-") and arg.partition("=")[0] not in NOT_PASSTHROUGH:
            name, eq, value = arg.partition("=")
            sglang.append("--" + name[len("--sglang-"):])
            if eq:
                sglang.append(value)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                sglang.append(argv[i + 1])
                i += 1
        else:
            rest.append(arg)
        i += 1
    return rest, sglang


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    rest, sglang = split_sglang_args(argv)
    args = build_parser().parse_args(rest)
    args.sglang_args = sglang
    validate_args(args)
    return args


def parser_defaults(**overrides: Any) -> argparse.Namespace:
    """The namespace of ``slime-lite train`` with no flags, ``overrides`` applied, and the values that default to
    other flags filled in (as ``validate_args`` fills them); no other rule is checked. For tests and tools that
    need a full namespace without a command line."""
    args = build_parser().parse_args([])
    args.sglang_args = []
    unknown = sorted(set(overrides) - set(vars(args)))
    if unknown:
        raise TypeError(f"not flags of slime-lite train: {unknown}")
    vars(args).update(overrides)
    _fill_implied(args)
    if args.num_steps_per_rollout is None and args.global_batch_size is None:
        args.num_steps_per_rollout = 1
    return args


# ---- validation ------------------------------------------------------------------------------------------------
def _need_file(path: str | None, flag: str) -> None:
    if path is not None and not os.path.exists(path):
        raise SlimeLiteError(f"{flag} {path}: no such file or folder.")


def _fill_implied(args: argparse.Namespace) -> None:
    """Flags whose default is another flag's value."""
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.critic_lr is None:
        args.critic_lr = args.lr
    if args.eval_temperature is None:
        args.eval_temperature = args.rollout_temperature
    if args.eval_max_response_len is None:
        args.eval_max_response_len = args.rollout_max_response_len
    if args.critic_num_nodes is None:
        args.critic_num_nodes = args.actor_num_nodes
    if args.critic_num_gpus_per_node is None:
        args.critic_num_gpus_per_node = args.actor_num_gpus_per_node


def validate_args(args: argparse.Namespace) -> None:
    """Enforce SPEC section 3 and 5 rules; set implied flags (with a log line)."""
    from slime_lite.rollout.dumps import check_template

    if args.debug_rollout_only and args.debug_train_only:
        raise SlimeLiteError(
            "--debug-rollout-only and --debug-train-only cannot be used together: one runs only the engines, "
            "the other only the trainer. Pick one."
        )
    if (
        args.save_debug_rollout_data
        and args.load_debug_rollout_data
        and os.path.abspath(args.save_debug_rollout_data) == os.path.abspath(args.load_debug_rollout_data)
    ):
        raise SlimeLiteError("--save-debug-rollout-data and --load-debug-rollout-data must be different paths.")
    if args.load_debug_rollout_data:
        if args.debug_rollout_only:
            raise SlimeLiteError(
                "--load-debug-rollout-data replays dumps into the trainer, so it cannot be combined with "
                "--debug-rollout-only."
            )
        check_template(args.load_debug_rollout_data, "--load-debug-rollout-data")
        if not args.debug_train_only:
            log.info("--load-debug-rollout-data given: turning on --debug-train-only (no engines are started)")
            args.debug_train_only = True
    if args.load_debug_rollout_data_subsample is not None:
        if not args.load_debug_rollout_data:
            raise SlimeLiteError("--load-debug-rollout-data-subsample needs --load-debug-rollout-data.")
        if not 0 < args.load_debug_rollout_data_subsample <= 1:
            raise SlimeLiteError(
                f"--load-debug-rollout-data-subsample {args.load_debug_rollout_data_subsample} must be in (0, 1]."
            )
    if args.dump_details:
        if args.save_debug_rollout_data:
            raise SlimeLiteError("--dump-details sets the rollout dump path itself; drop --save-debug-rollout-data.")
        if not args.debug_train_only:
            args.save_debug_rollout_data = os.path.join(args.dump_details, "rollout_data", "{rollout_id}.pt")
    if args.save_debug_rollout_data:
        check_template(args.save_debug_rollout_data, "--save-debug-rollout-data")
        if args.debug_train_only:
            raise SlimeLiteError(
                "--save-debug-rollout-data has nothing to save under --debug-train-only/--load-debug-rollout-data "
                "(no rollouts are generated)."
            )
    if args.colocate and not args.debug_rollout_only and not (args.offload_train and args.offload_rollout):
        log.info("--colocate: turning on --offload-train and --offload-rollout (trainer and engines share GPUs)")
        args.offload_train = args.offload_rollout = True
    if args.debug_rollout_only:
        changed = [f for f in ("colocate", "offload_train", "offload_rollout") if getattr(args, f)]
        for f in changed:
            setattr(args, f, False)
        log.info(
            "--debug-rollout-only: no trainer is built and no training memory is reserved%s",
            f"; turned off {', '.join('--' + f.replace('_', '-') for f in changed)}" if changed else "",
        )

    if args.hf_checkpoint is None:
        raise SlimeLiteError("--hf-checkpoint is required (tokenizer, architecture and initial weights).")
    _need_file(args.hf_checkpoint, "--hf-checkpoint")
    if not os.path.exists(os.path.join(args.hf_checkpoint, "config.json")):
        raise SlimeLiteError(
            f"--hf-checkpoint {args.hf_checkpoint} has no config.json: not a Hugging Face model folder.")
    _need_file(args.ref_load, "--ref-load")
    if not args.debug_train_only:
        if args.prompt_data is None and not args.custom_generate_function_path:
            raise SlimeLiteError("--prompt-data is required to generate rollouts (a JSONL file of prompts).")
        _need_file(args.prompt_data, "--prompt-data")
        if args.rm_type is None and args.custom_rm_path is None:
            raise SlimeLiteError("a reward is needed: give --rm-type or --custom-rm-path.")
    if args.eval_prompt_data is not None:
        if len(args.eval_prompt_data) % 2:
            raise SlimeLiteError("--eval-prompt-data takes pairs NAME PATH [NAME PATH ...].")
        for path in args.eval_prompt_data[1::2]:
            _need_file(path, "--eval-prompt-data")
    if args.eval_interval is not None and args.eval_prompt_data is None:
        raise SlimeLiteError("--eval-interval needs --eval-prompt-data NAME PATH.")
    if args.over_sampling_batch_size is not None and args.over_sampling_batch_size < args.rollout_batch_size:
        raise SlimeLiteError(
            f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= --rollout-batch-size "
            f"{args.rollout_batch_size}."
        )
    if not 0 < args.rollout_top_p <= 1:
        raise SlimeLiteError(f"--rollout-top-p {args.rollout_top_p} must be in (0, 1].")
    if args.eps_clip_c is not None and args.eps_clip_c <= 1:
        raise SlimeLiteError(f"--eps-clip-c {args.eps_clip_c} must be > 1 (dual-clip bound).")
    _fill_implied(args)
    if args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
        raise SlimeLiteError(
            f"--rollout-num-gpus {args.rollout_num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
            f"{args.rollout_num_gpus_per_engine}."
        )
    if args.rollout_backend == "embedded" and args.rollout_num_gpus_per_engine != 1:
        raise SlimeLiteError("--rollout-backend embedded runs one GPU per engine: use --rollout-num-gpus-per-engine 1.")
    if args.sglang_args and args.rollout_backend != "sglang":
        raise SlimeLiteError(
            f"{args.sglang_args[0].replace('--', '--sglang-', 1)} is passed to SGLang servers, but "
            "--rollout-backend is embedded. Use --rollout-backend sglang or drop the --sglang-* flags."
        )
    if args.engine_enable_torch_compile and (args.engine_disable_cuda_graph or args.rollout_device == "cpu"):
        raise SlimeLiteError(
            "--engine-enable-torch-compile compiles the embedded engine's CUDA-graph decode step; it cannot be "
            + ("combined with --engine-disable-cuda-graph. Drop one of them." if args.engine_disable_cuda_graph
               else "used with --rollout-device cpu. Drop it."))
    if args.use_tis and args.tis_clip <= 0:
        raise SlimeLiteError("--tis-clip must be > 0 with --use-tis.")
    for flag in ("custom_rm_path", "custom_generate_function_path", "dynamic_sampling_filter_path"):
        value = getattr(args, flag)
        if value is not None and "." not in value:
            raise SlimeLiteError(f"--{flag.replace('_', '-')} {value!r}: expected a dotted path 'module.function'.")
    if args.save_interval is not None and args.save is None:
        raise SlimeLiteError("--save-interval needs --save DIR.")
    if args.load is not None:
        _need_file(args.load, "--load")
    if args.use_wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise SlimeLiteError("--use-wandb needs the wandb package: .venv/bin/pip install wandb (it logs offline "
                                 "without a network).")
    if not args.debug_rollout_only:
        validate_train_args(args)
    elif args.num_steps_per_rollout is None:
        args.num_steps_per_rollout = 1
    from slime_lite.backends.sglang.launcher import check_sglang_args

    check_sglang_args(EngineConfig.from_args(args))


def world_size(args: Any) -> int:
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def _check_model_split(args: argparse.Namespace, tp: int, pp: int) -> None:
    import json

    with open(os.path.join(args.hf_checkpoint, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads", heads)
    layers = cfg.get("num_hidden_layers")
    for what, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if value and value % tp:
            raise SlimeLiteError(f"--tensor-model-parallel-size {tp} must divide the model's {what} ({value}).")
    if layers and layers % pp:
        raise SlimeLiteError(
            f"--pipeline-model-parallel-size {pp} must divide the model's num_hidden_layers ({layers}).")


def validate_train_args(args: argparse.Namespace) -> None:
    """Parallel sizes and batch sizes that must divide (trainer side)."""
    world = world_size(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _check_model_split(args, tp, pp)
    if world % (tp * pp):
        raise SlimeLiteError(
            f"--actor-num-nodes x --actor-num-gpus-per-node = {world} is not divisible by "
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}."
        )
    dp = world // (tp * pp)
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    steps = args.num_steps_per_rollout
    if args.global_batch_size is None:
        steps = 1 if steps is None else steps
        if samples % steps:
            raise SlimeLiteError(
                f"one rollout has {samples} samples (--rollout-batch-size x --n-samples-per-prompt), not divisible "
                f"by --num-steps-per-rollout {steps}."
            )
        args.global_batch_size = samples // steps
    elif samples % args.global_batch_size:
        raise SlimeLiteError(
            f"--global-batch-size {args.global_batch_size} does not divide one rollout's {samples} samples "
            "(--rollout-batch-size x --n-samples-per-prompt)."
        )
    elif steps is not None and steps != samples // args.global_batch_size:
        raise SlimeLiteError(
            f"--global-batch-size {args.global_batch_size} and --num-steps-per-rollout {steps} disagree: one "
            f"rollout has {samples} samples (--rollout-batch-size {args.rollout_batch_size} x "
            f"--n-samples-per-prompt {args.n_samples_per_prompt}), so --global-batch-size {args.global_batch_size} "
            f"means {samples // args.global_batch_size} steps per rollout. Give only one of the two flags."
        )
    args.num_steps_per_rollout = samples // args.global_batch_size
    if args.global_batch_size % (dp * args.micro_batch_size):
        raise SlimeLiteError(
            f"--global-batch-size {args.global_batch_size} is not divisible by data-parallel size {dp} x "
            f"--micro-batch-size {args.micro_batch_size}."
        )
    if args.advantage_estimator in ("grpo", "reinforce_plus_plus_baseline") and args.n_samples_per_prompt < 2:
        log.warning("--advantage-estimator %s with --n-samples-per-prompt 1 gives zero advantages",
                    args.advantage_estimator)
