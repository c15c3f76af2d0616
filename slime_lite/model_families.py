"""The model families slime-lite builds, in the embedded engine and in the Megatron trainer alike, and what tells
them apart in config.json. Both sides read their supported list from ``FAMILIES``; ``check_family`` is the one
refusal for any other architecture (run before Ray starts, and again where each side loads the model)."""

from __future__ import annotations

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


FAMILIES: dict[str, Family] = {  # by config.json model_type
    "llama": Family("LlamaForCausalLM"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
    "glm4": Family("Glm4ForCausalLM", qkv_bias=True, rotary_interleaved=True, partial_rotary=0.5,
                   post_norms=True, fused_gate_up=True),
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
