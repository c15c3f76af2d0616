"""slime's (and Megatron's) flags that slime-lite takes so that slime's example scripts run as written.

Three kinds, each in one table here (args.py adds them to the ``train`` parser, ``check`` runs in validate_args):

- ``ARCH_FLAGS``: Megatron's model-architecture flags. slime-lite builds the model from ``--hf-checkpoint``'s
  config.json, so each given flag is checked against it: a contradiction is an error naming the flag, both values
  and the file.
- ``AS_SLIME_LITE_DOES``: flags whose only supported values are what slime-lite always does (``--optimizer adam``,
  ``--context-parallel-size 1``, dropout 0, no RoPE fusion, ...): honoured, and any other value is refused.
- ``NOT_SUPPORTED``: flags slime has and slime-lite does not implement yet: parsed (never argparse's "unrecognized
  arguments"), and refused all together by ``check`` with the reason for each. A flag that gets implemented moves
  out of this table (one line).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any, Callable

from slime_lite.errors import SlimeLiteError
from slime_lite.model_families import (FAMILIES, num_experts, partial_rotary_factor, qkv_bias, read_config,
                                       rope_parameters)
from slime_lite.slime_flags_refused import REFUSED

STORE_TRUE = {"action": "store_true", "default": None}


def _value(kind: Any = str, **kw: Any) -> dict[str, Any]:
    return {"type": kind, "default": None, **kw}


def layer_freq(text: str) -> int | list[int]:
    """Megatron's --moe-layer-freq: N (every N-th layer is MoE), a list ``[1,0,1,...]`` or ``([1]*48)``."""
    t = text.strip().strip("()").replace(" ", "")
    m = re.fullmatch(r"\[([01])\]\*(\d+)", t)
    if m:
        return [int(m.group(1))] * int(m.group(2))
    if re.fullmatch(r"\d+", t) and int(t) >= 1:
        return int(t)
    if re.fullmatch(r"\[[01](,[01])*\]", t):
        return [int(x) for x in t[1:-1].split(",")]
    raise argparse.ArgumentTypeError(f"{text!r}: expected N >= 1, a list like [1,1,0,1] or ([1]*48)")


def _moe_layers(freq: int | list[int], num_layers: int | None) -> list[int] | None:
    """Which layers a --moe-layer-freq value makes MoE, one 0/1 per layer."""
    if isinstance(freq, list):
        return freq
    return [int(i % freq == 0) for i in range(num_layers)] if num_layers else None


# ---- Megatron architecture flags: flag -> (argparse kwargs, config.json key(s) it is checked against) --------------
ARCH_FLAGS: dict[str, tuple[dict[str, Any], str]] = {
    "--num-layers": (_value(int), "num_hidden_layers"),
    "--hidden-size": (_value(int), "hidden_size"),
    "--ffn-hidden-size": (_value(int), "intermediate_size"),
    "--num-attention-heads": (_value(int), "num_attention_heads"),
    "--group-query-attention": (STORE_TRUE, "num_key_value_heads"),
    "--num-query-groups": (_value(int), "num_key_value_heads"),
    "--kv-channels": (_value(int), "head_dim (or hidden_size / num_attention_heads)"),
    "--vocab-size": (_value(int), "vocab_size"),
    "--swiglu": (STORE_TRUE, "hidden_act"),
    "--normalization": (_value(choices=("LayerNorm", "RMSNorm")), "rms_norm_eps / layer_norm_eps"),
    "--norm-epsilon": (_value(float), "rms_norm_eps (or layer_norm_eps)"),
    "--use-rotary-position-embeddings": (STORE_TRUE, "rope_theta"),
    "--position-embedding-type": (_value(choices=("learned_absolute", "rope", "mrope", "relative", "none")),
                                  "rope_theta"),
    "--rotary-base": (_value(float), "rope_theta"),
    "--rotary-percent": (_value(float), "partial_rotary_factor"),
    "--rotary-interleaved": (STORE_TRUE, "model_type"),
    "--use-rope-scaling": (STORE_TRUE, "rope_scaling's rope_type llama3"),
    "--rotary-scaling-factor": (_value(float), "rope_scaling's factor (rope_type llama3)"),
    "--max-position-embeddings": (_value(int), "max_position_embeddings"),
    "--seq-length": (_value(int), "max_position_embeddings (at most: samples are packed, any length up to it)"),
    "--untie-embeddings-and-output-weights": (STORE_TRUE, "tie_word_embeddings"),
    "--qk-layernorm": (STORE_TRUE, "model_type"),
    "--disable-bias-linear": (STORE_TRUE, "mlp_bias"),
    "--add-qkv-bias": (STORE_TRUE, "attention_bias (or model_type)"),
    "--post-self-attn-layernorm": (STORE_TRUE, "model_type"),
    "--post-mlp-layernorm": (STORE_TRUE, "model_type"),
    "--spec": (_value(nargs=2, metavar=("MODULE", "FUNCTION")), "model_type"),
    "--num-experts": (_value(int), "num_experts (or num_local_experts)"),
    "--moe-ffn-hidden-size": (_value(int), "moe_intermediate_size"),
    "--moe-router-topk": (_value(int), "num_experts_per_tok"),
    "--moe-router-score-function": (_value(choices=("softmax", "sigmoid")), "model_type"),
    "--moe-router-pre-softmax": (STORE_TRUE, "norm_topk_prob"),
    "--moe-shared-expert-intermediate-size": (_value(int), "shared_expert_intermediate_size"),
    "--moe-layer-freq": (_value(layer_freq), "decoder_sparse_step / mlp_only_layers"),
    "--padded-vocab-size": (_value(int), "vocab_size (slime-lite's embedding has vocab_size rows, unpadded)"),
    "--model-name": (_value(), "model_type (slime's weight-converter name: it must name that family)"),
}
# What the architecture flags mean per config.json model_type: the families slime-lite builds (model_families.py),
# and others whose configs slime's scripts may name (checked against them too; the trainer refuses to build them).
QK_NORM_TYPES = tuple(t for t, f in FAMILIES.items() if f.qk_norm) + ("qwen3_next", "olmo2", "gemma3")
NO_QK_NORM_TYPES = tuple(t for t, f in FAMILIES.items() if not f.qk_norm) + ("mistral", "glm")
INTERLEAVED_ROPE_TYPES = tuple(t for t, f in FAMILIES.items() if f.rotary_interleaved) + ("glm", "chatglm")
POST_NORM_TYPES = tuple(t for t, f in FAMILIES.items() if f.post_norms)  # extra norms after attention and MLP
QKV_BIAS_TYPES = tuple(t for t, f in FAMILIES.items() if f.qkv_bias)  # when config.json is silent

# ---- honoured with these values only: flag -> (argparse kwargs, allowed values or a test, what slime-lite does) ---
AS_SLIME_LITE_DOES: dict[str, tuple[dict[str, Any], tuple[Any, ...] | Callable[[Any], bool], str]] = {
    "--context-parallel-size": (_value(int), (1,), "no context parallelism"),
    "--optimizer": (_value(), ("adam",), "Megatron's Adam"),
    "--lr-decay-style": (_value(), ("constant",), "a constant learning rate"),
    "--attention-dropout": (_value(float), (0.0,), "no dropout"),
    "--hidden-dropout": (_value(float), (0.0,), "no dropout"),
    "--attention-backend": (_value(), ("flash", "auto"),
                            "PyTorch SDPA (flash kernels on CUDA) in the local layer spec"),
    "--no-rope-fusion": (STORE_TRUE, (True,), "no fused RoPE kernel"),
    "--accumulate-allreduce-grads-in-fp32": (STORE_TRUE, (True,), "gradients reduced in float32"),
    "--attention-softmax-in-fp32": (STORE_TRUE, (True,), "softmax accumulated in float32 (SDPA)"),
    "--moe-grouped-gemm": (STORE_TRUE, (True,), "each expert as its own MLP (the same math as a grouped GEMM)"),
    "--moe-permute-fusion": (STORE_TRUE, (True,), "tokens permuted to their experts in PyTorch (the same math as "
                                                  "the fused kernel)"),
    "--moe-token-drop-policy": (_value(), ("probs", "position"), "no token dropping (no expert capacity factor), "
                                                                "so the drop policy never applies"),
    "--train-backend": (_value(), ("megatron",), "Megatron-core as the trainer"),
    "--distributed-backend": (_value(), ("nccl",), "NCCL between the train ranks (gloo on a machine without CUDA)"),
    "--log-probs-chunk-size": (_value(int), lambda v: v == -1 or v >= 1,
                               "log-probs 1024 tokens at a time (one fused pass on CUDA); a token's log-prob does not "
                               "depend on its chunk, so any size (-1: slime's single pass) gives the same numbers"),
    "--recompute-loss-function": (STORE_TRUE, (True,), "the log-prob and loss pass keeps only per-token statistics "
                                                       "and rebuilds the softmax in the backward pass (no float32 "
                                                       "[tokens, vocab] tensor kept)"),
    "--data-pad-size-multiplier": (_value(int), lambda v: v >= 1,
                                   "packed micro-batches without padding (a multiple of --tensor-model-parallel-size "
                                   "under --sequence-parallel only); padding changes no result, so any multiplier "
                                   "gives the same numbers"),
    "--memory-recorder": (_value(), ("torch",), "the CUDA allocator's history (torch.cuda.memory) for "
                                                "--record-memory-history"),
    "--update-weight-mode": (_value(choices=("full", "delta")), ("full",), "every weight pushed in full at each "
                                                                          "sync"),
    "--rollout-data-transport": (_value(choices=("object-store", "nixl")), ("object-store",),
                                 "rollout samples sent to the train ranks through Ray's object store"),
    "--num-critic-only-steps": (_value(int), (0,), "the actor trained from the first rollout on, with the critic "
                                                   "(PPO)"),
}

# ---- not supported yet: flag -> (argparse kwargs, reason) -------------------------------------------------------
NOT_SUPPORTED: dict[str, tuple[dict[str, Any], str]] = {
    "--custom-convert-samples-to-train-data-path": (_value(), "slime's hook returns its trainer's dict of per-sample "
                                                              "lists; slime-lite's trainer takes the Samples "
                                                              "themselves, so no dict replaces that step (rewards: "
                                                              "--custom-reward-post-process-path; loss masks: a "
                                                              "generate hook or --rollout-sample-filter-path)"),
    "--custom-tis-function-path": (_value(), "slime's hook for a custom importance-sampling weight (the built-in "
                                             "ones: --use-tis with --tis-mode truncate|mask and --tis-level "
                                             "token|sequence|geometric)"),
    "--disable-rewards-normalization": (STORE_TRUE, "GRPO and REINFORCE++-baseline always centre the rewards on "
                                                    "their group's mean (--disable-grpo-std-normalization drops the "
                                                    "division by the std)"),
    "--use-rollout-logprobs": (STORE_TRUE, "the old log-probs of the PPO ratio are always the trainer's, recomputed "
                                           "(the engine's rollout log-probs enter through --use-tis)"),
    "--use-unbiased-kl": (STORE_TRUE, "the KL estimator is --kl-loss-type's, not importance-weighted"),
    "--use-rollout-entropy": (STORE_TRUE, "the log-prob passes of actor and reference compute no entropy for a "
                                          "custom loss mask (the actor's train entropy: train/entropy; masks: a "
                                          "generate hook's loss_mask)"),
    "--keep-old-actor": (STORE_TRUE, "no second copy of the actor: the old log-probs are the trainer's, recomputed "
                                     "before each rollout's steps (the engine's log-probs enter through --use-tis)"),
    "--loss-mask-type": (_value(), "read only by slime's SFT rollout (slime.rollout.sft_rollout), which slime-lite "
                                   "does not have; loss masks come from the rollout (a generate hook's loss_mask)"),
    "--start-rollout-id": (_value(int), "the first rollout is 0, or the one after the checkpoint --load resumes: "
                                        "resume with --load"),
    "--rollout-skip-special-tokens": (STORE_TRUE, "response text is decoded with its special tokens, so that text "
                                                  "and tokens agree; strip them in --custom-rm-path if needed"),
    "--rollout-health-check-interval": (_value(float), "no periodic /health_generate monitor: --use-fault-tolerance "
                                                       "restarts an engine whose requests fail (its server died)"),
    "--rollout-health-check-timeout": (_value(float), "no periodic /health_generate monitor (see "
                                                      "--use-fault-tolerance)"),
    "--rollout-health-check-first-wait": (_value(float), "no periodic /health_generate monitor (see "
                                                         "--use-fault-tolerance)"),
    "--http-proxy": (_value(), "slime parses it but no slime code reads it; slime-lite reaches the engines and "
                               "--rm-url directly, without a proxy: drop it"),
    "--log-multi-turn": (STORE_TRUE, "slime's multi-turn train metrics are not logged (log them from "
                                     "--custom-rollout-log-function-path)"),
    "--log-correct-samples": (STORE_TRUE, "slime's length quantiles of correct samples are not logged (log them "
                                          "from --custom-rollout-log-function-path)"),
    **REFUSED,  # slime_lite/slime_flags_refused.py
}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron model architecture",
                                  "optional: slime-lite reads the architecture from --hf-checkpoint's config.json; a "
                                  "flag given here is checked against it")
    for flag, (kw, key) in ARCH_FLAGS.items():
        g.add_argument(flag, help=f"checked against config.json {key}", **kw)
    g = parser.add_argument_group("slime flags honoured as slime-lite always runs", "any other value is refused")
    for flag, (kw, allowed, what) in AS_SLIME_LITE_DOES.items():
        shown = "" if callable(allowed) or allowed == (True,) else f" ({'/'.join(str(a) for a in allowed)} only)"
        g.add_argument(flag, help=f"{what}{shown}", **kw)
    g = parser.add_argument_group("slime flags not supported yet", "parsed, then refused with the reason")
    for flag, (kw, reason) in NOT_SUPPORTED.items():
        g.add_argument(flag, help=f"not supported yet: {reason}", **kw)


def refused(args: argparse.Namespace) -> list[str]:
    """One line per flag given that slime-lite refuses (not supported yet, or a value it does not support)."""
    out = []
    for flag, (_, reason) in NOT_SUPPORTED.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            out.append(f"{flag}: not supported yet: {reason}")
    for flag, (_, allowed, what) in AS_SLIME_LITE_DOES.items():
        value = getattr(args, _dest(flag))
        if value is None or (allowed(value) if callable(allowed) else value in allowed):
            continue
        values = "a value it takes" if callable(allowed) else " or ".join(str(a) for a in allowed)
        out.append(f"{flag} {value}: not supported yet: slime-lite runs with {what} ({flag} {values})")
    return out


def hf_values(cfg: dict[str, Any]) -> dict[str, Any]:
    """What each architecture flag would have to say for this config.json (None: the config does not tell)."""
    mt = cfg.get("model_type") or ""
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    theta = rope_parameters(cfg).get("rope_theta")
    norm = "RMSNorm" if "rms_norm_eps" in cfg else "LayerNorm" if "layer_norm_eps" in cfg else None
    known = mt in QK_NORM_TYPES + NO_QK_NORM_TYPES
    family = FAMILIES.get(mt)
    dense = family is not None and not family.moe  # a family slime-lite builds without experts
    moe = family is not None and family.moe
    sparse_step, only_dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
    layers = cfg.get("num_hidden_layers")
    rope = rope_parameters(cfg)
    llama3 = rope.get("rope_type", rope.get("type")) == "llama3"
    return {
        "use_rope_scaling": llama3 if theta is not None else None,
        "rotary_scaling_factor": rope.get("factor") if llama3 else False,
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "seq_length": cfg.get("max_position_embeddings"),
        "num_layers": cfg.get("num_hidden_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": cfg.get("intermediate_size"),
        "num_attention_heads": heads,
        "num_query_groups": cfg.get("num_key_value_heads", heads),
        "kv_channels": cfg.get("head_dim") or (hidden // heads if hidden and heads else None),
        "vocab_size": cfg.get("vocab_size"),
        "swiglu": cfg["hidden_act"] in ("silu", "swish") if "hidden_act" in cfg else None,
        "normalization": norm,
        "norm_epsilon": cfg.get("rms_norm_eps", cfg.get("layer_norm_eps")),
        "use_rotary_position_embeddings": theta is not None or None,
        "position_embedding_type": "rope" if theta is not None else None,
        "rotary_base": theta,
        "rotary_percent": partial_rotary_factor(cfg),
        "rotary_interleaved": mt in INTERLEAVED_ROPE_TYPES if mt else None,
        "untie_embeddings_and_output_weights": (not cfg["tie_word_embeddings"]) if "tie_word_embeddings" in cfg
        else None,
        "qk_layernorm": mt in QK_NORM_TYPES if known else None,
        "disable_bias_linear": not cfg.get("mlp_bias", False),
        "add_qkv_bias": qkv_bias(cfg) if family else bool(cfg["attention_bias"]) if "attention_bias" in cfg
        else (mt in QKV_BIAS_TYPES if mt else None),
        "post_self_attn_layernorm": mt in POST_NORM_TYPES if mt else None,
        "post_mlp_layernorm": mt in POST_NORM_TYPES if mt else None,
        "num_experts": False if dense else num_experts(cfg),
        "moe_ffn_hidden_size": False if dense else cfg.get("moe_intermediate_size"),
        "moe_router_topk": False if dense else cfg.get("num_experts_per_tok"),
        "moe_router_score_function": False if dense else "softmax" if moe else None,
        "moe_router_pre_softmax": False if dense else (not cfg["norm_topk_prob"]) if moe and "norm_topk_prob" in cfg
        else None,
        "moe_shared_expert_intermediate_size": False if dense or (moe and not family.shared_expert)
        else cfg.get("shared_expert_intermediate_size"),
        "moe_layer_freq": False if dense else [int(i not in only_dense and (i + 1) % sparse_step == 0)
                                                for i in range(layers)] if moe and layers else None,
        "padded_vocab_size": cfg.get("vocab_size"),
    }


def _squash(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _same(given: Any, want: Any) -> bool:
    if isinstance(given, float) or isinstance(want, float):
        return math.isclose(float(given), float(want), rel_tol=1e-6)
    return given == want


def check_architecture(args: argparse.Namespace) -> None:
    """Every architecture flag given agrees with --hf-checkpoint's config.json; else an error naming the flag, both
    values and the file."""
    given = {_dest(f): getattr(args, _dest(f)) for f in ARCH_FLAGS if getattr(args, _dest(f)) is not None}
    if not given:
        return
    path = os.path.join(args.hf_checkpoint, "config.json")
    cfg = read_config(args.hf_checkpoint)
    want = hf_values(cfg)
    model_type = cfg.get("model_type")
    problems = []
    for dest, value in given.items():
        flag = "--" + dest.replace("_", "-")
        key = ARCH_FLAGS[flag][1]
        if dest == "spec":
            spec_type = value[0].rsplit(".", 1)[-1]
            if model_type and not (model_type.startswith(spec_type) or spec_type.startswith(model_type)):
                problems.append(f"{flag} {' '.join(value)} is a {spec_type} layer spec, but {path} has model_type "
                                f"{model_type!r}")
            continue
        if dest == "model_name":  # slime picks its converter by the family's name inside it (qwen3config: qwen3)
            if model_type and _squash(model_type) not in _squash(value):
                problems.append(f"{flag} {value} contradicts {path}: model_type {model_type!r} means a --model-name "
                                f"naming {model_type} (e.g. {model_type})")
            continue
        if dest == "group_query_attention":
            continue  # a switch; --num-query-groups carries the number and is checked
        if dest == "moe_layer_freq":
            value = _moe_layers(value, cfg.get("num_hidden_layers"))
        expected = want.get(dest)
        if expected is None:
            continue  # the config does not say
        if dest == "seq_length":  # Megatron's training length: any up to the positions the model has
            if value > expected:
                problems.append(f"{flag} {value} is more than {path}'s max_position_embeddings {expected}")
            continue
        if not _same(value, expected):
            shown = "given" if value is True else value
            problems.append(f"{flag} {shown} contradicts {path}: {key} means {flag} "
                            f"{'not given' if expected is False else expected}"
                            + (f" (model_type {model_type!r})" if key == "model_type" else ""))
    if problems:
        raise SlimeLiteError("Megatron architecture flags disagree with the checkpoint (slime-lite builds the model "
                             "from config.json; fix or drop the flag):\n  " + "\n  ".join(problems))


def check(args: argparse.Namespace) -> None:
    """Refused flags (all of them, with reasons), then the architecture flags against config.json; and, as slime,
    --eval-max-context-len defaults to --rollout-max-context-len (for hooks that read it)."""
    if args.eval_max_context_len is None:
        args.eval_max_context_len = args.rollout_max_context_len
    lines = refused(args)
    if lines:
        raise SlimeLiteError("slime flags that slime-lite does not support yet (drop them or use slime itself):\n  "
                             + "\n  ".join(lines))
    check_architecture(args)
