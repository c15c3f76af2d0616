"""The matrix products of captured decode steps at a few rows, as Triton kernels that start before their input exists.

At batch 1-32 a decode layer is a chain of ~10 dependent kernels of 1.5-7 us each on an H200, mostly latency (the
launch, the first loads) rather than bytes. On Hopper a kernel launched with programmatic dependent launch (PDL)
may start while the kernel before it still runs, and waits for it (``griddepcontrol.wait``) only where it needs its
output. ``linear`` here loads the first slice of its share of the weights first (they do not depend on the
previous kernel), then waits, then reads the rows: those weight reads overlap the previous kernel. Before that
its programs may ask a later product's weights into L2 (``ahead``), for the next products to find there. The
engine's other decode kernels (norms, rotary, attention) likewise read what the kernel before them does not write
(weights, the step's tables, earlier positions of the KV cache) before their wait, and let the next kernel launch
right after it (``triton_build.pdl_args``); cuBLAS's products can do neither, so with PDL these products replace
them.

``y = x @ w.T + b`` for ``x`` of at most ``MAX_ROWS`` rows: each program reads ``BN x BK`` tiles of ``w`` (``KSTEPS``
consecutive ``BK`` slices of ``K``: the first before the wait, the others through a loop that Triton pipelines,
STAGES - 1 slices in flight, or with STAGES 1 each next one while the product of the one before runs) and adds
their products up in slice order; when the programs of a column tile are several, each writes its float32 partial
sums and the last program of the tile to finish (a counter per tile, reset by that program) adds them in order, so
the result does not depend on which finishes first. ``swiglu``: ``w`` is a gate/up projection (gate rows first) and
``y`` is ``silu(gate) * up``, rounded as the eager pieces round. The sums run in another order than cuBLAS's:
results differ from ``F.linear`` by float32 rounding before the final rounding to the model dtype.

A decode layer's RMSNorms need no kernels of their own here: the product before a norm adds the residual to its
output and writes each row's sum of squares over its column tile (``residual``, ``sums``); the product after it
adds those few sums up and normalizes its slice of the rows as it reads them (``norm``). The sums of squares are
added per tile, then across tiles, not in the norm kernel's order: a row's normed input may differ by one rounding
step between a step that runs the norm this way (at most ``NORM_MAX_ROWS`` rows) and one that runs the kernel.
"""

from __future__ import annotations

import functools

import torch

from slime_lite.triton_build import counters, pdl_args, pdl_available, triton_kernels

# An H200 sweep (bench/sweep_gemv.py, the 0.5B shape): with PDL these kernels beat cuBLAS at 1-16 rows for every
# product. At 32 rows the wide ones (gate/up: 8.7M weights, down: 4.4M) lost while a program's K slices came
# through registers (its next slice's weights read during the current product); with the K loop pipelined through
# shared memory (``config``'s STAGES) they win there too on an H100 (not yet measured on an H200): every product by
# gemv at up to MAX_ROWS rows.
MAX_ROWS = 32
# the wide products (weights of WIDE elements or more) by gemv at up to WIDE_MAX_ROWS rows (benchmarks lower it to
# compare: past it, cuBLAS's)
WIDE, WIDE_MAX_ROWS = 1 << 22, MAX_ROWS
# the decode layer's residual adds and norms inside its products' kernels (``linear``'s ``residual``, ``sums`` and
# ``norm``) at up to this many rows; 0: the norms and adds stay kernels of their own. 0: on an H200 (0.5B shape) the
# captured step took 0.830 / 0.877 ms at batch 1 / 8 with them inside (16) and 0.722 / 0.769 with kernels of their
# own, in the same run (benchmarks compare: profile_decode.py --norm-rows)
NORM_MAX_ROWS = 0
# the down product at up to this many rows reading gate/up's output and doing the SiLU as it reads it (``linear``'s
# ``silu_in``, after cuBLAS's gate/up); 0: off. On an H200 at 32 rows it made the 0.5B step 0.61 ms slower
# (profile_decode.py --silu-in-rows)
SILU_IN_MAX_ROWS = 0
# its tiles (BN, BK, warps, KSTEPS): ptxas for sm_90 gives 101 registers a thread; plain down's 32 x 256 x 4 spills with
# the SiLU's float32 tiles
SILU_IN_CONFIG = (32, 128, 8, 8)
MAX_TILES = 4096  # column tiles of a product split over K (one counter each: triton_build.counters)
# the output projection (its columns: the vocabulary) by gemv at up to HEAD_MAX_ROWS rows in bf16 and fp16 (0:
# cuBLAS's), with HEAD_CONFIG's tiles: all of K a program (no counters, so any number of column tiles). Launched with
# PDL, it reads its first weights while the final norm runs. On an H100 (0.5B shape, profile_decode.py
# --head-configs, same process, three runs) the step took 0.748-0.754 / 0.730-0.738 ms at batch 8 / 1 against
# 0.756-0.764 / 0.739-0.741 with cuBLAS's; at batch 32 0.813 against 0.808 (other tiles 0.805-0.810): no gain
# there, so past 16 rows cuBLAS keeps it
HEAD_MAX_ROWS = 16
HEAD_CONFIG = (64, 128, 4, 1 << 30, 1, 4)
# With PDL (Hopper), a product's programs may ask a later product's weights into L2 (``linear``'s ``ahead``: bulk
# prefetches, before the wait), so that they stream in while latency-bound kernels run (fused_layer.AHEAD says
# which products do). Only weights of at most AHEAD_L2_SHARE of the device's L2 are asked: larger ones would be
# evicted before their product reads them (measured only at the 0.5B shape, whose largest, gate/up's 17 MB, is a
# third of an H100's 50 MB L2). Each program asking its own weights first lost on an H100: 0.886 / 0.828 / 0.807 ms
# at batch 32 / 8 / 1 against 0.863 / 0.811 / 0.785 without (0.5B step, same process)
AHEAD_L2_SHARE = 0.5


def _ahead_args(x: torch.Tensor, ahead: torch.Tensor | None, fallback: torch.Tensor) -> dict:
    """A kernel's ``ahead_ptr, ahead_bytes, AHEAD, ELEM`` arguments for asking ``ahead`` into L2 (``ask_l2``) as
    it starts: with PDL, a contiguous 16-byte aligned tensor of at most ``AHEAD_L2_SHARE`` of the device's L2, else
    nothing asked (``fallback``: a pointer of the kernel's own to pass instead)."""
    elem = fallback.element_size()
    ok = (ahead is not None and pdl_available(x) and ahead.is_contiguous() and ahead.data_ptr() % 16 == 0
          and ahead.element_size() == elem and ahead.numel() * elem % 16 == 0
          and ahead.numel() * elem <= AHEAD_L2_SHARE * _l2_bytes(x.device.index or 0))
    return {"ahead_ptr": ahead if ok else fallback, "ahead_bytes": ahead.numel() * elem if ok else 0, "AHEAD": ok,
            "ELEM": elem}


@triton_kernels
def _kernel(triton, tl):
    @triton.jit
    def x_tile(x_ptr, rm, rk, row_ok, k_ok, K, ln, inv, SILU_IN: tl.constexpr, NORM: tl.constexpr):
        """Rows ``rm`` by columns ``rk`` of the product's input: x's, or silu(gate) * up of gate/up's output
        (``SILU_IN``, rounded as silu_mul rounds), or x normed (``NORM``, as the norm kernel rounds)."""
        xm = row_ok[:, None] & k_ok[None, :]
        if SILU_IN:  # x's rows are gate then up ([M, 2K])
            g = tl.load(x_ptr + rm[:, None] * (2 * K) + rk[None, :], mask=xm, other=0.0)
            up = tl.load(x_ptr + rm[:, None] * (2 * K) + K + rk[None, :], mask=xm, other=0.0)
            gf = g.to(tl.float32)
            x = ((gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32) * up.to(tl.float32)).to(g.dtype)
        else:
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=xm, other=0.0)
        if NORM:
            dt_x = x_ptr.dtype.element_ty
            x = (ln[None, :] * (x.to(tl.float32) * inv[:, None]).to(dt_x).to(tl.float32)).to(dt_x)
        return x

    @triton.jit
    def mac(acc, acc_u, w, wu, x, SWIGLU: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr):
        """The sums plus one K slice's tile products (gate's and up's with ``SWIGLU``); ``SWAP``: as ``w @ x.T``."""
        if SWAP and IEEE:
            acc += tl.dot(w, tl.trans(x), input_precision="ieee")
            if SWIGLU:
                acc_u += tl.dot(wu, tl.trans(x), input_precision="ieee")
        elif SWAP:
            acc += tl.dot(w, tl.trans(x))
            if SWIGLU:
                acc_u += tl.dot(wu, tl.trans(x))
        elif IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            if SWIGLU:
                acc_u += tl.dot(x, tl.trans(wu), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
            if SWIGLU:
                acc_u += tl.dot(x, tl.trans(wu))
        return acc, acc_u

    @triton.jit
    def ask_l2(ptr, nbytes, program, programs, ELEM: tl.constexpr):
        """Program ``program`` of ``programs`` asks its even share (16-byte units) of the ``nbytes`` at ``ptr``
        (elements of ELEM bytes) into L2, from its first thread, without waiting: sm_90's bulk prefetch."""
        share = tl.cdiv(nbytes // 16, programs) * 16
        at = program.to(tl.int64) * share
        if at < nbytes:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [ptr + at // ELEM, tl.minimum(share, nbytes - at).to(tl.int32)], dtype=tl.int32,
                is_pure=False, pack=1)

    # Triton resolves the names a kernel calls in its module's globals, not in this builder's scope
    globals().update(x_tile=x_tile, mac=mac, ask_l2=ask_l2)

    @triton.jit
    def gemv(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, ln_ptr, sq_in_ptr, res_ptr, sq_out_ptr, M, K, OUT_N,
             n_sq, eps, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, KSTEPS: tl.constexpr, NSPLIT: tl.constexpr, IEEE: tl.constexpr, NORM: tl.constexpr,
             TP: tl.constexpr, HAS_RES: tl.constexpr, SUMS: tl.constexpr, SILU_IN: tl.constexpr,
             SWAP: tl.constexpr, STAGES: tl.constexpr, GDC: tl.constexpr, ahead_ptr, ahead_bytes,
             AHEAD: tl.constexpr, ELEM: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        if AHEAD:  # the program's share of a later product's weights to L2, not waited for
            ask_l2(ahead_ptr, ahead_bytes, pid_n * NSPLIT + pid_k, tl.num_programs(0) * NSPLIT, ELEM)
        rn = pid_n * BN + tl.arange(0, BN)
        col_ok = rn < OUT_N
        rk = pid_k * KSTEPS * BK + tl.arange(0, BK)  # the program's first K slice
        k_ok = rk < K
        wm = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=wm, other=0.0)  # before the wait: not an input
        wu = w
        if SWIGLU:
            wu = tl.load(w_ptr + (rn[:, None] + OUT_N) * K + rk[None, :], mask=wm, other=0.0)
        ln = tl.zeros((BK,), tl.float32)
        if NORM:
            ln = tl.load(ln_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rm = tl.arange(0, BM)
        row_ok = rm < M
        inv = tl.zeros((BM,), tl.float32)
        if NORM:  # x's rows normed first, from their sums of squares over the kernel before's column tiles
            ts = tl.arange(0, TP)
            sq = tl.load(sq_in_ptr + ts[:, None] * BM + rm[None, :], mask=(ts < n_sq)[:, None], other=0.0)
            inv = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        if SWAP:  # the weight tile is the product's first operand: w @ x.T, [BN, BM], transposed after the loop
            acc = tl.zeros((BN, BM), tl.float32)
            acc_u = tl.zeros((BN, BM), tl.float32)
        else:
            acc = tl.zeros((BM, BN), tl.float32)
            acc_u = tl.zeros((BM, BN), tl.float32)
        # the program's K slices, each product added to the sums in slice order
        if STAGES > 1:  # the first slice's product (its weights came before the wait), then the others in a loop
            # that Triton pipelines: STAGES - 1 slices of weights and rows in flight through shared memory
            acc, acc_u = mac(acc, acc_u, w, wu, x_tile(x_ptr, rm, rk, row_ok, k_ok, K, ln, inv, SILU_IN, NORM),
                             SWIGLU, SWAP, IEEE)
            for j in tl.range(1, KSTEPS, num_stages=STAGES):
                rk_j = rk + j * BK
                k_j = rk_j < K
                wm = col_ok[:, None] & k_j[None, :]
                w_j = tl.load(w_ptr + rn[:, None] * K + rk_j[None, :], mask=wm, other=0.0)
                wu_j = w_j
                if SWIGLU:
                    wu_j = tl.load(w_ptr + (rn[:, None] + OUT_N) * K + rk_j[None, :], mask=wm, other=0.0)
                ln_j = ln
                if NORM:
                    ln_j = tl.load(ln_ptr + rk_j, mask=k_j, other=0.0).to(tl.float32)
                acc, acc_u = mac(acc, acc_u, w_j, wu_j, x_tile(x_ptr, rm, rk_j, row_ok, k_j, K, ln_j, inv, SILU_IN,
                                                               NORM), SWIGLU, SWAP, IEEE)
        else:  # each next slice's weights read while the current product runs (a loop, not unrolled: two slices'
            # weights in registers, not KSTEPS)
            for j in tl.range(0, KSTEPS, num_stages=1):
                x = x_tile(x_ptr, rm, rk, row_ok, k_ok, K, ln, inv, SILU_IN, NORM)
                rk_next = rk + BK
                k_next = (rk_next < K) & (j + 1 < KSTEPS)  # past the program's last slice: nothing read
                wm = col_ok[:, None] & k_next[None, :]
                w_next = tl.load(w_ptr + rn[:, None] * K + rk_next[None, :], mask=wm, other=0.0)
                wu_next = w_next
                if SWIGLU:
                    wu_next = tl.load(w_ptr + (rn[:, None] + OUT_N) * K + rk_next[None, :], mask=wm, other=0.0)
                if NORM:
                    ln_next = tl.load(ln_ptr + rk_next, mask=k_next, other=0.0).to(tl.float32)
                acc, acc_u = mac(acc, acc_u, w, wu, x, SWIGLU, SWAP, IEEE)
                if NORM:
                    ln = ln_next
                w, wu, rk, k_ok = w_next, wu_next, rk_next, k_next
        if SWAP:
            acc = tl.trans(acc)
            acc_u = tl.trans(acc_u)
        out_ok = row_ok[:, None] & col_ok[None, :]
        last = True
        if NSPLIT > 1:  # partials to the scratch; the tile's last program adds them in slice order
            at = (pid_k * BM + rm[:, None]) * OUT_N + rn[None, :]
            tl.store(part_ptr + at, acc, mask=out_ok)
            if SWIGLU:
                tl.store(part_ptr + NSPLIT * BM * OUT_N + at, acc_u, mask=out_ok)
            tl.debug_barrier()  # every thread's partials stored before the counter moves
            last = tl.atomic_add(cnt_ptr + pid_n, 1) == NSPLIT - 1  # acq_rel: the others' partials are visible
            if last:
                acc = tl.zeros((BM, BN), tl.float32)
                acc_u = tl.zeros((BM, BN), tl.float32)
                for s in tl.static_range(NSPLIT):
                    at = (s * BM + rm[:, None]) * OUT_N + rn[None, :]
                    acc += tl.load(part_ptr + at, mask=out_ok, other=0.0, cache_modifier=".cg")
                    if SWIGLU:
                        acc_u += tl.load(part_ptr + NSPLIT * BM * OUT_N + at, mask=out_ok, other=0.0,
                                         cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next kernel (or graph replay)
        if last:
            dt = y_ptr.dtype.element_ty
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                if SWIGLU:
                    acc_u += tl.load(b_ptr + OUT_N + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:  # as the eager pieces round: the products, the activation, its product with up
                g = acc.to(dt).to(tl.float32)
                act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
                out = (act * acc_u.to(dt).to(tl.float32)).to(dt)
            else:
                out = acc.to(dt)
            if HAS_RES:  # the residual add after the product, rounded as the eager add rounds
                out = (tl.load(res_ptr + rm[:, None] * OUT_N + rn[None, :], mask=out_ok, other=0.0)
                       .to(tl.float32) + out.to(tl.float32)).to(dt)
            tl.store(y_ptr + rm[:, None] * OUT_N + rn[None, :], out, mask=out_ok)
            if SUMS:  # each row's sum of squares over this column tile, for the norm in the next product
                of = tl.where(out_ok, out.to(tl.float32), 0.0)
                tl.store(sq_out_ptr + pid_n * BM + rm, tl.sum(of * of, axis=1))

    return gemv


def usable(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, silu_in: bool = False) -> bool:
    """``linear`` serves ``x @ w.T + b`` in a decode step: at most ``MAX_ROWS`` rows (``WIDE_MAX_ROWS`` for weights
    of ``WIDE`` elements or more, ``SILU_IN_MAX_ROWS`` with ``silu_in``), contiguous tensors, ``w`` of at most
    ``MAX_TILES`` column tiles of the narrowest configuration (16), on a device with PDL (and Triton)."""
    rows = x.numel() // x.shape[-1]
    limit = min(SILU_IN_MAX_ROWS, MAX_ROWS) if silu_in else WIDE_MAX_ROWS if w.numel() >= WIDE else MAX_ROWS
    return rows <= limit and w.shape[0] <= MAX_TILES * 16 and _serves(x, w, b)


def head_usable(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> bool:
    """``linear`` with ``head_config``'s tiles serves the output projection ``x @ w.T + b`` of a decode step: at
    most ``HEAD_MAX_ROWS`` rows in bf16 or fp16 (float32 keeps cuBLAS's sums), contiguous, ``w`` of under 2**31
    elements (the kernel's offsets are 32-bit), on a device with PDL."""
    return (x.numel() // x.shape[-1] <= min(HEAD_MAX_ROWS, MAX_ROWS) and x.dtype != torch.float32
            and w.numel() < 1 << 31 and _serves(x, w, b))


def head_config(k: int) -> tuple[int, ...]:
    return _fit(HEAD_CONFIG, k)


def _serves(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    return (x.is_contiguous() and w.is_contiguous() and (b is None or b.is_contiguous()) and pdl_available(x)
            and _kernel() is not None)


def kind(k: int, swiglu: bool) -> str:
    """Which of a layer's products ``linear`` runs, for its tile configuration: "gate_up", "down" (a long ``k``) or
    "narrow" (q/k/v, o)."""
    return "gate_up" if swiglu else "down" if k >= 2048 else "narrow"


def config(rows: int, out_n: int, k: int, swiglu: bool) -> tuple[int, int, int, int, int, int]:
    """(BN, BK, warps, KSTEPS, SWAP, STAGES): tiles of BN output columns by BK of ``k``, run by ``warps`` warps, each
    program adding up KSTEPS consecutive BK slices of ``k`` (fewer float32 partial sums to write, read and add);
    SWAP 1: each tile product as ``w @ x.T`` (the warps split the weight's rows); STAGES past 1: the slices after the
    first in a loop Triton pipelines through shared memory (``linear`` lowers it to what the device's shared memory
    holds).

    The best per product of an H100 sweep at 32 rows (bench/sweep_gemv.py over stages; 16/32/64 x 64/128 x 2/4 warps,
    3-7 stages): q/k/v and o 16 x 128, 4 warps, all of k a program, 4 stages; gate/up 64 x 64, 4 warps, all of k,
    swapped, 6 stages; down 16 x 128, 2 warps, 10 slices a program, 5 stages. In the 0.5B step (profile_decode.py,
    same process, H100) they took 0.871 ms at 32 rows against 0.967 with cuBLAS's gate/up and down, and 0.845 /
    0.834 / 0.803 ms at 16 / 8 / 1 rows against 0.903 / 0.862 / 0.820 with the earlier tiles (one slice a program,
    the best of an H200 sweep of 18 without pipelining)."""
    return _fit({"gate_up": (64, 64, 4, 1 << 30, 1, 6), "down": (16, 128, 2, 10, 0, 5),
                 "narrow": (16, 128, 4, 1 << 30, 0, 4)}[kind(k, swiglu)], k)


# float32 (IEEE sums: tests, float32 models): the tiles before the pipelining, one slice a program, its partial sums
# added in order. With a program's one multiply-add chain over all of K (``config``'s tiles), test_fused_layer's
# float32 MLP check failed on an H100; emulated on the CPU (that chain in float32 against the CPU's float32 product)
# the chain's error off a float64 layer was 1.25x the CPU product's in norm and 2.3x at most, one slice a program's
# 0.55x and 0.45x
FLOAT32_TILES = {"gate_up": (32, 256, 4, 1), "down": (64, 256, 4, 1), "narrow": (32, 128, 4, 1)}


def _fit(cfg: tuple[int, ...], k: int) -> tuple[int, ...]:
    """A configuration's BK at most ``k`` (a power of two, 16 or more) and its KSTEPS at most ``k``'s slices."""
    bn, bk, warps, ksteps, *extra = cfg
    bk = min(bk, max(16, 1 << (k - 1).bit_length()))
    return (bn, bk, warps, min(ksteps, -(-k // bk)), *extra)


@functools.lru_cache(maxsize=8)
def _l2_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).L2_cache_size


def _shared_memory(device: torch.device) -> int:
    """Bytes of shared memory a program may use on ``device`` (99 KiB where torch does not say)."""
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, swiglu: bool = False,
           cfg: tuple[int, ...] | None = None, norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
           residual: torch.Tensor | None = None, sums: bool = False, silu_in: bool = False,
           ahead: torch.Tensor | None = None, out: torch.Tensor | None = None):
    """``x @ w.T + b`` for ``x [..., K]`` of at most ``MAX_ROWS`` rows, ``w [N, K]``, both contiguous, in ``x``'s
    dtype; ``swiglu``: ``silu(gate) * up`` of its ``N / 2`` gate and up columns. ``norm=(weight, eps, sq)``: of
    ``weight * rmsnorm(x)`` instead, as ``fused_layer.rms_norm`` computes it, where ``sq`` holds the sums of squares
    of ``x``'s rows, from the call that wrote ``x`` with ``sums``. ``residual`` (the output's shape, not with
    ``swiglu``): ``residual + x @ w.T + b``, each rounded as eager PyTorch rounds. ``sums``: also the sums of squares
    of the output's rows, one per column tile (float32 ``[tiles, 16 or 32]``), returned as ``(y, sq)``.
    ``silu_in``: ``x [..., 2K]`` holds a gate/up projection's output (gate first) and the product is of
    ``silu(gate) * up``, rounded as ``silu_and_mul`` rounds, computed as the kernel reads it. ``cfg``: a tuple as
    ``config``'s (benchmarks), whose last two elements (SWAP, STAGES) may be left out (0 and 1). ``ahead``: the
    (contiguous) weights of a later product, which this kernel's programs ask into L2 before their wait (with PDL;
    results do not change). ``out``: a contiguous tensor of the output's shape and dtype to write it into."""
    k = x.shape[-1] // 2 if silu_in else x.shape[-1]
    rows = x.numel() // x.shape[-1]
    n = w.shape[0]
    out_n = n // 2 if swiglu else n
    if cfg is None:
        cfg = (_fit(SILU_IN_CONFIG, k) if silu_in else _fit(FLOAT32_TILES[kind(k, swiglu)], k)
               if x.dtype == torch.float32 else config(rows, out_n, k, swiglu))
    bn, bk, warps, ksteps, *extra = cfg
    swap = bool(extra[0]) if extra else False
    stages = extra[1] if len(extra) > 1 else 1
    bm = 16 if rows <= 16 else 32
    if stages > 1:  # Triton's pipeline keeps STAGES + 1 slices of weights and rows in shared memory
        per_stage = (bn * (2 if swiglu else 1) + bm * (2 if silu_in else 1)) * bk * x.element_size()
        stages = max(1, min(stages, (_shared_memory(x.device) - 8192) // per_stage - 1))  # 8 KiB: the rest
    grid = (-(-out_n // bn), -(-k // (bk * ksteps)))
    if (rows > MAX_ROWS or not (x.is_contiguous() and w.is_contiguous()) or w.shape[1] != k or (swiglu and n % 2)
            or (grid[0] > MAX_TILES and grid[1] > 1)
            or (silu_in and (swiglu or norm is not None or x.shape[-1] != 2 * k))):
        raise ValueError(f"gemv.linear: x {tuple(x.shape)} (at most {MAX_ROWS} rows, contiguous; [..., 2K] with "
                         f"silu_in, not with swiglu or norm) and w {tuple(w.shape)} (contiguous, [N, K], N at most "
                         f"{MAX_TILES} tiles of {bn} when K is split; N even with swiglu) do not fit")
    shape = (*x.shape[:-1], out_n)
    if ((norm is not None and (norm[0].shape != (k,) or not norm[0].is_contiguous() or norm[2].dim() != 2
                               or norm[2].shape[1] != bm or not norm[2].is_contiguous()
                               or norm[2].dtype != torch.float32))
            or (residual is not None and (swiglu or residual.shape != shape or not residual.is_contiguous()))):
        raise ValueError(f"gemv.linear: norm must be (a contiguous [{k}] weight, eps, float32 [tiles, {bm}] sums of "
                         f"squares), residual (not with swiglu) contiguous of the output's shape {shape}")
    if out is not None and (out.shape != shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"gemv.linear: out {tuple(out.shape)} {out.dtype} must be contiguous, {shape} {x.dtype}")
    y = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    sq = torch.empty(grid[0] if sums else 0, bm, dtype=torch.float32, device=x.device)
    part = torch.empty(grid[1] * bm * out_n * (2 if swiglu else 1) if grid[1] > 1 else 0, dtype=torch.float32,
                       device=x.device)
    n_sq = norm[2].shape[0] if norm is not None else 1
    with torch.cuda.device(x.device if x.is_cuda else -1):  # -1: the Triton interpreter (tests)
        _kernel()[grid](x, w, b if b is not None else w, y, part, counters(x), norm[0] if norm else x,
                        norm[2] if norm else part, residual if residual is not None else y, sq, rows, k, out_n,
                        n_sq, float(norm[1]) if norm else 0.0, HAS_BIAS=b is not None, SWIGLU=swiglu, BM=bm, BN=bn,
                        BK=bk, KSTEPS=ksteps, NSPLIT=grid[1], IEEE=x.dtype == torch.float32, NORM=norm is not None,
                        TP=max(2, 1 << (n_sq - 1).bit_length()), HAS_RES=residual is not None, SUMS=sums,
                        SILU_IN=silu_in, SWAP=swap, STAGES=stages, num_warps=warps,
                        **_ahead_args(x, ahead, w), **pdl_args(x))
    return (y, sq) if sums else y
