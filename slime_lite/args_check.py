"""The rules between ``slime-lite train`` flags (placement modes and the debug modes), checked once after parsing, before anything
starts; and the flags whose default is another flag's value. The parser itself is args.py."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
from typing import Any

from slime_lite.backends.megatron.train_dump import check_train_template
from slime_lite.config import EngineConfig
from slime_lite.errors import SlimeLiteError
from slime_lite.hooks import DEFAULT_ROLLOUT_FUNCTION
from slime_lite import rl_math
from slime_lite.model_families import read_config
from slime_lite.profiling import profile_targets
from slime_lite.rollout.data import data_file
from slime_lite.rollout.dumps import check_template, dump_path
from slime_lite.args_async import check_async_train, check_fully_async, check_partial_rollout
from slime_lite.args_observe import check_logging_flags
from slime_lite.args_layout import world_size
from slime_lite.args_train import check_slime_train_flags, validate_rollout_only_args, validate_train_args
from slime_lite.slime_flags import check as check_slime_flags

log = logging.getLogger("slime_lite.args")


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def _need_file(path: str | None, flag: str, data: bool = False) -> None:
    """``path`` exists; with ``data`` (a prompt file) the file of ``PATH@[start:end]`` (slime's row slice)."""
    if path is not None and not os.path.exists(data_file(path) if data else path):
        raise SlimeLiteError(f"{flag} {path}: no such file or folder.")


def fill_implied(args: argparse.Namespace) -> None:
    """Flags whose default is another flag's value."""
    if args.num_rollout is None:  # (validate_args first counts --num-epoch's rollouts from the data)
        args.num_rollout = 1
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.critic_lr is None:
        args.critic_lr = args.lr
    if args.eval_temperature is None:
        args.eval_temperature = args.rollout_temperature
    if args.eval_max_response_len is None:
        args.eval_max_response_len = args.rollout_max_response_len
    if args.eval_top_p is None:
        args.eval_top_p = args.rollout_top_p
    if args.eval_top_k is None:
        args.eval_top_k = args.rollout_top_k
    if args.rollout_num_gpus is None:  # slime: under --colocate the engines take the actor's GPUs
        args.rollout_num_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node if args.colocate else 1
    if args.critic_num_nodes is None:
        args.critic_num_nodes = args.actor_num_nodes
    if args.critic_num_gpus_per_node is None:
        args.critic_num_gpus_per_node = args.actor_num_gpus_per_node


def _actor_start(args: argparse.Namespace) -> str:
    if args.ref_load is None:
        return f"--hf-checkpoint {args.hf_checkpoint}"
    return f"--ref-load {args.ref_load}, as slime (--hf-checkpoint gives the architecture and tokenizer)"


def check_no_checkpoint(folder: str) -> None:
    """A --load folder without ``latest`` is a fresh start only when it holds no checkpoint nor a model of another
    kind (a Megatron checkpoint of slime, one iteration's folder, an HF model, iteration folders whose ``latest`` is
    gone): those would be ignored, and overwritten by a --save to the same folder."""
    names = os.listdir(folder)
    kind = ("a Megatron checkpoint (slime's torch_dist format): slime-lite resumes only the checkpoints its --save "
            "writes (latest, iter_*/rank_*.pt). Start from a Hugging Face export of it with --hf-checkpoint, and give "
            "--load and --save another folder" if "latest_checkpointed_iteration.txt" in names else
            f"one iteration of a checkpoint (rank_*.pt): give --load the folder that holds it and its 'latest' file "
            f"({os.path.dirname(os.path.abspath(folder))})" if any(re.fullmatch(r"rank_\d{3}\.pt", n) for n in names)
            else "a Hugging Face model folder: start from it with --hf-checkpoint (--load resumes what --save wrote)"
            if "config.json" in names else None)
    if kind:
        raise SlimeLiteError(f"--load {folder} is {kind}.")
    saved = sorted(n for n in names if re.fullmatch(r"iter_\d{7}", n))
    if saved:
        raise SlimeLiteError(
            f"--load {folder} holds checkpoint(s) ({', '.join(saved[-3:])}) but no 'latest' file naming the one to "
            f"resume: write its name into {os.path.join(folder, 'latest')} (e.g. {saved[-1]}), or give --load a "
            "folder without checkpoints to start afresh.")


def fill_num_epoch(args: argparse.Namespace) -> None:
    """--num-epoch without --num-rollout: num_epoch x (prompts // --rollout-batch-size) rollouts, as slime."""
    if args.num_epoch is None:
        return
    if args.num_rollout is not None:
        log.info("--num-rollout %d given: --num-epoch %d is not used (as in slime)", args.num_rollout, args.num_epoch)
        return
    if args.prompt_data is None or args.debug_train_only:
        raise SlimeLiteError(f"--num-epoch {args.num_epoch} counts the rollouts of an epoch from --prompt-data, and "
                             "this run reads none: give --num-rollout N instead.")
    from slime_lite.rollout.data import DataKeys, drop_long_prompts, read_prompts

    prompts = read_prompts(args.prompt_data, DataKeys.from_args(args))
    if args.rollout_max_prompt_len is not None:  # slime counts the prompts left after its length filter
        from slime_lite.tokenizer import load_tokenizer

        prompts = drop_long_prompts(prompts, args.rollout_max_prompt_len, load_tokenizer(args.hf_checkpoint), args,
                                    f"--prompt-data {args.prompt_data} with --rollout-max-prompt-len")
    per_epoch = len(prompts) // args.rollout_batch_size
    if per_epoch == 0:
        raise SlimeLiteError(f"--num-epoch {args.num_epoch}: --prompt-data {args.prompt_data} has fewer prompts "
                             f"than one rollout takes (--rollout-batch-size {args.rollout_batch_size}).")
    args.num_rollout = args.num_epoch * per_epoch
    args.num_rollout_per_epoch = per_epoch  # an epoch's end saves and evaluates too (as slime)
    log.info("--num-epoch %d: %d rollouts (%d per epoch)", args.num_epoch, args.num_rollout, per_epoch)


def warn_unread_flags(args: argparse.Namespace, given: set[str]) -> None:
    """A discount, GAE or critic flag given on the command line that this run's estimator does not read: said at
    the start (slime ignores it silently). Not with --custom-advantage-function-path, whose hook may read any flag."""
    if args.custom_advantage_function_path:
        return

    def reads(e: rl_math.Estimator) -> set[str]:
        return set(e.reads) | (set(rl_math.CRITIC_FLAGS) if e.needs_critic else set())

    spec = rl_math.estimator(args.advantage_estimator)
    for flag in (*rl_math.ESTIMATOR_FLAGS, *rl_math.CRITIC_FLAGS):
        if flag in given and flag not in reads(spec):
            users = ", ".join(e.name for e in rl_math.ESTIMATORS.values() if flag in reads(e))
            log.warning("%s changes nothing with --advantage-estimator %s (it is read by: %s)", flag, spec.name,
                        users)


def validate_args(args: argparse.Namespace) -> None:
    """Enforce the rules between flags; set implied flags (with a log line)."""

    if args.offload:  # slime's shorthand
        args.offload_train = args.offload_rollout = True
    if args.rollout_max_context_len is not None:  # as slime: a prompt leaves room for at least one response token
        if args.rollout_max_prompt_len is None:
            args.rollout_max_prompt_len = args.rollout_max_context_len - 1
            log.info("--rollout-max-prompt-len not given: %d (--rollout-max-context-len - 1)",
                     args.rollout_max_prompt_len)
        elif args.rollout_max_prompt_len > args.rollout_max_context_len - 1:
            raise SlimeLiteError(f"--rollout-max-prompt-len {args.rollout_max_prompt_len} leaves no room for a "
                                 f"response in --rollout-max-context-len {args.rollout_max_context_len}: give at "
                                 f"most {args.rollout_max_context_len - 1}.")
    check_logging_flags(args)
    if args.debug_rollout_only and args.debug_train_only:
        raise SlimeLiteError(
            "--debug-rollout-only and --debug-train-only cannot be used together: one runs only the engines, "
            "the other only the trainer. Pick one."
        )
    check_async_train(args)
    check_fully_async(args)
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
        if args.load_debug_rollout_data and _inside(dump_path(args.load_debug_rollout_data, 0), args.dump_details):
            raise SlimeLiteError(
                f"--dump-details {args.dump_details} holds the dumps this replay reads (--load-debug-rollout-data "
                f"{args.load_debug_rollout_data}): the replay's train_data, mismatch and args.json would overwrite "
                "the original run's; give the replay a --dump-details folder of its own, or drop it.")
        if not args.debug_train_only:
            args.save_debug_rollout_data = os.path.join(args.dump_details, "rollout_data", "{rollout_id}.pt")
    if args.save_debug_rollout_data:
        check_template(args.save_debug_rollout_data, "--save-debug-rollout-data")
        if args.debug_train_only:
            raise SlimeLiteError(
                "--save-debug-rollout-data has nothing to save under --debug-train-only/--load-debug-rollout-data "
                "(no rollouts are generated)."
            )
    if args.dump_details and not args.save_debug_train_data and not args.debug_rollout_only:  # as slime does
        args.save_debug_train_data = os.path.join(args.dump_details, "train_data", "{rollout_id}_{rank}.pt")
    if args.save_debug_train_data:
        if args.debug_rollout_only:
            raise SlimeLiteError("--save-debug-train-data has nothing to save under --debug-rollout-only (nothing "
                                 "is trained); drop one of them.")

        model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
        rollout_flag = "--load-debug-rollout-data" if args.load_debug_rollout_data else "--save-debug-rollout-data"
        check_train_template(args.save_debug_train_data, args.load_debug_rollout_data or args.save_debug_rollout_data,
                             max(1, world_size(args) // model_parallel), rollout_flag)
    if args.colocate and not args.debug_rollout_only:  # as slime: on unless --no-offload-train / -rollout
        unset = [f for f in ("offload_train", "offload_rollout") if getattr(args, f) is None]
        if unset:
            log.info("--colocate: turning on %s (trainer and engines share GPUs)",
                     " and ".join("--" + f.replace("_", "-") for f in unset))
        for f in unset:
            setattr(args, f, True)
    for f in ("offload_train", "offload_rollout"):  # neither given: off
        setattr(args, f, bool(getattr(args, f)))
    if args.debug_rollout_only:
        if args.colocate and args.rollout_num_gpus is None:  # slime: the engines still get the actor's GPUs
            args.rollout_num_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
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
    read_config(args.hf_checkpoint)  # JSON, an object, its sizes ints: every later reader may rely on it

    check_slime_flags(args)
    _need_file(args.ref_load, "--ref-load")
    if args.ref_load is not None and not os.path.exists(os.path.join(args.ref_load, "config.json")):
        megatron = os.path.exists(os.path.join(args.ref_load, "latest_checkpointed_iteration.txt"))
        raise SlimeLiteError(
            f"--ref-load {args.ref_load} is "
            + ("a Megatron checkpoint (slime's torch_dist format)" if megatron else "not a Hugging Face model folder")
            + ": slime-lite reads the reference model from a Hugging Face folder (config.json and weights). Point "
            "--ref-load at one, or drop it (the reference is then --hf-checkpoint).")
    if not args.debug_train_only:
        if (args.prompt_data is None and not args.custom_generate_function_path
                and args.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION):
            raise SlimeLiteError("--prompt-data is required to generate rollouts (a JSONL file of prompts).")
        _need_file(args.prompt_data, "--prompt-data", data=True)
    if (args.rm_type or "").removeprefix("boxed_") == "dapo" and not args.custom_rm_path and not args.reward_key:
        raise SlimeLiteError(f"--rm-type {args.rm_type}: its reward is the dict {{score, acc, pred}}: give "
                             "--reward-key score (as slime's DAPO scripts do).")
    if args.rm_type == "remote_rm" and not args.custom_rm_path and not args.rm_url:
        raise SlimeLiteError("--rm-type remote_rm posts each sample to a reward model service: give its --rm-url.")
    if args.eval_prompt_data is not None:
        if len(args.eval_prompt_data) % 2 or len(set(args.eval_prompt_data[::2])) < len(args.eval_prompt_data) // 2:
            raise SlimeLiteError("--eval-prompt-data takes pairs NAME PATH [NAME PATH ...], each NAME once.")
        for path in args.eval_prompt_data[1::2]:
            _need_file(path, "--eval-prompt-data", data=True)
    check_fault_tolerance(args)
    check_external_engines(args)
    if args.eval_interval and args.eval_prompt_data is None:
        raise SlimeLiteError("--eval-interval needs --eval-prompt-data NAME PATH.")
    eval_len = args.eval_max_response_len or args.rollout_max_response_len
    if args.eval_min_new_tokens is not None and args.eval_min_new_tokens > eval_len:
        raise SlimeLiteError(f"--eval-min-new-tokens {args.eval_min_new_tokens} is more than the eval responses may "
                             f"hold (--eval-max-response-len, else --rollout-max-response-len: {eval_len}).")
    if args.over_sampling_batch_size is not None and args.over_sampling_batch_size < args.rollout_batch_size:
        raise SlimeLiteError(
            f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= --rollout-batch-size "
            f"{args.rollout_batch_size}."
        )
    check_partial_rollout(args)
    default_only = [f"--{k.replace('_', '-')}" for k in ("rollout_sample_filter_path",
                    "rollout_all_samples_process_path", "dynamic_sampling_filter_path", "over_sampling_batch_size",
                    "partial_rollout") if getattr(args, k)]
    if default_only and args.rollout_function_path != DEFAULT_ROLLOUT_FUNCTION:
        log.warning("%s act in the default rollout function only (as in slime): --rollout-function-path %s replaces "
                    "it, so they do nothing unless it calls %s", " / ".join(default_only), args.rollout_function_path,
                    DEFAULT_ROLLOUT_FUNCTION)
    if not 0 < args.rollout_top_p <= 1:
        raise SlimeLiteError(f"--rollout-top-p {args.rollout_top_p} must be in (0, 1].")
    if args.eps_clip_c is not None and not args.eps_clip_c > 1:  # (NaN too)
        raise SlimeLiteError(f"--eps-clip-c {args.eps_clip_c} must be > 1 (dual-clip bound).")
    fill_num_epoch(args)
    fill_implied(args)
    if not 0 < args.eval_top_p <= 1:
        raise SlimeLiteError(f"--eval-top-p {args.eval_top_p} must be in (0, 1].")
    if args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
        raise SlimeLiteError(
            f"--rollout-num-gpus {args.rollout_num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
            f"{args.rollout_num_gpus_per_engine}."
        )
    if args.num_gpus_per_node is not None and args.num_gpus_per_node % args.rollout_num_gpus_per_engine:
        raise SlimeLiteError(f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine} must divide "
                             f"--num-gpus-per-node {args.num_gpus_per_node}: an engine's GPUs are on one node "
                             "(slime-lite runs no engine across nodes).")
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
    check_correction_args(args)
    for flag in ("custom_rm_path", "custom_generate_function_path", "dynamic_sampling_filter_path",
                 "rollout_function_path", "eval_function_path"):
        value = getattr(args, flag)
        if value is not None and "." not in value:
            raise SlimeLiteError(f"--{flag.replace('_', '-')} {value!r}: expected a dotted path 'module.function'.")
    if args.save_interval is not None and args.save is None:
        raise SlimeLiteError("--save-interval needs --save DIR.")
    if args.save is not None and args.save_interval is None and not args.debug_rollout_only:
        log.warning("--save %s without --save-interval writes no checkpoint (as in slime; the folder still holds "
                    "what else it is given for): add --save-interval N to save every N rollouts and after the last "
                    "one", args.save)
    check_debug_tool_args(args)
    check_slime_train_flags(args)  # --save-hf, --ref-update-interval, --update-weights-interval, ...
    if args.load is not None and not os.path.exists(os.path.join(args.load, "latest")):
        # as slime: a --load folder without a checkpoint yet (missing or empty; --save usually names the same one)
        # is a fresh start from the initial weights, not an error
        if os.path.exists(args.load) and not os.path.isdir(args.load):
            raise SlimeLiteError(f"--load {args.load}: not a folder (a checkpoint folder written by --save).")
        if os.path.isdir(args.load):
            check_no_checkpoint(args.load)
        log.info("--load %s has no checkpoint yet: a fresh start, the actor from %s", args.load, _actor_start(args))
        args.load = None
    elif args.load is None and args.ref_load is not None and not args.debug_rollout_only:
        log.info("no --load checkpoint to resume: the actor starts from %s", _actor_start(args))
    if args.save and args.load is None and os.path.exists(os.path.join(args.save, "latest")):
        log.warning("--save %s holds a checkpoint ('latest') that this run does not resume: its saves will replace "
                    "that run's; give --load %s to resume it, or save into another folder", args.save, args.save)
    if args.use_wandb:
        if importlib.util.find_spec("wandb") is None:
            raise SlimeLiteError("--use-wandb needs the wandb package: .venv/bin/pip install wandb (it logs offline "
                                 "without a network).")
    if not args.debug_rollout_only:
        validate_train_args(args)
    else:
        validate_rollout_only_args(args)
        if args.num_steps_per_rollout is None:
            args.num_steps_per_rollout = 1
    if args.debug_train_only:  # a replay starts no engine: SGLang need not be installed here
        return
    # its module imports ray: flag errors stay instant
    from slime_lite.backends.sglang.launcher import check_sglang_args

    check_sglang_args(EngineConfig.from_args(args))


# Flags that mean something only under a switch, with their defaults (the parser's, args.py): one given while its
# switch is off is refused.
UNDER_SWITCH: dict[str, dict[str, Any]] = {
    "use_tis": {"tis_clip_low": None, "tis_level": "token", "tis_mode": "truncate"},
    "use_rs": {"rs_level": "token", "rs_lower_bound": None, "rs_upper_bound": None, "rs_veto_threshold": None},
    "get_mismatch_metrics": {"mismatch_ratio_bound": 2.0, "mismatch_top_k": 10},
}


TIS_CLIP = 2.0  # --tis-clip's default (the parser's): TIS's upper bound, and --use-rs's unless --rs-upper-bound


def check_correction_args(args: Any) -> None:
    """Rollout correction (--use-tis, --use-rs) and --get-mismatch-metrics: bounds that make sense, and no flag of
    a switch that is off."""
    for switch, flags in UNDER_SWITCH.items():
        for flag, default in flags.items():
            if not getattr(args, switch) and getattr(args, flag) != default:
                raise SlimeLiteError(f"--{flag.replace('_', '-')} has no effect without "
                                     f"--{switch.replace('_', '-')}: add it or drop the flag.")
    if args.tis_clip != TIS_CLIP and not (args.use_tis or args.use_rs):
        raise SlimeLiteError("--tis-clip has no effect without --use-tis (or --use-rs, whose upper bound it is by "
                             "default): add one or drop the flag.")
    if args.use_tis:
        high, low = args.tis_clip, args.tis_clip_low
        if high <= 0:
            raise SlimeLiteError("--tis-clip must be > 0 with --use-tis.")
        if low is not None and low >= high:
            raise SlimeLiteError(f"--tis-clip-low {low} must be below --tis-clip {high}.")
        if args.tis_mode == "mask" and low is None and high <= 1:
            raise SlimeLiteError(f"--tis-mode mask keeps ratios in [1/--tis-clip, --tis-clip]: --tis-clip {high} "
                                 "must be > 1 (or give --tis-clip-low).")
    if args.use_rs:
        high = args.rs_upper_bound if args.rs_upper_bound is not None else args.tis_clip
        low = args.rs_lower_bound if args.rs_lower_bound is not None else (1.0 / high if high > 0 else 0.0)
        if high <= 0 or low >= high:
            raise SlimeLiteError(f"--use-rs keeps ratios in [--rs-lower-bound, --rs-upper-bound] = [{low:g}, "
                                 f"{high:g}]: the lower bound must be below the upper one (an upper bound > 1 "
                                 "when the lower one is its default 1/upper).")
        if args.rs_veto_threshold is not None and not 0 < args.rs_veto_threshold < 1:
            raise SlimeLiteError(f"--rs-veto-threshold {args.rs_veto_threshold} must be in (0, 1), e.g. 1e-4.")
    if args.get_mismatch_metrics:
        if not args.mismatch_ratio_bound > 1:
            raise SlimeLiteError(f"--mismatch-ratio-bound {args.mismatch_ratio_bound} must be > 1 (ratios outside "
                                 "[1/c, c] are counted).")
        if args.mismatch_top_k < 0:
            raise SlimeLiteError(f"--mismatch-top-k {args.mismatch_top_k} must be >= 0.")
    on = [f for f in ("use_tis", "use_rs", "get_mismatch_metrics") if getattr(args, f)]
    if on and args.debug_rollout_only:
        raise SlimeLiteError(f"--{on[0].replace('_', '-')} needs the trainer's log-probs; --debug-rollout-only "
                             "trains nothing. Drop one of them.")


def check_external_engines(args: argparse.Namespace) -> None:
    """Each --rollout-external-engine-addrs entry is host:port or a URL (else it was found out after the trainer was
    built, as an engine that does not answer)."""
    for address in (args.rollout_external_engine_addrs or "").split(","):
        if args.rollout_external_engine_addrs and not re.fullmatch(r"\s*(\w+://\S+|\S+:\d+/?)\s*", address):
            raise SlimeLiteError(f"--rollout-external-engine-addrs {args.rollout_external_engine_addrs}: {address!r} "
                                 "is not host:port (or a URL such as http://host:port); separate engines by commas.")


def check_fault_tolerance(args: argparse.Namespace) -> None:
    """--use-fault-tolerance restarts engines this job started; --debug-inject-fault kill-engine kills one."""
    for flag, on in (("--use-fault-tolerance", args.use_fault_tolerance),
                     ("--debug-inject-fault kill-engine", args.debug_inject_fault == "kill-engine")):
        if on and args.rollout_external_engine_addrs:
            raise SlimeLiteError(
                f"{flag} needs engines this job starts: the servers of --rollout-external-engine-addrs are not "
                "restarted (or killed) by slime-lite. Drop one of the two, and keep external servers up yourself.")
        if on and args.debug_train_only:
            raise SlimeLiteError(f"{flag} acts on rollout engines, and --debug-train-only / "
                                 "--load-debug-rollout-data start none: drop it.")


def check_debug_tool_args(args: Any) -> None:
    """Grad-norm regression (--ci-save-grad-norm, --ci-load-grad-norm), profiling and memory snapshots: each
    needs the part of the run it reads (trainer, engines) and a window that exists."""

    grad = [f for f in ("ci_save_grad_norm", "ci_load_grad_norm") if getattr(args, f)]
    if grad and args.debug_rollout_only:
        raise SlimeLiteError(f"--{grad[0].replace('_', '-')} records training steps; --debug-rollout-only trains "
                             "nothing. Drop one of them.")
    if args.ci_save_grad_norm and args.ci_save_grad_norm == args.ci_load_grad_norm:
        raise SlimeLiteError("--ci-save-grad-norm and --ci-load-grad-norm name the same file: the run would check "
                             "against what it is writing. Give the saved run's file to --ci-load-grad-norm only.")
    if args.ci_grad_norm_rtol is not None and not args.ci_load_grad_norm:
        raise SlimeLiteError("--ci-grad-norm-rtol has no effect without --ci-load-grad-norm: add it or drop the flag.")
    targets = profile_targets(args)
    if "train" in targets and args.debug_rollout_only:
        raise SlimeLiteError("--profile-target train: --debug-rollout-only starts no trainer. Profile 'rollout'.")
    if "rollout" in targets and args.debug_train_only:
        raise SlimeLiteError("--profile-target rollout: --debug-train-only / --load-debug-rollout-data start no "
                             "engine. Profile 'train'.")
    if targets - {"driver"}:
        start, end = args.profile_step_start, args.profile_step_end
        if not 0 <= start < end:
            raise SlimeLiteError(f"--profile-step-start {start} and --profile-step-end {end}: need 0 <= start < end "
                                 "(rollout ids start..end-1 are profiled).")
        if start >= args.num_rollout:
            raise SlimeLiteError(f"--profile-step-start {start} is past the last rollout (--num-rollout "
                                 f"{args.num_rollout}): nothing would be profiled.")
    if args.record_memory_history:
        if args.debug_rollout_only:
            raise SlimeLiteError("--record-memory-history records the train workers; --debug-rollout-only starts "
                                 "none.")
        if args.memory_snapshot_num_steps > args.num_rollout:
            raise SlimeLiteError(f"--memory-snapshot-num-steps {args.memory_snapshot_num_steps} is more than "
                                 f"--num-rollout {args.num_rollout}: no snapshot would be written.")
    if args.deterministic_mode and args.custom_generate_function_path:
        log.warning("--deterministic-mode with --custom-generate-function-path: the hook's requests go to the "
                    "engines concurrently, so their batches (and log-probs) may differ between runs")
    if args.check_weight_update_equal and args.rollout_backend == "sglang":
        raise SlimeLiteError("--check-weight-update-equal reads each engine's /get_weights_checksum, which only the "
                             "embedded engine has (an SGLang server hashes its own fused, sharded tensors): drop it "
                             "with --rollout-backend sglang, or check the push with --rollout-backend embedded.")
    if (args.deterministic_mode and args.rollout_backend == "sglang"
            and "enable-deterministic-inference" not in [x.lstrip("-") for x in args.sglang_args]):
        log.warning("--deterministic-mode with SGLang engines: add --sglang-enable-deterministic-inference (and a "
                    "deterministic attention backend) for reproducible rollouts")
