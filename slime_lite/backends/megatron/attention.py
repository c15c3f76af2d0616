"""Causal core attention for Megatron's local layer spec that never builds a [T, T] score matrix or mask.

Megatron-core 0.16's local ``DotProductAttention`` materialises the scores of every micro-batch (a 4k-token sample
of a 0.5B model ran out of 140 GB) and refuses packed sequences. ``FastCoreAttention`` replaces it in the local
spec (model.py ``layer_spec``) with the same constructor:

- padded rows ([s, b, heads, dim]) with no explicit mask: ``scaled_dot_product_attention(is_causal=True)`` (the
  flash / memory-efficient kernels on CUDA, the fused CPU kernel on CPU); right padding never reaches a real token;
- packed rows (``packed_seq_params.qkv_format == "thd"``, [t, heads, dim] and ``cu_seqlens``): causal attention
  inside each sample only, with one of three backends (``SLIME_LITE_PACKED_ATTENTION``, auto by default):
  ``varlen`` (``torch.nn.attention.varlen``'s flash kernel, CUDA bf16/fp16; auto's choice where torch has it),
  ``bucketed`` (samples padded to a length fixed by their own, ``bucket_length``, one batched causal SDPA call
  per length: a few calls per layer instead of one per sample; auto's choice on CUDA in bf16/fp16 otherwise) or ``sdpa`` (one
  call per sample, any device and dtype; auto's choice on CPU). Each computes a sample's rows from that sample
  alone, so its result does not depend on what else is packed with it (tests/backends/test_packing.py);
- anything else (an explicit mask, other mask types): Megatron's own implementation.

GQA key/value heads go to the flash kernel as they are (no repeated copies) with ``enable_gqa``, or where this
torch's varlen_attn passes them on unchecked (a probe on CUDA: ``_takes_fewer_kv_heads``).

Packed rows also get their RoPE here (``install_packed_rope``): Megatron's unfused RoPE for packed rows syncs with
the device, splits the rows per sample and concatenates the frequencies again, for q and for k of every layer
(rope_utils ``_apply_rotary_pos_emb_thd``); rows packed by ``packed_seq_params`` carry their positions, so the
frequencies are gathered once per micro-batch and applied in one call: the same values.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from itertools import pairwise

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.transformer import attention as megatron_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from slime_lite.backends.megatron import fused_ops

BACKENDS = ("auto", "sdpa", "varlen", "bucketed")


def packed_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The packed-attention backend for tensors of this device and dtype (SLIME_LITE_PACKED_ATTENTION, or auto)."""
    want = os.environ.get("SLIME_LITE_PACKED_ATTENTION", "auto")
    if want not in BACKENDS:
        raise ValueError(f"SLIME_LITE_PACKED_ATTENTION={want!r}: use one of {', '.join(BACKENDS)}")
    half = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)  # flash kernels, no score matrix
    varlen_ok = half and _varlen() is not None
    if want == "varlen" and not varlen_ok:
        raise ValueError("SLIME_LITE_PACKED_ATTENTION=varlen needs CUDA, bf16/fp16 and torch.nn.attention.varlen")
    if want == "auto":  # measured on an H200 (BENCHMARKS.md): bucketed 2x per-sample sdpa in the train phase
        return "varlen" if varlen_ok else "bucketed" if half else "sdpa"
    return want


@functools.cache
def _varlen():
    """torch's varlen flash attention as ``f(q, k, v, cu_seqlens, max_seqlen, scale)`` (causal), or None where this
    torch has none. Its arguments changed between releases: causality is ``window_size=(-1, 0)`` (torch >= 2.11) or
    ``is_causal=True`` (2.10); grouped key/value heads are passed as they are with ``enable_gqa`` (torch >= 2.12),
    or where this torch's varlen_attn hands them to the flash kernel unchecked (``_takes_fewer_kv_heads``), and are
    otherwise repeated to the query heads (a copy of k and v per layer, and a sum in the backward); without
    ``scale`` q is pre-scaled."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {} if _takes_fewer_kv_heads(varlen_attn, causal) else None

    def run(q, k, v, cu, max_seqlen, scale):
        kw = dict(causal)
        if q.shape[1] != k.shape[1]:
            if gqa is not None:
                kw.update(gqa)
            else:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if "scale" in params:
            kw["scale"] = scale
        elif not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
            q = q * (scale * q.shape[-1] ** 0.5)
        return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)

    run.native_gqa = gqa is not None
    return run


def _takes_fewer_kv_heads(varlen_attn, causal: dict) -> bool:
    """Whether this torch's varlen_attn (one without ``enable_gqa``) runs grouped key/value heads as the flash kernel
    does natively: a tiny causal call on CUDA, forward and backward, against the same call with the heads repeated
    (the output equal, the gradients within bf16 rounding of the repeat's sum). False without CUDA or on an error."""
    if not torch.cuda.is_available():
        return False
    try:
        with torch.inference_mode(False), torch.enable_grad():  # the first call may come from a log-prob pass
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(8, h, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                       for h in (4, 2, 2))
            cu = torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda")
            runs = []
            for kk, vv in ((k, v), (k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1))):
                out = varlen_attn(q, kk, vv, cu, cu, 5, 5, **causal)
                runs.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
        return torch.equal(runs[0][0], runs[1][0]) and all(
            torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in zip(runs[0][1:], runs[1][1:]))
    except RuntimeError:
        return False


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float, backend: str = "sdpa",
                            bounds: list[int] | None = None) -> torch.Tensor:
    """q [t, hq, d], k/v [t, hkv, d] of samples packed back to back (cu_seqlens [n+1]) -> [t, hq, d], each sample
    attending causally to itself only. ``bounds``: cu_seqlens as a host list, when the caller has it."""
    gqa = q.shape[1] != k.shape[1]
    if backend == "varlen":
        return _varlen()(q, k, v, cu_seqlens.to(device=q.device, dtype=torch.int32), max_seqlen, scale)
    if backend == "bucketed":
        host = tuple(bounds if bounds is not None else cu_seqlens.tolist())
        if len(host) < 2 or host[-1] == 0:
            return q.new_zeros(q.shape)
        shapes, gather, scatter = _bucket_plan(host, str(q.device))
        # one gather per tensor for every bucket (index_select: its backward adds, where advanced indexing sorts)
        qs, ks, vs = (x.index_select(0, gather).split([b * n for b, n in shapes]) for x in (q, k, v))
        pieces = []
        for (b, n), qb, kb, vb in zip(shapes, qs, ks, vs):
            qb, kb, vb = (x.view(b, n, *x.shape[1:]).transpose(1, 2) for x in (qb, kb, vb))  # [b, heads, n, d]
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
            pieces.append(o.transpose(1, 2).reshape(b * n, o.shape[1], o.shape[3]))
        return torch.cat(pieces).index_select(0, scatter)  # the real rows back in packed order
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
    """The padded length of a sample of n tokens in the bucketed backend: n rounded up to its top 3 bits (under 25%
    padding, four lengths per power of two). It depends on n alone, so a sample's attention is computed with the
    same shapes whatever it is packed with (a kernel's rounding may depend on the padded length: batch invariance
    needs it fixed per sample)."""
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


@functools.lru_cache(maxsize=16)
def _bucket_plan(bounds: tuple[int, ...], device: str) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
    """Samples (cu_seqlens ``bounds``) grouped by ``bucket_length``: the [samples, length] shape of each group, the
    packed row of each padded position of every group back to back (a pad repeats its sample's last row: as a key
    it sits after every real query, so causality masks it; its gradient is zero) and, per packed row, its position
    among the padded ones. Cached: every layer of a micro-batch uses the same plan."""
    starts, lengths = list(bounds[:-1]), [hi - lo for lo, hi in pairwise(bounds)]
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            groups.setdefault(bucket_length(n), []).append(i)
    shapes, gather, scatter = [], [], torch.empty(bounds[-1], dtype=torch.long)
    offset = 0
    for size, g in sorted(groups.items()):
        pos = torch.arange(size)
        for i in g:
            gather.append(starts[i] + pos.clamp(max=lengths[i] - 1))
            scatter[starts[i]:starts[i] + lengths[i]] = offset + pos[: lengths[i]]
            offset += size
        shapes.append((len(g), size))
    return shapes, torch.cat(gather).to(device), scatter.to(device)


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


def mark_packed_positions(cu_seqlens: torch.Tensor, bounds: list[int]) -> None:
    """Tag a micro-batch's cu_seqlens with the position of each packed row (0.. per sample, from the host copy
    ``bounds``) and a cache of the frequencies gathered for it (install_packed_rope)."""
    pos = torch.cat([torch.arange(hi - lo) for lo, hi in pairwise(bounds)]) if len(bounds) > 1 else torch.zeros(0)
    cu_seqlens.slime_positions = pos.to(device=cu_seqlens.device, dtype=torch.long, non_blocking=True)
    cu_seqlens.slime_freqs = {}


def install_packed_rope() -> None:
    """Route Megatron's attention RoPE through ``_packed_rope`` (once; every other call is passed through)."""

    if getattr(megatron_attention.apply_rotary_pos_emb, "slime_lite", False):
        return
    original = megatron_attention.apply_rotary_pos_emb

    def _packed_rope(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        pos = getattr(cu_seqlens, "slime_positions", None)
        if (pos is None or config.apply_rope_fusion or config.context_parallel_size > 1
                or (cp_group is not None and cp_group.size() > 1)):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)

        key = (freqs.data_ptr(), tuple(freqs.shape))
        packed = cu_seqlens.slime_freqs.get(key)
        if packed is None:  # the frequencies of each row's own position: [t, 1, 1, d], once per micro-batch
            packed = cu_seqlens.slime_freqs[key] = freqs.index_select(0, pos)
        if fused_ops.available(t) and not config.multi_latent_attention and t.dim() == 3 and t.stride(-1) == 1:
            tables = cu_seqlens.slime_freqs.get((key, t.dtype, mscale))
            if tables is None:  # cos and sin as Megatron rounds them, once per micro-batch (not per q, k, layer)
                flat = packed.reshape(packed.shape[0], -1)
                tables = cu_seqlens.slime_freqs[(key, t.dtype, mscale)] = tuple(
                    (fn(flat) * mscale).to(t.dtype) for fn in (torch.cos, torch.sin))
            return fused_ops.rope(t, *tables, interleaved=config.rotary_interleaved)
        return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=config.rotary_interleaved,
                                          multi_latent_attention=config.multi_latent_attention,
                                          mscale=mscale).squeeze(1)

    _packed_rope.slime_lite = True
    megatron_attention.apply_rotary_pos_emb = _packed_rope
