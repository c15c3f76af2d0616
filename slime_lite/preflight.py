"""Checks that read or write files, run by the driver after the flags are valid and before Ray starts: the model's
architecture is one the trainer and the embedded engine build, every output location is created and probed for
writing, and every dump a replay will read is loaded and validated. A problem found here costs seconds; found
later it costs a rollout (or a whole run) and ends in a traceback."""

from __future__ import annotations

import logging
import os
from typing import Any

from slime_lite import rl_math
from slime_lite.args_layout import world_size
from slime_lite.backends.megatron.train_dump import train_dump_path
from slime_lite.checks.grad_norm import grad_norm_path
from slime_lite.config import TokenBudget, TrainSideConfig
from slime_lite.errors import SlimeLiteError
from slime_lite.hooks import DEFAULT_ROLLOUT_FUNCTION, REPLAY_HOOKS, SIGNATURES, TRAIN_HOOKS, load_hook
from slime_lite.io import probe_folder, within
from slime_lite.model_families import check_family, check_servable, check_trainable, num_experts, read_config
from slime_lite.profiling import profile_targets, trace_dir
from slime_lite.rollout.data import (RENDER_CHECKED, DataKeys, check_renders, data_file, drop_long_prompts,
                                     encode_prompt, read_prompts)
from slime_lite.rollout.dumps import dump_path
from slime_lite.rollout.rewards import check_data_labels, check_data_rm_types
from slime_lite.tokenizer import load_tokenizer, model_vocab_size, tokenizer_fingerprint
from slime_lite.types import routed_rows_fit, trajectory_ends

log = logging.getLogger("slime_lite.preflight")


def preflight(args: Any) -> None:
    check_hooks(args)
    check_model_family(args)
    check_prompt_data(args)
    check_train_only(args)
    check_outputs(args)
    check_profiling_device(args)
    check_grad_norm_file(args)
    if args.load and not args.debug_rollout_only:  # a corrupt or crafted checkpoint: refused before Ray starts
        from slime_lite.backends.megatron.checkpoint import check_loadable, iteration, latest  # torch: with --load

        check_loadable(args.load, TrainSideConfig.from_args(args).has_critic)
        done = latest(args.load)
        if done is not None and iteration(done) + 1 >= args.num_rollout:  # else the run would start, train nothing
            raise SlimeLiteError(f"--load {args.load}: its checkpoint {done} has trained rollouts up to "
                                 f"{iteration(done)}, and --num-rollout {args.num_rollout} ends there: nothing is "
                                 "left to train. Raise --num-rollout to train on, or give --load a folder of its own.")
    if args.load_debug_rollout_data:
        check_replay_dumps(args)
        check_replay_keeps_train_dumps(args)


def check_prompt_data(args: Any) -> None:
    """Every prompt file the run reads (--prompt-data, each --eval-prompt-data) parses, each row has a prompt, the
    labels and rm_type fields its rewards need, and renders as the flags say (the chat template, its kwargs, the
    row's tools): a bad row is named by file and line here, not after the trainer and the engines have started."""
    if args.debug_train_only:
        return
    sets = [("--prompt-data", args.prompt_data, DataKeys.from_args(args))] if args.prompt_data else []
    sets += [("--eval-prompt-data", path, DataKeys.from_args(args, evaluation=True))
             for path in (args.eval_prompt_data or [])[1::2]]
    tokenizer = load_tokenizer(args.hf_checkpoint) if sets else None
    for flag, path, keys in sets:
        where = f"{flag} {path}"
        prompts = read_prompts(path, keys, flag)
        check_data_rm_types(args, [p.metadata for p in prompts], where, eval_data=flag == "--eval-prompt-data")
        if args.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION and not args.custom_generate_function_path:
            check_data_labels(args, prompts, where, keys.label_flag)  # (a hook may score without the label)
        check_renders(prompts, tokenizer, args, where)
        limit, limit_flag = ((args.rollout_max_prompt_len, "--rollout-max-prompt-len") if flag == "--prompt-data"
                             else (args.eval_max_prompt_len, "--eval-max-prompt-len"))
        kept = drop_long_prompts(prompts, limit, tokenizer, args, f"{where} with {limit_flag}")  # none: an error
        function = args.rollout_function_path if flag == "--prompt-data" else (args.eval_function_path or
                                                                               args.rollout_function_path)
        if function == DEFAULT_ROLLOUT_FUNCTION and not args.custom_generate_function_path:  # (else: the hook's)
            response = (args.rollout_max_response_len, "--rollout-max-response-len") if flag == "--prompt-data" \
                else (args.eval_max_response_len, "--eval-max-response-len")
            check_prompts_fit(args, kept, tokenizer, where, response, limit_flag)


def check_prompts_fit(args: Any, prompts: list, tokenizer: Any, where: str, response: tuple[int | None, str],
                      limit_flag: str) -> None:
    """Where the embedded engine generates, each of the first ``RENDER_CHECKED`` prompts (as rendered) plus the
    response length fits the model's context (max_position_embeddings), as the engine (and SGLang) requires of a
    request, and fits a request's share of an --engine-kv-cache-tokens cache: else that prompt's requests are
    refused after the trainer and the engines started."""
    length, flag = response
    context = read_config(args.hf_checkpoint).get("max_position_embeddings")
    if args.rollout_backend != "embedded" or args.rollout_external_engine_addrs or not context or length is None:
        return
    kv, running = args.engine_kv_cache_tokens, args.engine_max_running_requests
    slot = min(context, kv // running) if kv and running else context  # a request's cache (the engine's slot)
    for p in prompts[:RENDER_CHECKED]:
        n = len(encode_prompt(p, tokenizer, args)[1])
        if n >= slot:  # (a response the slot cannot hold whole is cut short by the engine, with a warning)
            raise SlimeLiteError(
                f"{where}:{p.line}: the prompt is {n} tokens as rendered, and --engine-kv-cache-tokens {kv} over "
                f"--engine-max-running-requests {running} gives each request {slot} tokens of cache: the engine "
                "refuses it. Raise the cache or lower the running requests.")
        if n + length >= context:
            raise SlimeLiteError(
                f"{where}:{p.line}: the prompt is {n} tokens as rendered, and with {flag} {length} that is "
                f"{n + length} tokens, not below the model's context ({context}, max_position_embeddings of "
                f"--hf-checkpoint {args.hf_checkpoint}): lower {flag}"
                + (f", or leave such prompts out with {limit_flag} {context - 1 - length}." if context - 1 - length > 0
                   else "."))


def check_replay_keeps_train_dumps(args: Any) -> None:
    """A replay writes its train dumps where none is yet: one already there is most often the original run's (the
    train_data folder beside the rollout dumps replayed), which a replay is compared against."""
    if not args.save_debug_train_data:
        return
    for rollout_id in replay_ids(args):
        for rank in range(world_size(args)):
            path = train_dump_path(args.save_debug_train_data, rollout_id, rank)
            if os.path.exists(path):
                flag = (f"--dump-details {args.dump_details}" if args.dump_details
                        else f"--save-debug-train-data {args.save_debug_train_data}")
                raise SlimeLiteError(
                    f"{flag}: the replay would overwrite the train dump {path} (rollout {rollout_id}, rank {rank}), "
                    "e.g. the original run's, which the replay is compared against; give the replay a path of its "
                    "own, or move the file away.")


def check_train_only(args: Any) -> None:
    """--debug-train-only starts no engine, so its rollouts come from dumps: without --load-debug-rollout-data the
    run would build the trainer and stop at rollout 0 ("no engines to generate from")."""
    if args.debug_train_only and not args.load_debug_rollout_data:
        raise SlimeLiteError(
            "--debug-train-only starts no engine, so there is nothing to train on without the rollouts of a "
            "--save-debug-rollout-data run: add --load-debug-rollout-data 'DIR/data_{rollout_id}.pt' (it turns "
            "--debug-train-only on by itself), or drop --debug-train-only to generate rollouts.")


def check_hooks(args: Any) -> None:
    """Every ``--*-path`` hook the run will call imports and takes the arguments it is called with (else a
    SlimeLiteError naming the flag, the module and the signature expected), before Ray starts; a replay calls only
    the rollout manager's (``REPLAY_HOOKS``) and the trainer's (``TRAIN_HOOKS``), --debug-rollout-only no trainer's."""
    replay = args.debug_train_only or args.load_debug_rollout_data
    for flag in SIGNATURES:
        path = getattr(args, flag.lstrip("-").replace("-", "_"))
        called = not args.debug_rollout_only if flag in TRAIN_HOOKS else (not replay or flag in REPLAY_HOOKS)
        if path and called:
            load_hook(path, flag)


def check_model_family(args: Any) -> None:
    """--hf-checkpoint's architecture is one the Megatron trainer builds (unless --debug-rollout-only) and the
    embedded engine serves (when it rolls out): else a SlimeLiteError naming the architecture and the supported
    ones; and no config field the trainer cannot build (a trainer run) or the engine cannot serve (sliding windows,
    length-dependent RoPE)."""
    sides = []
    if not args.debug_rollout_only:
        sides.append("the Megatron trainer cannot build it")
    serves = args.rollout_backend == "embedded" and not args.debug_train_only and not args.rollout_external_engine_addrs
    if serves:
        sides.append("the embedded engine cannot serve it (--rollout-backend sglang can)")
    if not sides:
        return
    files = os.listdir(args.hf_checkpoint)
    if not any(f.endswith(".safetensors") for f in files) and (not args.debug_rollout_only or not any(
            f.startswith("pytorch_model") and f.endswith(".bin") for f in files)):
        raise SlimeLiteError(f"--hf-checkpoint {args.hf_checkpoint} holds no weights (*.safetensors"
                             f"{'' if not args.debug_rollout_only else ' or pytorch_model*.bin'}): give the folder "
                             "the model was saved to (save_pretrained writes config.json and the weights).")
    path = os.path.join(args.hf_checkpoint, "config.json")
    cfg = read_config(args.hf_checkpoint)
    check_generation_limits(args, cfg)
    check_family(cfg, f"--hf-checkpoint {path}", "; ".join(sides))
    if not args.debug_rollout_only:
        check_trainable(cfg, f"--hf-checkpoint {path}")
    if serves:
        check_servable(cfg, f"--hf-checkpoint {path}", "use --rollout-backend sglang")


def check_generation_limits(args: Any, cfg: dict[str, Any]) -> None:
    """Stop token ids inside the vocabulary and, where the embedded engine generates, a response length its context
    (config.json's max_position_embeddings) holds with a prompt token; else every request would be refused (HTTP
    400) after the trainer and the engines started."""
    if args.debug_train_only:
        return
    context, vocab = cfg.get("max_position_embeddings"), cfg.get("vocab_size")
    embedded = args.rollout_backend == "embedded" and not args.rollout_external_engine_addrs
    for flag, value in (("--rollout-max-response-len", args.rollout_max_response_len),
                        ("--eval-max-response-len", args.eval_max_response_len)):
        if embedded and context and value is not None and value >= context:
            raise SlimeLiteError(f"{flag} {value}: the model's context ({context} tokens, max_position_embeddings "
                                 f"of --hf-checkpoint {args.hf_checkpoint}) holds no prompt with such a response; "
                                 f"give at most {context - 1} (minus the longest prompt).")
    bad = [t for t in (args.rollout_stop_token_ids or []) if vocab and t >= vocab]
    if bad:
        raise SlimeLiteError(f"--rollout-stop-token-ids {' '.join(map(str, bad))}: outside the model's vocabulary "
                             f"(vocab_size {vocab} in --hf-checkpoint {args.hf_checkpoint}'s config.json).")


def output_folders(args: Any) -> list[tuple[str, str]]:
    """(flag and its value, folder) for every location this run writes to."""

    out = []
    if args.save:
        out.append((f"--save {args.save}", args.save))
    if args.save_hf:  # the folder that holds the HF exports (each is written beside it, then renamed)
        out.append((f"--save-hf {args.save_hf}", os.path.dirname(os.path.abspath(args.save_hf.format(rollout_id=0)))))
    if args.save_debug_rollout_data:  # eval dumps share the train dumps' folder
        flag = f"--dump-details {args.dump_details}" if args.dump_details else \
            f"--save-debug-rollout-data {args.save_debug_rollout_data}"
        out.append((flag, os.path.dirname(os.path.abspath(dump_path(args.save_debug_rollout_data, 0)))))
    if args.dump_details:
        out.append((f"--dump-details {args.dump_details}", args.dump_details))
        if not args.debug_rollout_only:
            out.append((f"--dump-details {args.dump_details}", os.path.join(args.dump_details, "train_data")))
        if args.get_mismatch_metrics:
            out.append((f"--dump-details {args.dump_details}", os.path.join(args.dump_details, "mismatch")))
    if args.save_debug_train_data:  # after --dump-details: it may have set this flag

        flag = f"--save-debug-train-data {args.save_debug_train_data}"
        folders = {os.path.dirname(os.path.abspath(train_dump_path(args.save_debug_train_data, 0, rank)))
                   for rank in range(world_size(args))}  # {rank} may name a folder
        out += [(flag, folder) for folder in sorted(folders)]
    if args.metrics_path:
        out.append((f"--metrics-path {args.metrics_path}", os.path.dirname(os.path.abspath(args.metrics_path))))
    if args.use_tensorboard:
        folder = args.tensorboard_dir or os.path.join(args.save or ".", "tensorboard")
        out.append((f"--tensorboard-dir {folder}" if args.tensorboard_dir else "--use-tensorboard", folder))
    if args.use_wandb and args.wandb_dir:
        out.append((f"--wandb-dir {args.wandb_dir}", args.wandb_dir))
    if profile_targets(args):
        folder = trace_dir(args)
        out.append((f"--tensorboard-dir {folder}" if args.tensorboard_dir else "--profile-target", folder))
    if args.record_memory_history:
        out.append((f"--memory-snapshot-dir {args.memory_snapshot_dir}", args.memory_snapshot_dir))
    if args.ci_save_grad_norm:
        path = grad_norm_path(args.ci_save_grad_norm, "actor", 0, 0)
        out.append((f"--ci-save-grad-norm {args.ci_save_grad_norm}", os.path.dirname(os.path.abspath(path))))
    return out


def check_outputs(args: Any) -> None:
    """Create every output folder and write a probe file in it: SlimeLiteError naming the flag and the path."""

    for flag, folder in output_folders(args):
        probe_folder(folder, flag)
    if args.metrics_path and os.path.isdir(args.metrics_path):
        raise SlimeLiteError(f"--metrics-path {args.metrics_path} is a folder; give a file name, e.g. "
                             f"{os.path.join(args.metrics_path, 'metrics.jsonl')}.")
    if args.metrics_path and os.path.exists(args.metrics_path) and not os.access(args.metrics_path, os.W_OK):
        raise SlimeLiteError(f"--metrics-path {args.metrics_path} is not writable; choose another file.")
    if args.metrics_path:  # rows are appended to it: never to a file the run reads
        # the data files, and the model folders (an HF export copies their files)
        read = [("--prompt-data", args.prompt_data and data_file(args.prompt_data))]  # (PATH of PATH@[a:b])
        read += [("--eval-prompt-data", data_file(p)) for p in (args.eval_prompt_data or [])[1::2]]
        read += [(f"--{f.replace('_', '-')}", getattr(args, f)) for f in ("hf_checkpoint", "ref_load",
                                                                           "lora_adapter_path")]
        for flag, value in read:
            if value and within(args.metrics_path, value):
                raise SlimeLiteError(f"--metrics-path {args.metrics_path} is or lies inside {flag} {value}, which "
                                     "this run reads: metrics rows would be written into it; give another file.")


def check_grad_norm_file(args: Any) -> None:
    """--ci-load-grad-norm names a file that exists (a path with placeholders is checked step by step)."""
    path = args.ci_load_grad_norm
    if path and "{" not in path and not os.path.isfile(path):
        raise SlimeLiteError(f"--ci-load-grad-norm {path}: no such file (write it with --ci-save-grad-norm).")


def check_profiling_device(args: Any) -> None:
    """--record-memory-history and --optimizer-cpu-offload need CUDA: refused on a machine without it (not a silent
    no-op)."""
    wanted = [flag for flag, on in (("--record-memory-history", args.record_memory_history),
                                    ("--optimizer-cpu-offload", args.optimizer_cpu_offload and not
                                     args.debug_rollout_only)) if on]
    if not wanted:
        return
    import torch  # torch: only when asked about CUDA

    if torch.cuda.is_available():
        return
    if wanted[0] == "--record-memory-history":
        raise SlimeLiteError(
            "--record-memory-history records the CUDA allocator, and this machine has no CUDA device; drop the "
            "flag on CPU (each process's memory is in the metrics: perf/memory/*).")
    raise SlimeLiteError(
        "--optimizer-cpu-offload moves the optimizer state off the GPU into host memory (Megatron's hybrid CPU "
        "optimizer, which needs CUDA), and this machine has no CUDA device: on CPU the state is in host memory "
        "already. Drop --optimizer-cpu-offload, --overlap-cpu-optimizer-d2h-h2d and --use-precision-aware-optimizer.")


def replay_ids(args: Any) -> range:
    """The rollout ids a replay reads: from 0 (or the rollout after the checkpoint of --load) to --num-rollout."""
    start = 0
    if args.load is not None:  # megatron-core (seconds of imports): only for a replay with --load
        from slime_lite.backends.megatron.checkpoint import iteration, latest

        path = latest(args.load)
        start = iteration(path) + 1 if path else 0
    return range(start, args.num_rollout)


def check_replay_dumps(args: Any) -> None:
    """Every dump of the replay loads, has the schema and types of a Sample list, token ids inside the model's
    vocab, consistent lengths, finite rewards, samples that split into the run's steps, and was made with this
    run's settings. Errors name the file, the sample and the field."""
    # torch: only for a replay
    from slime_lite.rollout.dumps import (
        check_replay_meta,
        check_replay_samples,
        dump_path,
        group_problem,
        load_rollout_dump,
        make_meta,
        subsample_groups,
    )

    tokenizer = load_tokenizer(args.hf_checkpoint)
    expected = make_meta(args, tokenizer_fingerprint(tokenizer))
    vocab = model_vocab_size(args.hf_checkpoint) or len(tokenizer)
    ids = replay_ids(args)
    for rollout_id in ids:
        dump = load_rollout_dump(dump_path(args.load_debug_rollout_data, rollout_id))
        samples = dump.samples
        if args.load_debug_rollout_data_subsample is not None:
            samples = subsample_groups(samples, args.load_debug_rollout_data_subsample, args.n_samples_per_prompt)
        split = []
        # (a dump of split trajectories holds any count: the trainer trims it to whole steps, as it did live)
        if len(samples) % args.global_batch_size and len(trajectory_ends(samples)) == len(samples):
            kept = "" if len(samples) == len(dump.samples) else (
                f" ({len(samples)} kept by --load-debug-rollout-data-subsample "
                f"{args.load_debug_rollout_data_subsample})")
            split.append(f"its {len(dump.samples)} samples{kept} do not split into steps of --global-batch-size "
                         f"{args.global_batch_size} (use --rollout-batch-size x --n-samples-per-prompt as the dump "
                         "was made, or a --global-batch-size that divides it)")
        # as a generated rollout's groups (a dump is written before that check); not slime's dumps (no meta: their
        # settings are taken on trust), nor when a wrong count or --n-samples-per-prompt is named already
        made_with = (dump.meta or {}).get("n_samples_per_prompt")
        # (--custom-reward-post-process-path normalises the rewards itself: any groups)
        if rl_math.estimator(args.advantage_estimator).needs_groups and not split \
                and made_with == args.n_samples_per_prompt and not args.custom_reward_post_process_path:
            grouping = group_problem(dump.samples, args.n_samples_per_prompt, args.advantage_estimator)
            split += [grouping] if grouping else []
        check_replay_meta(dump, expected, split)  # every mismatched setting in one error
        check_replay_samples(dump, vocab, args.reward_key)
        check_token_budget(args, samples, dump.path)
        if args.use_rollout_routing_replay:
            check_routed_experts(args, samples, dump.path)
    log.info("replay: checked %d dump(s) of %s (rollouts %d..%d)", len(ids), args.load_debug_rollout_data,
             ids.start, ids.stop - 1)


def check_routed_experts(args: Any, samples: list, path: str) -> None:
    """--use-rollout-routing-replay: every sample holds the engine's routed experts of this model, SGLang's table
    ``[len(tokens) - 1, num_hidden_layers, num_experts_per_tok]`` of expert ids below the expert count (fewer rows
    where only untrained tokens follow: a multi-turn sample's last model call's table); a table of another model,
    or of other tokens, would route the trainer wrongly or fail inside a train step."""
    import torch  # torch: only for a replay

    bare = [s.index for s in samples if getattr(s, "rollout_routed_experts", None) is None]
    if bare:
        raise SlimeLiteError(f"--use-rollout-routing-replay: {path}: sample {bare[0]} (and {len(bare) - 1} "
                             "more) has no rollout_routed_experts (its engine did not return them); replay a "
                             "dump made with --use-rollout-routing-replay, or use --use-routing-replay, which "
                             "records the trainer's own routing instead.")
    cfg = read_config(args.hf_checkpoint)
    layers, top_k, experts = cfg.get("num_hidden_layers"), cfg.get("num_experts_per_tok"), num_experts(cfg)
    if not (layers and top_k and experts):  # not an MoE config: the flag checks refused the run already
        return
    for s in samples:
        want = (len(s.tokens) - 1) * layers * top_k
        try:
            table = torch.as_tensor(s.rollout_routed_experts).reshape(-1)
        except (TypeError, ValueError, RuntimeError):
            table = None
        problem = None
        if table is None or table.is_floating_point() or table.is_complex() or table.dtype == torch.bool:
            problem = "is not a table of expert ids"
        elif table.numel() != want and not (table.numel() % (layers * top_k) == 0
                                            and routed_rows_fit(s, table.numel() // (layers * top_k))):
            problem = (f"has {table.numel()} expert ids, expected {want} ((len(tokens) - 1) x {layers} layers x "
                       f"top-{top_k} of --hf-checkpoint)")
        elif table.numel() and (int(table.min()) < 0 or int(table.max()) >= experts):
            problem = f"holds expert ids outside 0..{experts - 1} (the model's num_experts)"
        if problem:
            raise SlimeLiteError(f"--use-rollout-routing-replay: {path}: sample {s.index}: rollout_routed_experts "
                                 f"{problem}: the dump was made with another model (or its tokens were changed "
                                 "after generation). Replay it with the model that generated it, or use "
                                 "--use-routing-replay, which records the trainer's own routing.")


def check_token_budget(args: Any, samples: list, path: str) -> None:
    """--use-dynamic-batch-size: a dumped sample longer than a budget is trained as the run that made the dump trained
    it, a micro-batch of its own (config.TokenBudget); logged here, before Ray starts."""
    budget = TokenBudget.from_args(args)
    lengths = [len(s.tokens) for s in samples]
    for log_probs in (False, True):
        alone = budget.alone(lengths, log_probs)
        if alone:
            log.info("rollout dump %s: %d sample(s) longer than %s (e.g. sample %d, %d tokens): each is a "
                     "micro-batch of its own", path, len(alone), budget.flags(log_probs), alone[0],
                     lengths[alone[0]])
