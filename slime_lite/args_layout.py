"""The model's layout against its config.json: the tensor/pipeline split of its heads, FFN and layers, activation
recompute per pipeline stage, and the expert-parallel layout and routing-replay flags of an MoE model. Checked before
anything starts (args_train.validate_train_args, and for --debug-rollout-only the expert and routing flags)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from slime_lite.errors import SlimeLiteError
from slime_lite.model_families import FAMILIES, moe_config, read_config

log = logging.getLogger("slime_lite.args")


def world_size(args: Any) -> int:
    return args.actor_num_nodes * args.actor_num_gpus_per_node


def check_model_split(args: argparse.Namespace, tp: int, pp: int) -> None:
    cfg = read_config(args.hf_checkpoint)
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads", heads)
    layers = cfg.get("num_hidden_layers")
    family = FAMILIES.get(cfg.get("model_type"))
    moe = moe_config(cfg, f"--hf-checkpoint {args.hf_checkpoint}") if family else None
    ffn = ("shared_expert_intermediate_size", moe.shared_expert_size) if moe else (
        "intermediate_size", cfg.get("intermediate_size"))  # the dense MLP's columns are split over TP too
    for what, value in (("num_attention_heads", heads), ("num_key_value_heads", kv), ffn):
        if value and value % tp:
            raise SlimeLiteError(f"--tensor-model-parallel-size {tp} must divide the model's {what} ({value}).")
    if layers and layers % pp:
        raise SlimeLiteError(
            f"--pipeline-model-parallel-size {pp} must divide the model's num_hidden_layers ({layers}).")
    check_recompute(args, layers // pp if layers else None)
    check_experts(args, cfg)


def check_experts(args: argparse.Namespace, cfg: dict) -> None:
    """The expert-parallel layout against config.json: EP and expert-TP only for an MoE model, EP dividing its
    experts and the ranks of a pipeline stage, expert-TP dividing each expert's FFN size, and sequence parallelism
    whenever TP > 1 (Megatron's MoE layers need it); --use-rollout-routing-replay only for an MoE model, and not
    with PP > 1 and activation recompute (a recomputed router would replay another micro-batch's experts)."""
    ep, etp, tp = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.tensor_model_parallel_size
    family = FAMILIES.get(cfg.get("model_type"))
    moe = moe_config(cfg, f"--hf-checkpoint {args.hf_checkpoint}") if family else None
    for flag, on in (("--use-rollout-routing-replay", args.use_rollout_routing_replay),
                     ("--use-routing-replay", args.use_routing_replay)):
        if on and moe is None and family is not None:
            raise SlimeLiteError(f"{flag}: the model ({cfg.get('model_type')}) has no experts to route; drop {flag} "
                                 f"(--hf-checkpoint {args.hf_checkpoint} is a dense model).")
    own = args.use_routing_replay and not args.use_rollout_routing_replay  # the trainer records its own routing
    if own and (tp > 1 or args.pipeline_model_parallel_size > 1):
        raise SlimeLiteError(f"--use-routing-replay records the routing on each rank and is supported with "
                             f"--tensor-model-parallel-size 1 and --pipeline-model-parallel-size 1 only (given "
                             f"{tp} and {args.pipeline_model_parallel_size}); use --expert-model-parallel-size "
                             "or data parallelism to spread the model, or --use-rollout-routing-replay.")
    if args.use_rollout_routing_replay and args.pipeline_model_parallel_size > 1 and args.recompute_granularity:
        raise SlimeLiteError(f"--use-rollout-routing-replay with --pipeline-model-parallel-size "
                             f"{args.pipeline_model_parallel_size} and --recompute-granularity "
                             f"{args.recompute_granularity} is not supported (the recomputed routers would replay "
                             "another micro-batch's experts); drop the recompute or use PP 1.")
    if moe is None:
        for flag, value in (("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
            if (value or 1) > 1 and family is not None:
                raise SlimeLiteError(f"{flag} {value}: the model ({cfg.get('model_type')}) has no experts; drop "
                                     f"{flag}.")
        for flag, value in (("--moe-aux-loss-coeff", args.moe_aux_loss_coeff or None),
                            ("--moe-z-loss-coeff", args.moe_z_loss_coeff),
                            ("--moe-router-dtype", args.moe_router_dtype)):
            if value is not None and family is not None:  # a dense model has no router: the flag would do nothing
                raise SlimeLiteError(f"{flag} {value}: the model ({cfg.get('model_type')}) has no experts, so no "
                                     f"router; drop {flag}.")
        return
    if moe.num_experts % ep:
        raise SlimeLiteError(f"--expert-model-parallel-size {ep} must divide the model's num_experts "
                             f"({moe.num_experts}); pick a divisor of {moe.num_experts}.")
    etp = tp if etp is None else etp
    if moe.ffn_hidden_size % etp:
        raise SlimeLiteError(f"--expert-tensor-parallel-size {etp} must divide the model's moe_intermediate_size "
                             f"({moe.ffn_hidden_size}).")
    stage = world_size(args) // args.pipeline_model_parallel_size
    if stage % (ep * etp):
        raise SlimeLiteError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} must divide "
                             f"the {stage} ranks of a pipeline stage (GPUs / --pipeline-model-parallel-size).")
    if tp > 1 and not args.sequence_parallel:
        raise SlimeLiteError(f"--tensor-model-parallel-size {tp} with an MoE model ({cfg.get('model_type')}) needs "
                             "--sequence-parallel (Megatron's MoE layers take sequence-split tokens): add "
                             "--sequence-parallel.")


def check_recompute(args: argparse.Namespace, layers_per_stage: int | None) -> None:
    """--recompute-granularity / --recompute-method / --recompute-num-layers and --sequence-parallel, with
    Megatron's rules (model.memory_overrides passes them to the TransformerConfig)."""
    g, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    given = [(f, v) for f, v in (("--recompute-method", method), ("--recompute-num-layers", n)) if v is not None]
    if g is None and given:
        flag, value = given[0]
        raise SlimeLiteError(f"{flag} {value} does nothing without --recompute-granularity full: add "
                             f"--recompute-granularity full or drop {flag}.")
    if g == "selective" and given:
        flag, value = given[0]
        raise SlimeLiteError(f"--recompute-granularity selective recomputes the core attention of every layer; "
                             f"{flag} {value} is for --recompute-granularity full (drop {flag}).")
    if g == "full":
        if method is None or n is None:
            raise SlimeLiteError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                                 "--recompute-num-layers N (e.g. --recompute-method uniform --recompute-num-layers 1).")
        if layers_per_stage and n > layers_per_stage:
            raise SlimeLiteError(f"--recompute-num-layers {n} is more than the {layers_per_stage} layers of a "
                                 "pipeline stage (num_hidden_layers / --pipeline-model-parallel-size).")
        if method == "uniform" and layers_per_stage and layers_per_stage % n:
            raise SlimeLiteError(f"--recompute-method uniform recomputes chunks of --recompute-num-layers {n} layers, "
                                 f"which must divide the {layers_per_stage} layers of a pipeline stage; pick a "
                                 "divisor or --recompute-method block.")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        log.warning("--sequence-parallel is ignored at --tensor-model-parallel-size 1 (Megatron turns it off too: "
                    "it splits activations over the tensor-parallel ranks)")
