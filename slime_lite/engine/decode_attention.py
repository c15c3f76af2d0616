"""Decode attention over each row's own length, by a Triton kernel (CUDA graph steps).

A padded decode step attends over the first ``L`` cache positions, ``L`` its length bucket, with a mask per row:
SDPA then reads ``L`` positions of K and V for every row, though a row needs only ``position + 1`` of them. In an
RL rollout lengths spread widely (a few long answers set the bucket), so most of that read is wasted. Here each
row reads its own prefix only:

``partial``: one program per (row, KV head, split of ``chunk`` positions) keeps the query heads of its KV head
together (GQA: K and V read once for all of them) and writes the split's softmax-weighted sum of V with its max and
sum of exponentials (flash-decoding); a split past the row's length writes exact zeros. The last program of a (row,
KV head) to finish (a counter each, reset by that program) joins the splits in split order, so the result does not
depend on which finishes last; with one split (a length bucket up to ``chunk``) the program writes the result
itself, which is what the join would write, bit for bit.

Launched with programmatic dependent launch (Hopper), it reads its block of K and V while the kernel before it still
runs: all but the row's current position, which that kernel (the rotary) writes; that one and the query come after
the wait. With ``rope`` (captured steps of up to ``ROPE_MAX_ROWS`` rows) it also does the rotary's work for its
(row, KV head): the query heads and the new k head come from the q/k/v product's row, normed (QK-norm) and rotated
after the wait, and the split that holds the row's position writes the new k and v heads into the cache: no rotary
kernel of its own.

Splits sit at fixed positions (multiples of ``chunk``, which depends on the head size and dtype only), so a row's
result does not depend on its batch, its slot or the length bucket. Each row's slot and length are read on the
device: a captured graph serves any slots, and any lengths up to its bucket. Used for captured steps on CUDA with
Triton (head sizes up to 256; one that is not a power of two is padded inside the kernels); elsewhere the step keeps
SDPA with a mask over K/V gathered from the rows' slots (a copy per layer: the CPU and the fallback path).
"""

from __future__ import annotations

import torch

from slime_lite.triton_build import COUNTERS, counters, pdl_args, triton_kernels

BLOCK_BYTES = 32768  # of K (and of V) per split, held in registers: the split's positions follow from it (``chunk``)
NUM_WARPS = 8  # of ``partial``: its split's K and V in ~125 registers a thread (sm_90 build; ~250 with 4 warps)


ENABLED = True  # False: captured steps keep SDPA with a mask (benchmarks compare the two in one process)
# captured steps of up to this many rows rotate q and k inside ``partial``, where a kernel less is worth more than
# the registers it adds (~160-200 instead of ~125 a thread on sm_90: one block of 8 warps an SM, not two); past it
# (and at 0) ``fused_layer.rotary``'s kernel runs first
ROPE_MAX_ROWS = 32


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """The kernels serve this model's captured steps: CUDA, Triton installed, a head size up to 256 (padded to a
    power of two >= 16 inside the kernels)."""
    return (ENABLED and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and 0 < head_dim <= 256 and _kernels() is not None)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def chunk(head_dim: int, dtype: torch.dtype) -> int:
    """Positions per split: ``BLOCK_BYTES`` of K over the padded head size, 64 to 256 (256 for a head size of 64 in
    bf16, 128 for 128). Part of the result's definition: the splits' sums are joined in order."""
    return min(256, max(64, BLOCK_BYTES // (_pow2(head_dim) * torch.finfo(dtype).bits // 8)))


@triton_kernels
def _kernels(triton, tl):
    @triton.jit(do_not_specialize=["splits"])  # not a variant per split count (compiled mid-rollout)
    def partial(q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, o_ptr, ml_ptr, out_ptr, cnt_ptr, cos_ptr, sin_ptr, qkn_ptr,
                q_sb, q_sh, q_sr, c_sb, c_sh, c_st, out_sb, out_sh, out_sr, k_off, v_off, n_rep, heads, splits, scale,
                eps,
                R: tl.constexpr, D: tl.constexpr, DH: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr,
                SINGLE: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr,
                GDC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        s = tl.program_id(2)
        slot = tl.load(slot_ptr + b).to(tl.int64)  # the step's inputs, in place before the step runs
        cur = tl.load(pos_ptr + b).to(tl.int32)  # the row's current position, the last it attends to
        t = s * CHUNK + tl.arange(0, CHUNK)
        rows = tl.arange(0, R)
        dims = tl.arange(0, D)  # D: the head size DH padded to a power of two (the padding reads and adds zeros)
        live = rows < n_rep
        head = dims < DH
        base = slot * c_sb + h * c_sh
        off = base + t[:, None].to(tl.int64) * c_st + dims[None, :]
        # Before the wait: the positions before the current one, written by earlier steps. The kernel just before
        # this one writes the current position and the query (the rotary; with ROPE, the q/k/v product); earlier
        # kernels are done by now (each kernel of the step lets the next one start only after its own wait).
        old = (t < cur)[:, None] & head[None, :]
        k = tl.load(k_ptr + off, mask=old, other=0.0)
        v = tl.load(v_ptr + off, mask=old, other=0.0)
        if ROPE:  # and the rotary table's row at the row's position, and the QK-norm weights
            if INTERLEAVED:  # rotary pairs (0, 1), (2, 3), ...
                pair = dims ^ 1
            else:  # pairs (d, d + DH / 2)
                pair = tl.where(dims < DH // 2, dims + DH // 2, dims - DH // 2)
            c = tl.load(cos_ptr + cur.to(tl.int64) * DH + dims, mask=head, other=0.0).to(tl.float32)
            sn = tl.load(sin_ptr + cur.to(tl.int64) * DH + dims, mask=head, other=0.0).to(tl.float32)
            if HAS_NORM:  # q_norm's weight (for the query heads), then k_norm's (for the k head)
                wq = tl.load(qkn_ptr + dims, mask=head, other=0.0).to(tl.float32)
                wq_p = tl.load(qkn_ptr + pair, mask=head, other=0.0).to(tl.float32)
                wk = tl.load(qkn_ptr + DH + dims, mask=head, other=0.0).to(tl.float32)
                wk_p = tl.load(qkn_ptr + DH + pair, mask=head, other=0.0).to(tl.float32)
        if GDC:  # launched with PDL (triton_build.pdl_args)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if s * CHUNK <= cur:  # (a split past the row's length reads nothing more and writes exact zeros)
            here = head & (dims * 0 + cur // CHUNK == s)  # this split holds the current position (a vector:
            # Triton's interpreter, the CPU tests, mis-types a scalar condition inside a mask)
            now = (t == cur)[:, None]
            at = base + cur.to(tl.int64) * c_st + dims
            if ROPE:  # q's heads and the new k head from the product's row, normed and rotated as ``rope`` does
                is_k = (rows == n_rep)[:, None]  # the tile's row after the query heads holds the new k head
                src = tl.where(is_k, k_off + h * DH, h * q_sh + rows[:, None] * q_sr)
                got = (rows <= n_rep)[:, None] & head[None, :]
                x = tl.load(q_ptr + b * q_sb + src + dims[None, :], mask=got, other=0.0)
                partner = tl.load(q_ptr + b * q_sb + src + pair[None, :], mask=got, other=0.0)
                if HAS_NORM:  # each head's RMSNorm first
                    wn = tl.where(is_k, wk[None, :], wq[None, :])
                    wp = tl.where(is_k, wk_p[None, :], wq_p[None, :])
                    xf = x.to(tl.float32)
                    r = tl.rsqrt(tl.sum(xf * xf, axis=1) / DH + eps)[:, None]
                    x = (wn * (xf * r).to(x.dtype).to(tl.float32)).to(x.dtype)
                    partner = (wp * (partner.to(tl.float32) * r).to(x.dtype).to(tl.float32)).to(x.dtype)
                ra = (x.to(tl.float32) * c[None, :]).to(x.dtype)
                rb = (partner.to(tl.float32) * sn[None, :]).to(x.dtype)
                x = (ra.to(tl.float32) + rb.to(tl.float32)).to(x.dtype)
                k_new = tl.sum(tl.where(is_k, x.to(tl.float32), 0.0), axis=0).to(x.dtype)
                v_new = tl.load(q_ptr + b * q_sb + v_off + h * DH + dims, mask=head, other=0.0)
                tl.store(k_ptr + at, k_new, mask=here)  # into the cache: the split that holds the position
                tl.store(v_ptr + at, v_new, mask=here)
                q = tl.where(live[:, None], x, 0.0).to(x.dtype)
            else:
                k_new = tl.load(k_ptr + at, mask=here, other=0.0)
                v_new = tl.load(v_ptr + at, mask=here, other=0.0)
                q = tl.load(q_ptr + b * q_sb + h * q_sh + rows[:, None] * q_sr + dims[None, :],
                            mask=live[:, None] & head[None, :], other=0.0)
            k = tl.where(now, k_new[None, :], k)
            v = tl.where(now, v_new[None, :], v)
            if IEEE:
                sc = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                sc = tl.dot(q, tl.trans(k))
            sc = tl.where((t <= cur)[None, :], sc * scale, -float("inf"))
            m = tl.max(sc, axis=1)
            p = tl.exp(sc - m[:, None])
            l_sum = tl.sum(p, axis=1)
            if IEEE:
                acc = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v)
        else:
            m = tl.full((R,), -float("inf"), tl.float32)
            l_sum = tl.zeros((R,), tl.float32)
            acc = tl.zeros((R, D), tl.float32)
        if SINGLE:  # one split: the result itself, as the splits' join below would write it
            tl.store(out_ptr + b * out_sb + h * out_sh + rows[:, None] * out_sr + dims[None, :],
                     (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None] & head[None, :])
        else:
            first = (b * heads + h) * splits * n_rep  # the (row, KV head)'s splits: [rows, D] floats, max and sum
            at = first + s * n_rep
            tl.store(o_ptr + (at + rows[:, None]) * D + dims[None, :], acc, mask=live[:, None])
            tl.store(ml_ptr + 2 * (at + rows), m, mask=live)
            tl.store(ml_ptr + 2 * (at + rows) + 1, l_sum, mask=live)
            tl.debug_barrier()  # every thread's stores made before the counter moves
            if tl.atomic_add(cnt_ptr + b * heads + h, 1) == splits - 1:  # acq_rel: the last split joins them all
                top = tl.full((R,), -float("inf"), tl.float32)
                for j in range(splits):
                    top = tl.maximum(top, tl.load(ml_ptr + 2 * (first + j * n_rep + rows), mask=live, other=0.0,
                                                  cache_modifier=".cg"))
                total = tl.zeros((R,), tl.float32)
                acc = tl.zeros((R, D), tl.float32)
                for j in range(splits):  # in split order: the result does not depend on which split ends last
                    row_at = first + j * n_rep + rows
                    w = tl.exp(tl.load(ml_ptr + 2 * row_at, mask=live, other=0.0, cache_modifier=".cg") - top)  # 0
                    # for an empty split (max -inf)
                    total += w * tl.load(ml_ptr + 2 * row_at + 1, mask=live, other=0.0, cache_modifier=".cg")
                    acc += w[:, None] * tl.load(o_ptr + row_at[:, None] * D + dims[None, :], mask=live[:, None],
                                                other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + b * out_sb + h * out_sh + rows[:, None] * out_sr + dims[None, :],
                         (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None] & head[None, :])
                tl.atomic_xchg(cnt_ptr + b * heads + h, 0)  # ready for the next kernel (or graph replay)

    return partial


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor, scale: float, rope: tuple | None = None) -> torch.Tensor:
    """Attention of one query per row over cache positions ``0..positions[b]`` of slot ``slots[b]``.

    q [B, kv_heads, n_rep, D] (the query heads grouped by their KV head); keys, values [S, kv_heads, L, D] with the
    last dimension contiguous (views of one layer's cache over its S slots and the step's L positions); slots and
    positions [B], each below S and L (read on the device, not checked). Returns [B, kv_heads, n_rep, D] in q's
    dtype.

    ``rope=(cos, sin, qk_norm, eps, interleaved)`` (``fused_layer.rotary``'s, but ``cos``/``sin`` the whole
    rotary tables ``[>= L, D]``, contiguous, read at each row's position): ``q`` is instead the step's q/k/v product
    ``[B, (heads + 2 kv_heads) * D]`` (rows with a contiguous last dimension), before the rotary. The kernel norms
    (with ``qk_norm``) and rotates the query heads and the row's new k head as ``rotary`` does, and writes the new k
    and v heads into ``keys``/``values`` at each row's position (below ``L``, as every position here): one kernel
    per layer fewer than ``rotary`` then attention, and no gathers of the tables' rows before the step. The
    results equal those (same bits in Triton's interpreter; compiled, the QK-norm's sum of squares is added in
    another order, which can change q and k by one rounding step)."""
    d = keys.shape[3]
    if rope is not None:
        cos, sin, qk_norm, eps, interleaved = rope
        kv_heads, width = keys.shape[1], q.shape[-1]
        if (q.dim() != 2 or width % d or width // d <= 2 * kv_heads or (width // d - 2 * kv_heads) % kv_heads
                or q.stride(-1) != 1 or d % 2):
            raise ValueError(f"decode_attention: with rope, q must be the q/k/v rows [B, (heads + 2 kv_heads) * D] "
                             f"with a contiguous last dimension and an even D (got {tuple(q.shape)} for {kv_heads} "
                             f"kv heads of {d})")
        if keys.dtype != q.dtype:
            raise ValueError(f"decode_attention: with rope, q ({q.dtype}) must be in the cache's dtype ({keys.dtype})")
        if (cos.dim() != 2 or cos.shape[0] < keys.shape[2] or cos.shape[1] != d or sin.shape != cos.shape
                or not (cos.is_contiguous() and sin.is_contiguous())):
            raise ValueError(f"decode_attention: with rope, cos and sin must be contiguous rotary tables [>= "
                             f"{keys.shape[2]}, {d}] (got {tuple(cos.shape)} and {tuple(sin.shape)})")
        if qk_norm is not None and (qk_norm.numel() != 2 * d or not qk_norm.is_contiguous()):
            raise ValueError(f"decode_attention: qk_norm must be the contiguous [{2 * d}] weights of q_norm then "
                             "k_norm")
        qkv, heads = q, width // d - 2 * kv_heads
        q = qkv[:, : heads * d].view(-1, kv_heads, heads // kv_heads, d)  # the query heads, for shapes and strides
    b, heads, n_rep, d = q.shape
    if keys.stride() != values.stride() or keys.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode_attention: keys and values must share strides, with contiguous head dimensions")
    if (keys.shape != values.shape or keys.shape[1] != heads or keys.shape[3] != d or slots.shape != (b,)
            or positions.shape != (b,)):
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values "
                         f"{tuple(values.shape)}, slots {tuple(slots.shape)} and positions {tuple(positions.shape)} "
                         "do not fit together (q [B, kv_heads, n_rep, D], keys/values [S, kv_heads, L, D], slots and "
                         "positions [B])")
    size = chunk(d, q.dtype)
    splits = -(-keys.shape[2] // size)
    dp = _pow2(d)
    out = torch.empty(b, heads, n_rep, d, dtype=q.dtype, device=q.device)
    single = splits == 1  # lengths up to one split: the program writes the result, no partial sums
    parts = torch.empty(0 if single else b * heads * splits * n_rep, dp, dtype=torch.float32, device=q.device)
    stats = torch.empty(0 if single else b * heads * splits * n_rep, 2, dtype=torch.float32, device=q.device)
    r = _pow2(n_rep + (rope is not None))  # with rope, the row after the query heads holds the new k head
    table = (cos, sin, qk_norm if qk_norm is not None else cos) if rope is not None else (q, q, q)
    k_off = heads * n_rep * d
    if b * heads > COUNTERS:
        raise ValueError(f"decode_attention: {b} rows x {heads} KV heads past the {COUNTERS} counters")
    with torch.cuda.device(q.device if q.is_cuda else -1):  # -1: a CPU tensor under the Triton interpreter (tests)
        _kernels()[(b, heads, splits)](
            q, keys, values, slots, positions, parts, stats, out, counters(q), *table, q.stride(0), q.stride(1),
            q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2), out.stride(0), out.stride(1), out.stride(2),
            k_off, k_off + heads * d, n_rep, heads, splits, float(scale), float(eps) if rope is not None else 0.0, R=r,
            D=dp, DH=d, CHUNK=size, IEEE=q.dtype == torch.float32, SINGLE=single, ROPE=rope is not None,
            HAS_NORM=rope is not None and qk_norm is not None, INTERLEAVED=rope is not None and interleaved,
            num_warps=NUM_WARPS, **pdl_args(q))
    return out
