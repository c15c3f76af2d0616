"""The model families slime-lite builds, in the embedded engine and in the Megatron trainer alike, and what tells
them apart in config.json. Both sides read their supported list from ``FAMILIES``; ``check_family`` is the one
refusal for any other architecture (run before Ray starts, and again where each side loads the model)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slime_lite.errors import SlimeLiteError


@dataclass(frozen=True)
class Family:
    """What a family's layers do beyond a Llama layer (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP)."""

    architecture: str  # the HF class in config.json's ``architectures``
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotary embedding
    qkv_bias: bool = False  # q/k/v projection biases when config.json says nothing (``attention_bias``)
    rotary_interleaved: bool = False  # rotary pairs (0, 1), (2, 3), ... instead of (i, i + d/2)
    partial_rotary: float | None = None  # the family reads config.json's partial_rotary_factor (this when absent)
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual add
    fused_gate_up: bool = False  # one ``mlp.gate_up_proj`` (gate rows first) instead of gate_proj and up_proj
    moe: bool = False  # every layer's MLP is routed experts (``mlp.gate`` router, ``mlp.experts.E``)
    shared_expert: bool = False  # next to the routed experts, an always-on ``mlp.shared_expert`` with a sigmoid gate


FAMILIES: dict[str, Family] = {  # by config.json model_type
    "llama": Family("LlamaForCausalLM"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
    "glm4": Family("Glm4ForCausalLM", qkv_bias=True, rotary_interleaved=True, partial_rotary=0.5,
                   post_norms=True, fused_gate_up=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qk_norm=True, moe=True),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", qkv_bias=True, moe=True, shared_expert=True),
}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)


def supported() -> str:
    return ", ".join(f"{f.architecture} ({t})" for t, f in FAMILIES.items())


def check_family(cfg: Any, where: str, fix: str = "") -> Family:
    """The family of an HF config (a PretrainedConfig or the config.json dict); SlimeLiteError naming the
    architecture, the supported ones and ``fix`` when slime-lite cannot build it."""
    model_type = _get(cfg, "model_type")
    archs = list(_get(cfg, "architectures") or [])
    family = FAMILIES.get(model_type)
    if family is None or (archs and family.architecture not in archs):
        shown = ", ".join(archs) if archs else "(no architectures)"
        raise SlimeLiteError(f"{where}: architecture {shown} (model_type {model_type!r}) is not supported (supported: "
                             f"{supported()}){'; ' + fix if fix else ''}.")
    return family


def sliding_window_layers(cfg: Any) -> bool:
    """Whether any layer attends over a sliding window, as transformers resolves the config: its ``layer_types``
    when config.json lists them, else each family's rule (Qwen2/Qwen3: the layers from ``max_window_layers`` on;
    Qwen2-MoE: even layers below it; Qwen3-MoE: every layer); ``use_sliding_window`` alone decides nothing."""
    types = _get(cfg, "layer_types")
    if types:  # a sliding layer with a null window attends over everything
        return "sliding_attention" in types and bool(_get(cfg, "sliding_window"))
    model_type = _get(cfg, "model_type")
    if model_type not in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") or not _get(cfg, "use_sliding_window", False):
        return False  # the other families have no sliding window
    if not _get(cfg, "sliding_window", 4096):  # null: transformers attends over everything
        return False
    layers, below = int(_get(cfg, "num_hidden_layers")), int(_get(cfg, "max_window_layers", 28))
    if model_type in ("qwen2", "qwen3"):
        return below < layers
    return model_type == "qwen3_moe" or below > 0  # Qwen2-MoE: layer 0 slides when it is below max_window_layers


def check_servable(cfg: Any, where: str, fix: str) -> None:
    """What the embedded engine cannot serve in a supported family's config (checked before Ray starts, and again
    when the engine loads the model): SlimeLiteError naming it and ``fix``."""
    if sliding_window_layers(cfg):
        raise SlimeLiteError(f"{where}: sliding-window attention is not supported by the embedded engine; {fix}.")
    rope_type = _rope_type(cfg)
    if rope_type in ("dynamic", "longrope"):
        raise SlimeLiteError(f"{where}: rope type {rope_type!r} (length-dependent) is not supported by the embedded "
                             f"engine; {fix}.")


# llama3 RoPE scaling as Megatron computes it: these values are fixed there, only the factor is read
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_type(cfg: Any) -> str:
    rope = rope_parameters(cfg)
    return str(rope.get("rope_type", rope.get("type", "default")))


def check_trainable(cfg: Any, where: str) -> None:
    """What the Megatron trainer cannot build in a supported family's config (checked before Ray starts, and again
    when a worker builds the model): SlimeLiteError naming the field."""
    model_type = _get(cfg, "model_type")
    if _get(cfg, "hidden_act", "silu") not in ("silu", "swish"):  # transformers' "swish" is SiLU
        raise SlimeLiteError(f"{where} has hidden_act {_get(cfg, 'hidden_act')!r}; only 'silu' is supported.")
    if sliding_window_layers(cfg):
        raise SlimeLiteError(f"{where} has sliding-window attention layers; sliding-window attention is not "
                             "supported.")
    rope_type = _rope_type(cfg)
    if rope_type == "llama3":
        rope = rope_parameters(cfg)
        if any(float(rope.get(k, v)) != v for k, v in LLAMA3_FIXED.items()):
            raise SlimeLiteError(f"{where}: llama3 RoPE scaling is supported only with {LLAMA3_FIXED} (Megatron's "
                                 "values).")
    elif rope_type != "default":
        raise SlimeLiteError(f"{where} uses rope_type {rope_type!r}; the Megatron trainer supports default and "
                             "llama3.")
    # Llama's, Qwen3's and Qwen3-MoE's attention_bias adds an o_proj bias too, which Megatron has only with every
    # linear's; only Llama reads mlp_bias (transformers ignores the key in the other families)
    if (model_type == "llama" and _get(cfg, "mlp_bias", False)) or (model_type in ("llama", "qwen3", "qwen3_moe")
                                                                     and _get(cfg, "attention_bias", False)):
        raise SlimeLiteError(f"{where} sets attention_bias/mlp_bias; {model_type} models with these biases are not "
                             "supported by the Megatron trainer.")


def qkv_bias(cfg: Any) -> bool:
    """Whether q/k/v have biases: config.json's ``attention_bias`` (Qwen2-MoE: ``qkv_bias``), else the family's."""
    family = FAMILIES[_get(cfg, "model_type")]
    key = "qkv_bias" if _get(cfg, "model_type") == "qwen2_moe" else "attention_bias"
    return bool(_get(cfg, key, family.qkv_bias)) or _get(cfg, "model_type") == "qwen2"


@dataclass(frozen=True)
class MoE:
    """The routed-expert MLP of an MoE family, from config.json (softmax router over every expert, top-k)."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int  # each expert's intermediate size (moe_intermediate_size)
    norm_topk_prob: bool  # the top-k weights renormalised to sum to 1
    shared_expert_size: int  # 0 without a shared expert
    aux_loss_coeff: float  # router_aux_loss_coef


def num_experts(cfg: Any) -> int | None:
    """config.json's expert count: ``num_experts`` (transformers 5 writes Qwen3-MoE's as ``num_local_experts``)."""
    return _get(cfg, "num_experts", None) or _get(cfg, "num_local_experts", None)


def moe_config(cfg: Any, where: str) -> MoE | None:
    """The MoE MLP of an MoE family's config (None for a dense family); SlimeLiteError for layouts slime-lite
    cannot build (dense layers between MoE ones)."""
    family = FAMILIES[_get(cfg, "model_type")]
    if not family.moe:
        return None
    if int(_get(cfg, "decoder_sparse_step", 1) or 1) != 1 or list(_get(cfg, "mlp_only_layers") or []):
        raise SlimeLiteError(f"{where}: decoder_sparse_step {_get(cfg, 'decoder_sparse_step')} / mlp_only_layers "
                             f"{_get(cfg, 'mlp_only_layers')}: only models whose every layer is MoE are supported "
                             "(decoder_sparse_step 1, no mlp_only_layers).")
    return MoE(
        num_experts=int(num_experts(cfg)), top_k=int(_get(cfg, "num_experts_per_tok")),
        ffn_hidden_size=int(_get(cfg, "moe_intermediate_size")), norm_topk_prob=bool(_get(cfg, "norm_topk_prob")),
        shared_expert_size=int(_get(cfg, "shared_expert_intermediate_size", 0) or 0) if family.shared_expert else 0,
        aux_loss_coeff=float(_get(cfg, "router_aux_loss_coef", 0.0) or 0.0),
    )


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """config.json's RoPE settings (transformers 5's ``rope_parameters``, older ``rope_scaling``), with the
    top-level ``rope_theta`` / ``partial_rotary_factor`` of older files folded in."""
    rope = dict(_get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in rope and _get(cfg, key) is not None:
            rope[key] = _get(cfg, key)
    return rope


def partial_rotary_factor(cfg: Any) -> float:
    """The share of each head the rotary embedding turns: config.json's partial_rotary_factor (else the family's
    default) in families that read it, 1 in the others of ``FAMILIES`` (transformers ignores the key there)."""
    family = FAMILIES.get(_get(cfg, "model_type"))
    if family is not None and family.partial_rotary is None:
        return 1.0
    return float(rope_parameters(cfg).get("partial_rotary_factor", family.partial_rotary if family else 1.0))


# config.json sizes both sides compute with: a positive int when given (intermediate_size may be 0 in MoE configs)
_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
          "vocab_size", "max_position_embeddings", "head_dim")


def read_config(folder: str, flag: str = "--hf-checkpoint") -> dict[str, Any]:
    """``folder``'s config.json as a dict, its sizes checked to be positive ints (intermediate_size may be 0); else
    a SlimeLiteError naming the file (not JSON, not an object, a size such as ``"4"`` or 0) instead of a traceback
    wherever it is first read."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as exc:
        raise SlimeLiteError(f"{flag} {path}: cannot be read ({exc.strerror or exc}).") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise SlimeLiteError(f"{flag} {path}: not a JSON file ({exc}); give a Hugging Face model folder.") from None
    if not isinstance(cfg, dict):
        raise SlimeLiteError(f"{flag} {path}: holds a JSON {type(cfg).__name__}, not the model's config object.")
    for key in _SIZES:
        v = cfg.get(key)
        least = 0 if key == "intermediate_size" else 1
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
            kind = "a non-negative" if least == 0 else "a positive"
            raise SlimeLiteError(f"{flag} {path}: {key} is {v!r}; it must be {kind} integer.")
    return cfg
