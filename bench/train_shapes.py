"""The model shapes and the synthetic workload of the GPU benches (``bench_train_gpu.py``, ``bench_engine.py``,
``loop_parts.py``): Qwen2 and Qwen3-MoE configs, random checkpoints, samples, and the FLOPs the MFU counts."""

from __future__ import annotations

import torch
from train_probes import VOCAB

SHAPES = {  # hidden, layers, heads, kv heads, ffn, tied embeddings
    "0.5b": (896, 24, 14, 2, 4864, True),
    "1.5b": (1536, 28, 12, 2, 8960, True),
    "7b": (3584, 28, 28, 4, 18944, False),  # Qwen2.5-7B's shape (with --lora-rank --lora-only: LoRA alone)
}
# Qwen3-MoE shapes (Qwen3MoeConfig fields): "moe-2b" has 2.25B parameters, 0.51B active per token (attention, 8 of
# 64 experts of 384, the router, the output projection; the input embedding not counted); untied as in Qwen3-MoE
MOE_SHAPES = {
    "moe-2b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                   head_dim=128, intermediate_size=3072, num_experts=64, num_experts_per_tok=8,
                   moe_intermediate_size=384, norm_topk_prob=True, tie_word_embeddings=False),
}
PEAK = {"cuda": 989e12}  # H200 SXM bf16 dense



def hf_config(shape: str, **extra):
    """The HF config of a shape: a Qwen2 (SHAPES) or a Qwen3-MoE (MOE_SHAPES), real vocabulary; ``extra`` sets or
    overrides fields."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                  torch_dtype="bfloat16")
    if shape in MOE_SHAPES:
        return Qwen3MoeConfig(**{**common, **MOE_SHAPES[shape], "decoder_sparse_step": 1, "mlp_only_layers": [],
                                 "use_sliding_window": False, "attention_bias": False,
                                 "architectures": ["Qwen3MoeForCausalLM"], **extra})
    hidden, layers, heads, kv, ffn, tied = SHAPES[shape]
    return Qwen2Config(**{**common, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                          "num_key_value_heads": kv, "intermediate_size": ffn, "tie_word_embeddings": tied, **extra})


def make_checkpoint(shape: str, out: str) -> str:
    """An HF checkpoint of the shape (``hf_config``) with random weights (bf16 safetensors)."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(shape)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    return out


def make_samples(n: int, prompt: int, lo: int, hi: int, vocab: int, group: int, seed: int = 0) -> list:
    from slime_lite.types import Sample, Status

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        resp = lo + (hi - lo) * i // max(n - 1, 1)  # evenly spread
        toks = torch.randint(0, vocab, (prompt + resp,), generator=g).tolist()
        out.append(Sample(group_index=i // group, index=i, tokens=toks, response_length=resp, loss_mask=[1] * resp,
                          reward=float(torch.rand((), generator=g) < 0.5), status=Status.COMPLETED))
    if n % group:
        return out
    groups = [out[k * group:(k + 1) * group] for k in range(n // group)]  # one prompt's samples stay adjacent
    return [s for k in torch.randperm(n // group, generator=g).tolist() for s in groups[k]]


def matmul_params(arch, active: bool = True) -> int:
    """Parameters of every matmul (all but the input embedding; the output projection counts even when tied). MoE:
    the router, the shared expert and its gate, and the top-k experts a token runs (``active``) or all of them."""
    h, moe = arch.hidden_size, arch.moe
    a, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    if moe is None:
        mlp = 3 * h * arch.ffn_hidden_size
    else:
        experts = moe.top_k if active else moe.num_experts
        mlp = h * moe.num_experts + 3 * h * (experts * moe.ffn_hidden_size + moe.shared_expert_size)
        mlp += h * bool(moe.shared_expert_size)
    return arch.num_layers * (2 * h * a + 2 * h * kv + mlp) + arch.vocab_size * h


def flops(arch, samples: list, passes: int) -> float:
    """passes: 1 = forward, 3 = forward + backward. MoE: active parameters only (``matmul_params``)."""
    L, a = arch.num_layers, arch.num_heads * arch.head_dim
    n = matmul_params(arch)
    tokens = sum(len(s.tokens) for s in samples)
    attn = 2 * L * a * sum(len(s.tokens) ** 2 for s in samples)
    return passes * (2 * n * tokens + attn)
