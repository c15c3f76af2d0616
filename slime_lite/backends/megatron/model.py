"""A Megatron-core GPTModel whose architecture is derived from a Hugging Face config.json (the families of
slime_lite/model_families.py: Llama, Qwen2, Qwen3, GLM4, and the Mixture-of-Experts Qwen3-MoE and Qwen2-MoE, whose
MLPs are Megatron MoE layers: a softmax router over every expert, top-k, the experts of this rank's expert-parallel
slice as separate MLPs (no grouped GEMM), Qwen2-MoE's shared expert with its sigmoid gate).

Typical use on every train rank (after `parallel.init_distributed`):

    model = build_gpt_model(hf_config)                  # this rank's TP shard of this rank's PP stage
    convert.load_hf_weights(model, "/path/to/hf_checkpoint", hf_config)
    logits = forward_logits(model, tokens)              # PP=1: [B, T, vocab] float logits, full HF vocab

`hf_config` is a transformers PretrainedConfig or the dict read from config.json.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel, gpt_layer_specs
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from slime_lite.backends.megatron import fused_ops
from slime_lite.backends.megatron.attention import FastCoreAttention, install_packed_rope, mark_packed_positions
from slime_lite.backends.megatron.batch import to_device
from slime_lite.backends.megatron.post_norm import PostNormLayer
from slime_lite.errors import SlimeLiteError
from slime_lite.model_families import (MoE, check_family, check_trainable, moe_config, partial_rotary_factor, qkv_bias,
                                       rope_parameters)

TE_INSTALL_HINT = (
    "--transformer-impl transformer_engine needs NVIDIA Transformer Engine, which is not installed: "
    "`pip install --no-build-isolation 'transformer_engine[pytorch]'` on a CUDA machine, or use "
    "--transformer-impl local (the default)."
)


@dataclass(frozen=True)
class HFArch:
    """The parts of an HF config.json that decide the Megatron architecture and the weight layout."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_llama3_factor: float | None  # Llama-3.1 style RoPE scaling, None when plain RoPE
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rotary_percent: float  # share of each head the rotary embedding turns (GLM4: 0.5)
    rotary_interleaved: bool  # rotary pairs (0, 1), (2, 3), ... (GLM4)
    post_norms: bool  # RMSNorm of the attention and MLP outputs before each residual add (GLM4)
    fused_gate_up: bool  # HF's MLP has one gate_up_proj (GLM4)
    max_position_embeddings: int
    init_std: float
    moe: MoE | None = None  # the routed experts (MoE families)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def hf_arch(hf_config: Any) -> HFArch:
    """Read and check an HF config (PretrainedConfig or config.json dict); SlimeLiteError if Megatron can't match it."""
    model_type = _get(hf_config, "model_type")
    where = "the --hf-checkpoint config.json"
    family = check_family(hf_config, where, "the Megatron backend cannot build it")
    check_trainable(hf_config, where)
    rope = rope_parameters(hf_config)  # its type checked by check_trainable
    rope_theta = float(rope.get("rope_theta", 10000.0))
    llama3_factor = float(rope["factor"]) if rope.get("rope_type", rope.get("type")) == "llama3" else None
    hidden = int(_get(hf_config, "hidden_size"))
    heads = int(_get(hf_config, "num_attention_heads"))
    return HFArch(
        model_type=model_type,
        vocab_size=int(_get(hf_config, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_get(hf_config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(_get(hf_config, "num_key_value_heads") or heads),
        head_dim=int(_get(hf_config, "head_dim") or hidden // heads),
        ffn_hidden_size=int(_get(hf_config, "intermediate_size")),
        rms_norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_llama3_factor=llama3_factor,
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias(hf_config),
        qk_norm=family.qk_norm,
        rotary_percent=partial_rotary_factor(hf_config),
        rotary_interleaved=family.rotary_interleaved,
        post_norms=family.post_norms,
        fused_gate_up=family.fused_gate_up,
        max_position_embeddings=int(_get(hf_config, "max_position_embeddings", 4096)),
        init_std=float(_get(hf_config, "initializer_range", 0.02)),
        moe=moe_config(hf_config, where),
    )


def check_parallel_sizes(arch: HFArch, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """SlimeLiteError unless TP divides heads, KV heads and the FFN size, PP divides the layer count, and (MoE) EP
    divides the experts and the expert TP size (default TP) each expert's FFN size."""
    ffn = (("shared_expert_intermediate_size", arch.moe.shared_expert_size),) if arch.moe else (
        ("intermediate_size", arch.ffn_hidden_size),)
    for what, n in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads), *ffn):
        if tp < 1 or n % tp:
            raise SlimeLiteError(
                f"--tensor-model-parallel-size {tp} must divide the model's {what} ({n}); "
                f"pick a TP size that divides {arch.num_heads} heads, {arch.num_kv_heads} KV heads "
                f"and FFN size {ffn[0][1]}."
            )
    if pp < 1 or arch.num_layers % pp:
        raise SlimeLiteError(
            f"--pipeline-model-parallel-size {pp} must divide the model's num_hidden_layers ({arch.num_layers})."
        )
    if arch.moe is None:
        if ep != 1 or (etp or 1) > 1:
            raise SlimeLiteError(f"--expert-model-parallel-size {ep} / --expert-tensor-parallel-size {etp}: the "
                                 f"model ({arch.model_type}) has no experts; drop them.")
        return
    if ep < 1 or arch.moe.num_experts % ep:
        raise SlimeLiteError(f"--expert-model-parallel-size {ep} must divide the model's num_experts "
                             f"({arch.moe.num_experts}); pick an EP size that divides it.")
    etp = tp if etp is None else etp
    if etp < 1 or arch.moe.ffn_hidden_size % etp:
        raise SlimeLiteError(f"--expert-tensor-parallel-size {etp} must divide the model's moe_intermediate_size "
                             f"({arch.moe.ffn_hidden_size}); pick one that divides it.")


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Megatron splits the vocabulary evenly over TP ranks; rows past the HF vocab are zero padding."""
    return math.ceil(vocab_size / tp) * tp


def transformer_config_from_hf(
    hf_config: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    transformer_impl: str = "local",
    **overrides: Any,
):
    """The TransformerConfig of `hf_config` for a TP x PP layout; `overrides` set any other TransformerConfig field."""

    arch = hf_arch(hf_config)
    check_parallel_sizes(arch, tp, pp, overrides.get("expert_model_parallel_size", 1),
                         overrides.get("expert_tensor_parallel_size"))
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        rotary_interleaved=arch.rotary_interleaved,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.init_std,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        transformer_impl=transformer_impl,
        # No fused kernels: they need CUDA/apex/TE and the unfused paths are what HF computes. Except the dense
        # MLP's SwiGLU: fused_ops' kernels on CUDA, the same eager ops elsewhere (layer_spec installs them).
        masked_softmax_fusion=False,
        bias_activation_fusion=arch.moe is None,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    if arch.moe is not None:
        kwargs.update(moe_kwargs(arch.moe))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def moe_kwargs(moe: MoE) -> dict[str, Any]:
    """The TransformerConfig fields of an HF MoE MLP: the softmax over every expert, then the top k (Megatron's
    pre-softmax), or, with ``norm_topk_prob``, the top k logits' softmax (the same renormalised weights); no token
    dropping; the shared expert and its sigmoid gate. Slime's --moe-* flags override (``moe_overrides``)."""
    out = dict(num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.ffn_hidden_size,
               moe_router_score_function="softmax", moe_router_pre_softmax=not moe.norm_topk_prob,
               moe_grouped_gemm=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
               moe_token_dispatcher_type="alltoall")
    if moe.shared_expert_size:
        out.update(moe_shared_expert_intermediate_size=moe.shared_expert_size, moe_shared_expert_gate=True)
    return out


def moe_overrides(args: Any, hf_config: Any) -> dict[str, Any]:
    """The TransformerConfig fields of slime's MoE flags that choose how (not what) the experts compute:
    --moe-aux-loss-coeff (and the load-balancing loss it turns on), --moe-z-loss-coeff, --moe-token-dispatcher-type,
    --moe-router-dtype, the expert-parallel sizes, and Megatron's router replay for --use-rollout-routing-replay and
    --use-routing-replay.
    Empty for a dense model."""
    if hf_arch(hf_config).moe is None:
        return {}
    out: dict[str, Any] = {"expert_model_parallel_size": args.expert_model_parallel_size,
                           "expert_tensor_parallel_size": args.expert_tensor_parallel_size
                           or args.tensor_model_parallel_size,
                           "moe_token_dispatcher_type": args.moe_token_dispatcher_type,
                           "moe_router_dtype": args.moe_router_dtype, "moe_z_loss_coeff": args.moe_z_loss_coeff,
                           "moe_enable_routing_replay": bool(args.use_rollout_routing_replay or args.use_routing_replay)}
    if args.moe_aux_loss_coeff:
        out.update(moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_router_load_balancing_type="aux_loss")
    return out


def memory_overrides(args: Any) -> dict[str, Any]:
    """The TransformerConfig fields of Megatron's activation-memory flags: ``--recompute-granularity`` (full: whole
    layers re-run in the backward pass; selective: only the core attention), ``--recompute-method`` (uniform: every
    chunk of ``--recompute-num-layers`` layers; block: the first N layers of each PP stage) and
    ``--sequence-parallel`` (norms and residuals split along the sequence over the TP group; as in Megatron, off at
    TP=1). args_layout.check_recompute refuses the combinations Megatron would."""
    return {
        "recompute_granularity": args.recompute_granularity,
        "recompute_method": args.recompute_method,
        "recompute_num_layers": args.recompute_num_layers,
        "sequence_parallel": sequence_parallel(args),
    }


def sequence_parallel(args: Any) -> bool:
    """--sequence-parallel in effect (Megatron turns it off at --tensor-model-parallel-size 1)."""
    return bool(args.sequence_parallel) and args.tensor_model_parallel_size > 1


def layer_spec(arch: HFArch, transformer_impl: str = "local"):
    """Megatron's layer spec: local (pure PyTorch, the default; its core attention is attention.py's
    FastCoreAttention: no [T, T] scores, packed samples) or Transformer Engine. Either way packed rows get their
    RoPE in one call per layer (attention.py install_packed_rope); GLM4's layer is post_norm.py's."""
    install_packed_rope()
    fused_ops.install_swiglu()
    if arch.moe is not None and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # megatron-core 0.16.1's router reads it; it is defined only with TE
    if transformer_impl == "local":
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm,
                                                        num_experts=arch.moe.num_experts if arch.moe else None,
                                                        moe_grouped_gemm=False)
        spec.submodules.self_attention.submodules.core_attention = FastCoreAttention
        norm = spec.submodules.input_layernorm
    elif transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError as e:
            raise SlimeLiteError(TE_INSTALL_HINT) from e
        from megatron.core.extensions.transformer_engine import TENorm

        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=arch.qk_norm, num_experts=arch.moe.num_experts if arch.moe else None, moe_grouped_gemm=False)
        norm = TENorm
    else:
        raise SlimeLiteError(f"--transformer-impl {transformer_impl!r} is unknown; use local or transformer_engine.")
    if arch.post_norms:
        spec.module, spec.params = PostNormLayer, {**spec.params, "post_norm": norm}
    return spec


class SequenceParallelNorm(torch.nn.RMSNorm):
    """Megatron's WrappedTorchNorm (torch's RMSNorm) for --sequence-parallel, which Megatron's own wrapper refuses:
    the input is this rank's slice of the sequence, so the weight's gradient is partial; marked ``sequence_parallel``,
    Megatron's finalize_model_grads sums it over the TP group."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = True


def _sequence_parallel_spec(spec: Any, config: Any):
    """The local layer spec as a block spec whose norms (the layers' and the final one) take sequence slices."""


    spec = copy.deepcopy(spec)
    subs = [spec.submodules, spec.submodules.self_attention.submodules]
    for sub in subs:
        for name in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm"):
            if getattr(sub, name, None) is WrappedTorchNorm:
                setattr(sub, name, SequenceParallelNorm)
    if spec.params.get("post_norm") is WrappedTorchNorm:  # GLM4's post-norms (post_norm.py)
        spec.params = {**spec.params, "post_norm": SequenceParallelNorm}
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelNorm)


def build_gpt_model(
    hf_config: Any,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    params_dtype: torch.dtype = torch.float32,
    transformer_impl: str = "local",
    parallel_output: bool = False,
    **config_overrides: Any,
):
    """This rank's GPTModel (its TP shard of its PP stage), randomly initialised; needs `parallel.init_distributed`.

    pre_process/post_process default to "this rank is the first/last PP stage". The vocabulary is padded to a
    multiple of TP (`padded_vocab_size`); `model.hf_vocab_size` keeps the HF size.
    """

    from slime_lite.backends.megatron import cpu_compat  # patches Megatron: applied when a model is built

    cpu_compat.apply()
    arch = hf_arch(hf_config)
    spec = layer_spec(arch, transformer_impl)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    config = transformer_config_from_hf(
        hf_config, tp=tp, pp=pp, params_dtype=params_dtype, transformer_impl=transformer_impl, **config_overrides
    )
    if config.sequence_parallel and transformer_impl == "local":
        spec = _sequence_parallel_spec(spec, config)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=arch.rotary_percent,
        rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_llama3_factor is not None,
        rope_scaling_factor=arch.rope_llama3_factor or 8.0,
    )
    # torch's norms are built in float32 whatever params_dtype is: cast them like every other weight (Megatron's
    # Float16Module does the same), so the optimizer keeps their float32 master copy, the forward uses the bf16
    # values the engine gets, and torch's fused rms_norm kernel applies (it needs the input's dtype)
    for m in model.modules():
        if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            m.to(params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    model.hf_vocab_size = arch.vocab_size
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def forward_logits(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal-LM logits [B, T, hf_vocab] for token ids [B, T] on a PP=1 model (full vocab, gathered over TP), on the
    model's device.

    Megatron's RoPE places token t of every row at position t, so rows must start at position 0 (right padding);
    `position_ids`, if given, must be exactly that. attention_mask=None means causal; otherwise it is Megatron's
    boolean [B, 1, T, T] mask (True = masked) for the local attention.
    """
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    batch, seq = tokens.shape
    expected = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
    if position_ids is not None and not torch.equal(position_ids.to(device), expected):
        raise ValueError("forward_logits: Megatron RoPE uses positions 0..T-1 per row; right-pad the batch instead")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    logits = model(tokens, expected, attention_mask, runtime_gather_output=True)
    return logits[..., : unwrap(model).hf_vocab_size]


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int, device: Any = None):
    """Megatron's PackedSeqParams ("thd") for samples packed back to back in one row (cu_seqlens [n+1] int32)."""


    cu = to_device(cu_seqlens.to(torch.int32), device if device is not None else cu_seqlens.device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=int(max_seqlen),
                             max_seqlen_kv=int(max_seqlen))
    params.cu_seqlens_host = cu_seqlens.tolist()  # attention.py splits by it: no device sync per layer
    mark_packed_positions(cu, params.cu_seqlens_host)  # RoPE of packed rows in one call per layer (attention.py)
    return params
