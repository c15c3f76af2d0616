"""The trainer's flags and their rules (DP and batch sizes, the CPU optimizer offload, packed micro-batch budgets,
LoRA, the estimator's needs; the model's TP/PP/EP layout is args_layout.py's), checked before anything starts unless
the run trains nothing. The flag rules of the whole run are in args_check.py."""

from __future__ import annotations

import argparse
import logging
import os
import re

from slime_lite import rl_math
from slime_lite.args_async import offload_rollout_flag
from slime_lite.args_layout import check_experts, check_model_split, world_size
from slime_lite.backends.megatron.lora_config import check_lora_args
from slime_lite.config import RolloutSideConfig, TokenBudget, has_reference_model, periodic
from slime_lite.errors import SlimeLiteError
from slime_lite.flag_types import nonneg_float, positive_int, unit_float
from slime_lite.io import foreign_entry, within
from slime_lite.model_families import read_config
from slime_lite.rollout.data import data_file

log = logging.getLogger("slime_lite.args")


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """The trainer's flag groups: Megatron's training and parallelism, LoRA."""
    g = p.add_argument_group("Megatron training and parallelism")
    g.add_argument("--tensor-model-parallel-size", type=positive_int, default=1,
                   help="Megatron tensor-parallel size (default: %(default)s)")
    g.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1,
                   help="Megatron pipeline-parallel size (default: %(default)s)")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                   help="Megatron transformer implementation (default: %(default)s)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="activation recompute (Megatron's): full re-runs whole transformer layers in the backward "
                        "pass (needs --recompute-method and --recompute-num-layers); selective only the core "
                        "attention (default: none)")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="with --recompute-granularity full: uniform recomputes every chunk of "
                        "--recompute-num-layers layers; block the first --recompute-num-layers layers of each "
                        "pipeline stage")
    g.add_argument("--recompute-num-layers", type=positive_int, default=None,
                   help="layers per recomputed chunk (uniform) or recomputed layers per pipeline stage (block)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism: norms and residuals split along the sequence over the "
                        "tensor-parallel ranks (less activation memory; ignored with a warning at "
                        "--tensor-model-parallel-size 1, as in Megatron)")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="Megatron's hybrid CPU optimizer (CUDA only): the Adam state and float32 master weights live "
                        "in host memory and the optimizer step runs on the CPU (less GPU memory, slower steps); "
                        "needs --use-precision-aware-optimizer, as in Megatron")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="with --optimizer-cpu-offload: the share of the optimizer state kept on the CPU "
                        "(default: %(default)s)")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                   help="with --optimizer-cpu-offload: overlap the gradient and parameter copies between GPU and "
                        "CPU with the CPU optimizer step")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Megatron's precision-aware optimizer path (the distributed optimizer, decoupled gradients); "
                        "with --optimizer-cpu-offload only (on its own it needs Transformer Engine's FusedAdam)")
    g.add_argument("--expert-model-parallel-size", type=positive_int, default=1,
                   help="MoE models: experts split over this many ranks (must divide num_experts; default: "
                        "%(default)s)")
    g.add_argument("--expert-tensor-parallel-size", type=positive_int, default=None,
                   help="MoE models: each expert's weights split over this many ranks (default: "
                        "--tensor-model-parallel-size)")
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="alltoall",
                   help="MoE models: how tokens reach the experts' ranks (Megatron's dispatchers; default: "
                        "%(default)s)")
    g.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                   help="MoE models: the router's logits and softmax in this dtype (default: the model's)")
    g.add_argument("--moe-aux-loss-coeff", type=nonneg_float, default=0.0,
                   help="MoE models: weight of Megatron's load-balancing loss (aux_loss) in the loss; 0 turns it "
                        "off (default: %(default)s)")
    g.add_argument("--moe-z-loss-coeff", type=nonneg_float, default=None,
                   help="MoE models: weight of the router z-loss (mean squared log-sum-exp of the router logits)")
    g.add_argument("--use-routing-replay", action="store_true",
                   help="MoE models (slime's routing replay, R2): the trainer records the experts its old-policy "
                        "log-prob pass chose for every token and replays them in the training forward and backward "
                        "passes, so the PPO ratio's two sides use the same experts; train/routing_replay_mismatch: the "
                        "share the updated weights would have routed elsewhere (with "
                        "--use-rollout-routing-replay the engine's experts are replayed instead)")
    g.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="MoE models (slime's R3): the engine returns the experts it chose for every token "
                        "(return_routed_experts), samples keep them (rollout_routed_experts) and the trainer's "
                        "routers replay them in the forward and backward passes; train/routing_mismatch reports "
                        "the share of (token, layer) pairs the trainer would have routed otherwise")
    g.add_argument("--balance-data", action="store_true",
                   help="deal each step's samples (with --use-dynamic-batch-size: its packed micro-batches) to the "
                        "data-parallel ranks in equal counts balanced by estimated FLOPs, L * (1 + L / (6 * "
                        "hidden)) for a sample of L tokens (default: in order)")
    g.add_argument("--bf16", action="store_true", help="train in bfloat16 (default: float32)")
    g.add_argument("--lr", type=nonneg_float, default=1e-6, help="actor learning rate (default: %(default)s)")
    g.add_argument("--critic-lr", type=nonneg_float, default=None, help="critic learning rate (default: --lr)")
    g.add_argument("--weight-decay", type=nonneg_float, default=0.01,
                   help="AdamW (decoupled) weight decay; biases and 1-D weights (the norms) are not decayed, as in "
                        "Megatron (default: %(default)s, Megatron's, which slime keeps)")
    g.add_argument("--clip-grad", type=nonneg_float, default=1.0,
                   help="clip the global gradient norm to this value (default: %(default)s)")
    g.add_argument("--adam-beta1", type=unit_float, default=0.9, help="Adam beta1 (default: %(default)s)")
    g.add_argument("--adam-beta2", type=unit_float, default=0.999,
                   help="Adam beta2 (default: %(default)s, Megatron's, which slime keeps; its scripts pass 0.98)")
    g.add_argument("--seed", type=int, default=1234, help="trainer random seed (default: %(default)s)")
    g.add_argument("--distributed-timeout-minutes", type=positive_int, default=30,
                   help="timeout of the train ranks' process group (torch.distributed) in minutes (default: "
                        "%(default)s; slime's is 10)")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bitwise-reproducible runs: deterministic torch algorithms in trainer and engines, each "
                        "rollout sent to the engines in one fixed order, no wall-clock values in dumps (two runs "
                        "with the same seeds give identical metrics and dumps on CPU; GPU: BENCHMARKS.md)")
    g.add_argument("--update-weight-transport", choices=("tensor", "distributed", "disk"), default="tensor",
                   help="how new weights reach the engines: HTTP tensors, a torch.distributed broadcast, or files "
                        "(default: %(default)s)")
    g.add_argument("--update-weight-buffer-size", type=positive_int, default=512 * 1024**2,
                   help="bytes of weights per bucket of a tensor or distributed push (default: %(default)s)")

    g = p.add_argument_group("LoRA", "low-rank adapters on a frozen base model (the reference model is the base)")
    g.add_argument("--lora-rank", type=int, default=None,
                   help="train LoRA adapters of this rank instead of every weight (default: off)")
    g.add_argument("--lora-alpha", type=float, default=None,
                   help="LoRA alpha: the adapters are scaled by alpha/rank (default: the rank, scaling 1)")
    g.add_argument("--lora-dropout", type=float, default=0.0,
                   help="dropout on the adapters' input (default: %(default)s)")
    g.add_argument("--lora-target-modules", nargs="+", default=["all-linear"],
                   help="linears that get adapters: all-linear, or HF names q_proj,k_proj,v_proj (Megatron's fused "
                        "linear_qkv), o_proj (linear_proj), gate_proj,up_proj (linear_fc1; GLM4: gate_up_proj), "
                        "down_proj (linear_fc2), or the Megatron names (default: all-linear)")
    g.add_argument("--lora-adapter-path", default=None,
                   help="PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start the "
                        "adapters from, on the --hf-checkpoint base")
    g = p.add_argument_group("frozen parameters (slime's flags)", "Python regexes searched in the Megatron "
                             "parameter names (e.g. embedding, output_layer, decoder.layers.3.mlp), actor and critic")
    g.add_argument("--only-train-params-name-list", nargs="*", default=None, metavar="REGEX",
                   help="train only the parameters whose name one pattern matches; the others are frozen")
    g.add_argument("--freeze-params-name-list", nargs="*", default=None, metavar="REGEX",
                   help="freeze the parameters whose name one pattern matches; the others train")

    g = p.add_argument_group("checkpoints, reference model and weight pushes (slime's flags)")
    g.add_argument("--no-save-optim", action="store_true",
                   help="checkpoints without the optimizer state (Adam moments; smaller files). As in slime, such a "
                        "checkpoint cannot resume training: --load refuses it (start from its hf/ export with "
                        "--hf-checkpoint instead, with a fresh optimizer)")
    g.add_argument("--save-hf", default=None, metavar="PATH",
                   help="at each checkpoint (--save-interval) also write the actor as a Hugging Face model folder "
                        "to PATH.format(rollout_id=i), e.g. /out/hf_{rollout_id} (with --lora-rank: the adapters "
                        "merged into the base weights), in the training dtype, which its config.json states: a run "
                        "without --bf16 writes float32, which SGLang and vLLM serve as float16 by default (dtype "
                        "auto); serve it with dtype bfloat16 as a bfloat16 base was")
    g.add_argument("--reset-optimizer-states", action="store_true",
                   help="clear the optimizer's state (Adam moments and step count) before each rollout's training "
                        "(as slime), so every rollout starts with a fresh Adam")
    g.add_argument("--ref-update-interval", type=positive_int, default=None, metavar="N",
                   help="every N rollouts the reference model's weights become the actor's current ones (after the "
                        "training of rollouts N-1, 2N-1, ...; saved with checkpoints); needs a reference model "
                        "(--use-kl-loss, --kl-coef or --ref-load) (default: the reference never changes)")
    g.add_argument("--update-weights-interval", type=positive_int, default=1, metavar="N",
                   help="push the trainer's weights to the engines after every N-th rollout (and always before an "
                        "eval), so the rollouts between pushes are generated with older weights; synchronous "
                        "training on engines of their own only (default: %(default)s, every rollout)")

    g = p.add_argument_group("algorithm hooks (slime's trainer-side hooks)",
                             "module.fn paths called by the trainer with slime's signatures, checked before Ray "
                             "starts; per-sample values are lists of per-token tensors under slime's key names")
    g.add_argument("--custom-advantage-function-path", default=None, metavar="MODULE.FN",
                   help="advantage(args, rollout_data) -> None replaces --advantage-estimator's advantages: it sets "
                        "rollout_data['advantages'] and rollout_data['returns'] (one tensor per sample, as long as "
                        "its response; the returns train the critic). rollout_data holds the whole rollout (slime: "
                        "one data-parallel rank's share): tokens, total_lengths, response_lengths, loss_masks, "
                        "rewards (normalised as slime's rollout manager does for GRPO / REINFORCE++-baseline), "
                        "raw_reward, log_probs, kl, and ref_log_probs, values, rollout_log_probs when there are "
                        "any; --normalize-advantages then whitens the advantages")
    g.add_argument("--custom-loss-function-path", default=None, metavar="MODULE.FN",
                   help="with --loss-type custom_loss: loss(args, batch, logits, sum_of_sample_mean) -> (loss, "
                        "metrics) is the whole policy loss of a micro-batch. batch: the micro-batch's "
                        "unconcat_tokens, total_lengths, response_lengths, loss_masks, log_probs (old), advantages, "
                        "returns, ref_log_probs / rollout_log_probs / values when there are any, and (slime-lite's, "
                        "for slime's log-prob helpers) cur_log_probs and entropy of the current policy, "
                        "differentiable; logits: the model output of the micro-batch (padded rows, or one packed "
                        "row; a vocabulary slice per tensor-parallel rank); sum_of_sample_mean(x) sums the "
                        "samples' masked token means of a flat per-token x (per token with "
                        "--calculate-per-token-loss); the loss and metrics are divided by the step's samples (or "
                        "tokens) per data-parallel rank, as in slime")
    g.add_argument("--custom-pg-loss-reducer-function-path", default=None, metavar="MODULE.FN",
                   help="get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) "
                        "-> reducer, per micro-batch: reducer(pg_loss) replaces the reduction of the policy-gradient "
                        "term of the policy loss only (e.g. Dr.GRPO's constant divisor); loss_masks without the "
                        "tokens --use-rs / --tis-mode mask rejected; the KL, entropy and metrics keep the default")



def _check_frozen(args: argparse.Namespace) -> None:
    """--only-train-params-name-list / --freeze-params-name-list: one of them, valid regexes, no LoRA."""
    given = [f for f in ("only_train_params_name_list", "freeze_params_name_list") if getattr(args, f)]
    names = " and ".join("--" + f.replace("_", "-") for f in given)
    if len(given) == 2:
        raise SlimeLiteError(f"{names}: give one of them (as slime).")
    if given and args.lora_rank:
        raise SlimeLiteError(f"{names} with --lora-rank: LoRA freezes the base itself and trains the adapters "
                             "(--lora-target-modules picks the linears); drop one of them.")
    for pattern in getattr(args, given[0]) if given else []:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise SlimeLiteError(f"{names} {pattern!r} is not a Python regex ({exc}).") from None


def check_slime_train_flags(args: argparse.Namespace) -> None:
    """--save-hf, --ref-update-interval, --reset-optimizer-states and --update-weights-interval: each needs what it
    acts on, and the pushes may be spaced out only where the engines keep their weights between pushes."""
    if args.save_hf is not None:
        if args.save_interval is None:
            raise SlimeLiteError("--save-hf writes a Hugging Face model at each checkpoint: add --save DIR and "
                                 "--save-interval N, or drop --save-hf.")
        try:
            first = args.save_hf.format(rollout_id=0)
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
            raise SlimeLiteError(f"--save-hf {args.save_hf}: the only placeholder it takes is {{rollout_id}} "
                                 f"({type(exc).__name__}: {exc}).") from None
        _check_save_hf_apart(args, first)
    if args.ref_update_interval and not has_reference_model(args):
        raise SlimeLiteError("--ref-update-interval updates the reference model, and this run keeps none (no "
                             "--use-kl-loss, --kl-coef or --ref-load): add a KL term or drop the flag.")
    if args.ref_update_interval and args.lora_rank:
        raise SlimeLiteError("--ref-update-interval with --lora-rank is not supported: the reference is the base "
                             "model without the adapters, which never changes. Drop one of them.")
    _check_frozen(args)
    if args.reset_optimizer_states and args.optimizer_cpu_offload:
        raise SlimeLiteError("--reset-optimizer-states with --optimizer-cpu-offload is not supported (the hybrid CPU "
                             "optimizer keeps copies of its state); drop one of them.")
    custom = args.loss_type == "custom_loss"
    if custom and not args.custom_loss_function_path:
        raise SlimeLiteError("--loss-type custom_loss takes its loss from --custom-loss-function-path MODULE.FN: "
                             "add it, or choose another --loss-type.")
    if args.custom_loss_function_path and not custom:
        log.warning("--custom-loss-function-path is used with --loss-type custom_loss only (as in slime): this run's "
                    "loss is --loss-type %s", args.loss_type)
    n = args.update_weights_interval
    if n == 1:
        return
    refuse = None
    if args.async_train or args.fully_async:
        refuse = (f"--{'async' if args.async_train else 'fully-async'} already generates with older weights on its "
                  "own schedule (and checks that lag): drop one of them")
    elif args.colocate or args.offload_rollout:
        refuse = (f"{'--colocate' if args.colocate else offload_rollout_flag(args)} releases the engines' weights "
                  "while the trainer trains, and only a push gives them back: drop one of them")
    elif args.use_fault_tolerance:
        refuse = ("--use-fault-tolerance gives a restarted engine the trainer's current weights, which the other "
                  "engines do not serve between pushes: drop one of them")
    if refuse:
        raise SlimeLiteError(f"--update-weights-interval {n}: {refuse}.")
    pushes = RolloutSideConfig.from_args(args)
    between = [r for r in range(args.num_rollout) if not pushes.pushes_after(r) and periodic(
        r, args.save_interval, args.num_rollout, args.num_rollout_per_epoch)]  # (epoch ends and the last one too)
    if between:
        log.warning("--update-weights-interval %d: the checkpoints after rollouts %s fall between two pushes, and a "
                    "run resumed from one pushes at once: its next rollouts are generated with newer weights than the "
                    "run it continues (make --save-interval, the rollouts per epoch and --num-rollout multiples of "
                    "%d to resume exactly)", n, ", ".join(map(str, between[:5])) + (" ..." if len(between) > 5 else ""),
                    n)


def _check_save_hf_apart(args: argparse.Namespace, first: str) -> None:
    """Each --save-hf export replaces its folder: no export may be, or hold, a path the run reads or writes
    otherwise (the models it starts from, its checkpoints, data, metrics and dumps), and an existing export folder
    may hold only the files an export writes (an earlier export's); every save point's folder is checked."""
    saves = [i for i in range(args.num_rollout)
             if periodic(i, args.save_interval, args.num_rollout, args.num_rollout_per_epoch)]
    exports = {os.path.realpath(args.save_hf.format(rollout_id=i)) for i in saves} | {os.path.realpath(first)}
    used = [(f"--{flag.replace('_', '-')}", getattr(args, flag)) for flag in  # the models first
            ("hf_checkpoint", "ref_load", "lora_adapter_path", "load", "save", "prompt_data", "metrics_path",
             "dump_details")]
    used = [(flag, data_file(v) if flag == "--prompt-data" and v else v) for flag, v in used]  # PATH of PATH@[a:b]
    used += [("--eval-prompt-data", data_file(path)) for path in (args.eval_prompt_data or [])[1::2]]
    for flag in ("save_debug_rollout_data", "save_debug_train_data"):
        try:  # the folder of its first file (a template that does not format is refused by its own check)
            first_dump = getattr(args, flag) and getattr(args, flag).format(rollout_id=0, rank=0)
        except (KeyError, IndexError, ValueError, AttributeError):
            first_dump = None
        if first_dump:
            used.append((f"--{flag.replace('_', '-')}", os.path.dirname(os.path.abspath(first_dump))))
    for flag, value in used:
        hit = next((x for x in sorted(exports) if value and within(value, x)), None)
        if hit is not None:
            raise SlimeLiteError(
                f"--save-hf {args.save_hf} writes {hit}, which is or holds {flag} {value}: each export replaces its "
                "folder, deleting what is there; give --save-hf a folder of its own (e.g. beside --save).")
    strays = [(x, foreign_entry(x, args.hf_checkpoint)) for x in sorted(exports) if os.path.isdir(args.hf_checkpoint)]
    for folder, stray in (x for x in strays if x[1] is not None):
        raise SlimeLiteError(f"--save-hf {args.save_hf} replaces {folder} at a save point, and it holds {stray}, "
                             "which no export writes (the folder is not an earlier export): move that away, or give "
                             "--save-hf a folder of its own.")


def check_optimizer_offload(args: argparse.Namespace) -> None:
    """--optimizer-cpu-offload and its companions, with Megatron's rules (the CUDA check is preflight's)."""
    off, overlap, aware = args.optimizer_cpu_offload, args.overlap_cpu_optimizer_d2h_h2d, \
        args.use_precision_aware_optimizer
    if overlap and not off:
        raise SlimeLiteError("--overlap-cpu-optimizer-d2h-h2d overlaps the copies of the CPU optimizer step; it needs "
                             "--optimizer-cpu-offload (add it or drop the flag).")
    if aware and not off:
        raise SlimeLiteError("--use-precision-aware-optimizer on its own needs Transformer Engine's FusedAdam, which "
                             "slime-lite does not use; it is supported with --optimizer-cpu-offload (add it, or drop "
                             "the flag).")
    if off and not aware:
        raise SlimeLiteError("--optimizer-cpu-offload runs Megatron's hybrid optimizer through the precision-aware "
                             "path, so Megatron requires --use-precision-aware-optimizer with it: add "
                             "--use-precision-aware-optimizer.")
    if off and not 0.0 < args.optimizer_offload_fraction <= 1.0:
        raise SlimeLiteError(f"--optimizer-offload-fraction {args.optimizer_offload_fraction}: the share of the "
                             "optimizer state on the CPU must be in (0, 1].")
    if off and args.lora_rank:
        raise SlimeLiteError("--optimizer-cpu-offload with --lora-rank is not supported (the adapters' optimizer "
                             "state is small: drop --optimizer-cpu-offload).")


def _check_dynamic_batch(args: argparse.Namespace, dp: int, pp: int) -> None:
    """--use-dynamic-batch-size and its token budgets (config.TokenBudget: the one rule for what fits)."""
    if not args.use_dynamic_batch_size:
        for flag in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu"):
            if getattr(args, flag) is not None:
                raise SlimeLiteError(f"--{flag.replace('_', '-')} is the token budget of packed micro-batches; it "
                                     "needs --use-dynamic-batch-size (or drop it and use --micro-batch-size).")
        return
    if args.max_tokens_per_gpu is None:
        raise SlimeLiteError("--use-dynamic-batch-size needs --max-tokens-per-gpu N (tokens per packed micro-batch).")
    if pp > 1:
        raise SlimeLiteError(f"--use-dynamic-batch-size does not work with --pipeline-model-parallel-size {pp} yet "
                             "(packed micro-batches of different lengths between stages); use PP 1 or "
                             "--micro-batch-size.")
    if not args.debug_train_only:  # a replay's samples are in its dumps: preflight logs the ones packed alone
        problem = TokenBudget.from_args(args).too_small_for(args.rollout_max_response_len)
        if problem:
            raise SlimeLiteError(problem)


def validate_rollout_only_args(args: argparse.Namespace) -> None:
    """--debug-rollout-only runs no trainer, but its engines serve the routing-replay and LoRA flags: checked as a
    training run checks them (else the engine fails after Ray starts, or serves the base model silently)."""
    if args.lora_adapter_path is not None:
        raise SlimeLiteError("--lora-adapter-path with --debug-rollout-only: the trainer loads the adapter and pushes "
                             "it to the engines, and this run has no trainer, so the engines would serve the base "
                             "model. Merge the adapter into --hf-checkpoint, or drop --debug-rollout-only.")
    cfg = read_config(args.hf_checkpoint)
    check_experts(args, cfg)
    check_lora_args(args, cfg)


def validate_train_args(args: argparse.Namespace) -> None:
    """Parallel sizes and batch sizes that must divide (trainer side)."""
    world = world_size(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    check_optimizer_offload(args)
    check_model_split(args, tp, pp)
    check_lora_args(args, read_config(args.hf_checkpoint))
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
    _check_dynamic_batch(args, dp, pp)
    micro = 1 if args.use_dynamic_batch_size else args.micro_batch_size
    if args.global_batch_size % (dp * micro):
        raise SlimeLiteError(
            f"--global-batch-size {args.global_batch_size} is not divisible by data-parallel size {dp} x "
            f"--micro-batch-size {micro}."
        )
    spec = rl_math.estimator(args.advantage_estimator)
    if spec.needs_critic and not args.debug_rollout_only:  # the critic's own GPUs: the same TP/PP and batch
        critic = args.critic_num_nodes * args.critic_num_gpus_per_node
        flags = (f"--critic-num-nodes x --critic-num-gpus-per-node = {critic} (the critic of --advantage-estimator "
                 f"{spec.name})")
        if critic % (tp * pp):
            raise SlimeLiteError(f"{flags} is not divisible by --tensor-model-parallel-size {tp} x "
                                 f"--pipeline-model-parallel-size {pp}.")
        if args.global_batch_size % (critic // (tp * pp) * micro):
            raise SlimeLiteError(f"--global-batch-size {args.global_batch_size} is not divisible by the critic's "
                                 f"data-parallel size {critic // (tp * pp)} ({flags}) x --micro-batch-size {micro}.")
    if spec.needs_groups and args.n_samples_per_prompt < 2:
        log.warning("--advantage-estimator %s compares the samples of a prompt: --n-samples-per-prompt 1 gives zero "
                    "advantages", spec.name)
    if args.kl_coef > 0 and args.kl_loss_coef > 0:
        raise SlimeLiteError(f"--kl-coef {args.kl_coef:g} and --kl-loss-coef {args.kl_loss_coef:g}: only one KL may "
                             "be set (as in slime): --kl-coef puts it in the reward, --use-kl-loss --kl-loss-coef in "
                             "the loss; both would count it twice.")
    if not spec.kl_in_reward and args.kl_coef > 0:
        log.warning("--kl-coef %g has no effect with --advantage-estimator %s (its KL goes into the loss: "
                    "--use-kl-loss --kl-loss-coef)", args.kl_coef, spec.name)
    if args.kl_loss_coef > 0 and not args.use_kl_loss:
        log.warning("--kl-loss-coef %g has no effect without --use-kl-loss (as in slime): add it, or drop the coef",
                    args.kl_loss_coef)
