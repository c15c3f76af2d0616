"""The matrix products of captured decode steps at small batches, with the norm before them and the activation after.

At batch 1-32 a decode step's products read each weight matrix once for a few rows: cuBLAS then runs them at a
fraction of the memory bandwidth (an H200, batch 1, the 0.5B shape: 4.3 us for the 2 MB q/k/v projection, 6.9 us
for the 8.7 MB down projection with its split-K reduction kernel), and the RMSNorm before a product and the SiLU
after it are kernels of their own. ``linear`` here is one Triton kernel for ``y = f(x) @ w.T + b`` with ``x`` of at
most ``MAX_ROWS`` rows:

- ``f`` is the identity, or the layer's RMSNorm, optionally of ``x + add`` (the residual add, written out as the new
  hidden state): computed in float32 and rounded where ``fused_layer.rms_norm`` rounds;
- ``swiglu``: ``w`` is a gate/up projection (gate rows first) and the result is ``silu(gate) * up``, each rounded to
  the model dtype as the eager pieces round them;
- the reduction over ``K`` is split over programs when the output is narrow (``split``); the last program of each
  tile to finish adds the splits' float32 partial sums in a fixed order (a counter per tile, reset by that program),
  so the result does not depend on which program finishes first.

The products accumulate in float32 in another order than cuBLAS's, so results differ from ``F.linear`` by float32
rounding before the final rounding to the model dtype.
"""

from __future__ import annotations

import torch

from slime_lite.triton_build import triton_kernels

MAX_ROWS = 32  # more rows: cuBLAS
_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device: zeros, each reset to 0 by the kernel that uses it


@triton_kernels
def _kernels(triton, tl):
    @triton.jit
    def skinny(x_ptr, add_ptr, ln_ptr, h_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, eps, SPLIT,
               NORM: tl.constexpr, ADD: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        row_ok = rm < M
        out_n = N // 2 if SWIGLU else N  # columns of y
        col_ok = rn < out_n
        dt = y_ptr.dtype.element_ty
        r = tl.zeros((BM,), tl.float32)
        if NORM:  # the rows' RMS over all of K (and the residual sum, stored by one program)
            sq = tl.zeros((BM,), tl.float32)
            for k0 in range(0, K, BK):
                rk = k0 + tl.arange(0, BK)
                m2 = row_ok[:, None] & (rk[None, :] < K)
                x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m2, other=0.0)
                if ADD:
                    x = (x.to(tl.float32) + tl.load(add_ptr + rm[:, None] * K + rk[None, :], mask=m2,
                                                    other=0.0).to(tl.float32)).to(dt)
                    if (pid_n == 0) & (pid_k == 0):
                        tl.store(h_ptr + rm[:, None] * K + rk[None, :], x, mask=m2)
                xf = x.to(tl.float32)
                sq += tl.sum(xf * xf, axis=1)
            r = tl.rsqrt(sq / K + eps)
        k_per = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
        k_lo = pid_k * k_per
        acc = tl.zeros((BM, BN), tl.float32)
        acc_up = tl.zeros((BM, BN), tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + k_per, K), BK):
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < K
            m2 = row_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m2, other=0.0)
            if NORM:
                if ADD:
                    x = (x.to(tl.float32) + tl.load(add_ptr + rm[:, None] * K + rk[None, :], mask=m2,
                                                    other=0.0).to(tl.float32)).to(dt)
                normed = (x.to(tl.float32) * r[:, None]).to(dt)
                g = tl.load(ln_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
                x = (g[None, :] * normed.to(tl.float32)).to(dt)
            wm = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=wm, other=0.0)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
            if SWIGLU:
                wu = tl.load(w_ptr + (rn[:, None] + out_n) * K + rk[None, :], mask=wm, other=0.0)
                if IEEE:
                    acc_up += tl.dot(x, tl.trans(wu), input_precision="ieee")
                else:
                    acc_up += tl.dot(x, tl.trans(wu))
        out_ok = row_ok[:, None] & col_ok[None, :]
        last = True
        if SPLITS:  # SPLIT > 1: partial sums to the scratch; the tile's last program adds them in split order
            rows = tl.num_programs(2) * BM
            at = (pid_k * rows + rm[:, None]) * out_n + rn[None, :]
            tl.store(part_ptr + at, acc, mask=out_ok)
            if SWIGLU:
                tl.store(part_ptr + SPLIT * rows * out_n + at, acc_up, mask=out_ok)
            tile = pid_m * tl.num_programs(0) + pid_n
            last = tl.atomic_add(cnt_ptr + tile, 1) == SPLIT - 1  # acq_rel: the others' partials are visible
            if last:
                acc = tl.zeros((BM, BN), tl.float32)
                acc_up = tl.zeros((BM, BN), tl.float32)
                for s in range(SPLIT):
                    at = (s * rows + rm[:, None]) * out_n + rn[None, :]
                    acc += tl.load(part_ptr + at, mask=out_ok, other=0.0, cache_modifier=".cg")
                    if SWIGLU:
                        acc_up += tl.load(part_ptr + SPLIT * rows * out_n + at, mask=out_ok, other=0.0,
                                          cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call (or graph replay)
        if last:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                if SWIGLU:
                    acc_up += tl.load(b_ptr + out_n + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:  # as the eager pieces round: the products, the activation, its product with up
                gate = acc.to(dt).to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
                out = (act * acc_up.to(dt).to(tl.float32)).to(dt)
            else:
                out = acc.to(dt)
            tl.store(y_ptr + rm[:, None] * out_n + rn[None, :], out, mask=out_ok)

    return skinny


def usable(x: torch.Tensor) -> bool:
    rows = x.numel() // x.shape[-1]
    return rows <= MAX_ROWS and _kernels() is not None


def config(rows: int, n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, split) for ``rows`` x ``k`` times ``k`` x ``n`` (``n``: the output's columns): enough programs
    to cover the device's ``sms`` about twice, each reading whole ``BK`` blocks of ``k``."""
    bm = 16 if rows <= 16 else 32
    bn, bk = 64, 128
    tiles = -(-n // bn)
    blocks = -(-k // bk)
    split = max(1, min(blocks, (2 * sms) // tiles))
    split = -(-blocks // -(-blocks // split))  # no empty split
    return bm, bn, bk, split


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, norm: torch.Tensor | None = None,
           eps: float = 1e-6, add: torch.Tensor | None = None, swiglu: bool = False, cfg=None):
    """``y = f(x) @ w.T + b`` for ``x [..., K]`` of at most ``MAX_ROWS`` rows (contiguous), ``w [N, K]``
    (contiguous), in ``x``'s dtype. ``norm``: ``f`` is RMSNorm with that weight (``eps``); with ``add`` too, of
    ``x + add``, and the sum is returned: ``(x + add, y)``. ``swiglu``: ``y = silu(gate) * up`` of the ``N / 2``
    gate and up columns. ``cfg``: ``config``'s tuple (benchmarks)."""
    k = x.shape[-1]
    rows = x.numel() // k
    n = w.shape[0]
    if rows > MAX_ROWS or not (x.is_contiguous() and w.is_contiguous()) or w.shape[1] != k or (swiglu and n % 2):
        raise ValueError(f"skinny_gemm.linear: x {tuple(x.shape)} (at most {MAX_ROWS} rows, contiguous) and w "
                         f"{tuple(w.shape)} (contiguous, [N, K]; N even with swiglu) do not fit")
    if add is not None and (norm is None or add.shape != x.shape or not add.is_contiguous()):
        raise ValueError("skinny_gemm.linear: add needs norm, and x's shape, contiguous")
    out_n = n // 2 if swiglu else n
    y = torch.empty(*x.shape[:-1], out_n, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if add is not None else y
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
    bm, bn, bk, split = cfg or config(rows, out_n, k, sms)
    grid = (-(-out_n // bn), split, -(-rows // bm))
    part = torch.empty(split * grid[2] * bm * out_n * (2 if swiglu else 1) if split > 1 else 0, dtype=torch.float32,
                       device=x.device)
    cnt = _COUNTERS.get(x.device)
    if cnt is None or cnt.numel() < grid[0] * grid[2]:
        cnt = _COUNTERS[x.device] = torch.zeros(max(4096, grid[0] * grid[2]), dtype=torch.int32, device=x.device)
    with torch.cuda.device(x.device if x.is_cuda else -1):  # -1: the Triton interpreter (tests)
        _kernels()[grid](x, add if add is not None else x, norm if norm is not None else x, h, w,
                         b if b is not None else w, y, part, cnt, rows, n, k, float(eps), split,
                         NORM=norm is not None, ADD=add is not None, HAS_BIAS=b is not None, SWIGLU=swiglu, BM=bm,
                         BN=bn, BK=bk, SPLITS=split > 1, IEEE=x.dtype == torch.float32, num_warps=4)
    return (h, y) if add is not None else y
