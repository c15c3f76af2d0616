"""Causal core attention for Megatron's local layer spec that never builds a [T, T] score matrix or mask.

Megatron-core 0.16's local ``DotProductAttention`` materialises the scores of every micro-batch (a 4k-token sample
of a 0.5B model ran out of 140 GB) and refuses packed sequences. ``FastCoreAttention`` replaces it in the local
spec (model.py ``layer_spec``) with the same constructor:

- padded rows ([s, b, heads, dim]) with no explicit mask: ``scaled_dot_product_attention(is_causal=True)`` (the
  flash / memory-efficient kernels on CUDA, the fused CPU kernel on CPU); right padding never reaches a real token;
- packed rows (``packed_seq_params.qkv_format == "thd"``, [t, heads, dim] and ``cu_seqlens``): causal attention
  inside each sample only, with one of two backends (``SLIME_LITE_PACKED_ATTENTION``):
  ``sdpa`` (per sample, any device and dtype; the default on CPU), ``varlen`` (``torch.nn.attention.varlen``'s
  flash kernel, CUDA bf16/fp16; the default there when present) or ``bucketed`` (opt-in: samples padded to a
  length fixed by their own (``bucket_length``), one batched causal SDPA call per length, a few calls per layer
  instead of one per sample, for a torch without the varlen kernel; not yet measured on a GPU). Each computes a sample's rows from that
  sample alone, so its result does not depend on what else is packed with it (tests/backends/test_packing.py);
- anything else (an explicit mask, other mask types): Megatron's own implementation.

GQA key/value heads are shared with ``enable_gqa`` (no repeated copies).
"""

from __future__ import annotations

import functools
import inspect
import os
from itertools import pairwise

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

BACKENDS = ("auto", "sdpa", "varlen", "bucketed")


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
    if backend == "bucketed":
        host = tuple(bounds if bounds is not None else cu_seqlens.tolist())
        if len(host) < 2:
            return q.new_zeros(q.shape)
        groups, order = _bucket_plan(host, str(q.device))
        pieces = []
        for idx, valid in groups:  # idx [b, L]: packed row of each (sample, position); pads repeat the last row
            qs, ks, vs = (x[idx].transpose(1, 2) for x in (q, k, v))  # [b, heads, L, d]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
            pieces.append(o.transpose(1, 2)[valid])  # the real rows, sample by sample
        return torch.cat(pieces).index_select(0, order)
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


def bucket_length(n: int) -> int:
    """The padded length of a sample of n tokens in the bucketed backend: n rounded up to its top 4 bits (under
    12.5% padding). It depends on n alone, so a sample's attention is computed with the same shapes whatever it is
    packed with (a kernel's rounding may depend on the padded length: batch invariance needs it fixed per sample)."""
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


@functools.lru_cache(maxsize=16)
def _bucket_plan(bounds: tuple[int, ...], device: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Samples (cu_seqlens ``bounds``) grouped by ``bucket_length``: per group the gather index [b, L] into the
    packed rows (a pad repeats the sample's last row: as a key it sits after every real query, so causality masks
    it) and the mask of real rows; and the permutation that puts the groups' real rows back in packed order.
    Cached: every layer of a micro-batch uses the same plan."""
    starts, lengths = list(bounds[:-1]), [hi - lo for lo, hi in pairwise(bounds)]
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            groups.setdefault(bucket_length(n), []).append(i)
    plan, rows = [], []
    for size, g in sorted(groups.items()):
        pos = torch.arange(size)
        lens = torch.tensor([lengths[i] for i in g])
        idx = torch.tensor([starts[i] for i in g])[:, None] + torch.minimum(pos[None, :], (lens - 1)[:, None])
        valid = pos[None, :] < lens[:, None]
        rows.append(idx[valid])
        plan.append((idx.to(device), valid.to(device)))
    return plan, torch.argsort(torch.cat(rows)).to(device)


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
