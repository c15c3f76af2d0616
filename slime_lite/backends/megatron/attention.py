"""Causal core attention for Megatron's local layer spec that never builds a [T, T] score matrix or mask.

Megatron-core 0.16's local ``DotProductAttention`` materialises the scores of every micro-batch (a 4k-token sample
of a 0.5B model ran out of 140 GB) and refuses packed sequences. ``FastCoreAttention`` replaces it in the local
spec (model.py ``layer_spec``) with the same constructor:

- padded rows ([s, b, heads, dim]) with no explicit mask: ``scaled_dot_product_attention(is_causal=True)`` (the
  flash / memory-efficient kernels on CUDA, the fused CPU kernel on CPU); right padding never reaches a real token;
- packed rows (``packed_seq_params.qkv_format == "thd"``, [t, heads, dim] and ``cu_seqlens``): causal attention
  inside each sample only, with one of two backends (``SLIME_LITE_PACKED_ATTENTION``):
  ``sdpa`` (per sample, any device and dtype; the default on CPU) or ``varlen`` (``torch.nn.attention.varlen``'s
  flash kernel, CUDA bf16/fp16; the default there when present). Both compute each sample on its own, so a
  sample's result does not depend on what else is packed with it (batch invariance, tests/backends/test_packing.py);
- anything else (an explicit mask, other mask types): Megatron's own implementation.

GQA key/value heads are shared with ``enable_gqa`` (no repeated copies).
"""

from __future__ import annotations

import inspect
import os
from itertools import pairwise

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

BACKENDS = ("auto", "sdpa", "varlen")


def packed_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The packed-attention backend for tensors of this device and dtype (SLIME_LITE_PACKED_ATTENTION, or auto)."""
    want = os.environ.get("SLIME_LITE_PACKED_ATTENTION", "auto")
    if want not in BACKENDS:
        raise ValueError(f"SLIME_LITE_PACKED_ATTENTION={want!r}: use one of {', '.join(BACKENDS)}")
    varlen_ok = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _varlen() is not None
    if want == "varlen" and not varlen_ok:
        raise ValueError("SLIME_LITE_PACKED_ATTENTION=varlen needs CUDA, bf16/fp16 and torch.nn.attention.varlen")
    if want == "auto":
        return "varlen" if varlen_ok else "sdpa"
    return want


def _varlen():
    """torch's varlen flash attention when this torch has it with the arguments used here (torch >= 2.12), else
    None (torch 2.11's has no ``enable_gqa``)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if {"window_size", "enable_gqa", "scale"} <= set(params) else None


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float, backend: str = "sdpa",
                            bounds: list[int] | None = None) -> torch.Tensor:
    """q [t, hq, d], k/v [t, hkv, d] of samples packed back to back (cu_seqlens [n+1]) -> [t, hq, d], each sample
    attending causally to itself only. ``bounds``: cu_seqlens as a host list, when the caller has it."""
    gqa = q.shape[1] != k.shape[1]
    if backend == "varlen":
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return _varlen()(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0), enable_gqa=gqa)
    # one split per tensor, not a slice per sample: the backward of a split is one concatenation, where each
    # slice's backward would write its gradient into a zeroed copy of the whole packed tensor (O(samples x T))
    lengths = [hi - lo for lo, hi in pairwise(bounds if bounds is not None else cu_seqlens.tolist())]
    if not lengths:
        return q.new_zeros(q.shape)
    out = []
    for qs, ks, vs in zip(*(x.split(lengths) for x in (q, k, v))):
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (qs, ks, vs))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        out.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(out)


class FastCoreAttention(DotProductAttention):
    """``DotProductAttention`` with flash-style causal attention for padded rows and packed (THD) samples."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        c = self.config
        plain = (attention_bias is None and c.softmax_type == "vanilla" and c.window_size is None
                 and not c.apply_query_key_layer_scaling and (not self.training or c.attention_dropout == 0.0))
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd" or not plain:
                raise ValueError("packed sequences need qkv_format='thd', no attention bias, window or dropout")
            cu = packed_seq_params.cu_seqlens_q
            out = packed_causal_attention(query, key, value, cu, int(packed_seq_params.max_seqlen_q),
                                          self.softmax_scale, packed_backend(query.device, query.dtype),
                                          getattr(packed_seq_params, "cu_seqlens_host", None))
            return out.reshape(out.shape[0], -1)
        if not plain or attention_mask is not None or mask_type != AttnMaskType.causal:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=None)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return o.permute(2, 0, 1, 3).reshape(o.shape[2], o.shape[0], -1)
