"""Probe: does programmatic dependent launch (PDL, Hopper) shorten a captured decode layer's chain of small kernels?

    python3 bench/probe_pdl.py [--rows 1,8,32] [--layers 24]

A decode step at batch 1-32 is ~11 dependent kernels per layer of 1.5-7 us each, most of it latency (launch, ramp,
the first loads), not bytes. With PDL a kernel may start while its predecessor runs: it loads what does not depend
on the predecessor (its weights) and then waits for it (``griddepcontrol.wait``). cuBLAS's products are not launched
that way, so the probe times one layer shape (0.5B: hidden 896, q/k/v 1,152, MLP 4,864) chained ``--layers`` times
in a CUDA graph, four ways:

- ``cublas``: Triton norm / rotary-like / attention-like / SiLU kernels and cuBLAS products (the engine's layout);
- ``cublas_pdl``: the same, the small Triton kernels launched with PDL (they may start as a product drains);
- ``triton``: the products by a Triton split-K GEMV (weights loaded first, SiLU fused into gate/up), no PDL;
- ``triton_pdl``: the same launched with PDL, the weights loaded before the wait.

Also a chain of 240 tiny kernels with and without PDL (the per-kernel cost of a dependent launch). The PDL chains'
outputs are checked bitwise against the same kernels without PDL (a missing wait would show as a race).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HID, QKV, INTER = 896, 1152, 4864


@triton.jit
def norm_k(x_ptr, res_ptr, w_ptr, h_ptr, y_ptr, n, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=live, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * n + cols, mask=live, other=0.0).to(tl.float32))
        x = x.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * n + cols, x, mask=live)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + 1e-6)).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (w * normed.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=live)


@triton.jit
def elem_k(x_ptr, y_ptr, n_in, n_out, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """A stand-in for rotary / attention: y[row, :n_out] = x[row, :n_out] * 0.5 + x[row, n_out - 1 - i] * 0.25."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < n_out
    a = tl.load(x_ptr + row * n_in + cols, mask=live, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * n_in + n_out - 1 - cols, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_out + cols, (a * 0.5 + b * 0.25).to(y_ptr.dtype.element_ty), mask=live)


@triton.jit
def silu_k(gu_ptr, y_ptr, inter, BLOCK: tl.constexpr, GDC: tl.constexpr):
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=live, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=live, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * inter + cols, (act * u).to(y_ptr.dtype.element_ty), mask=live)


@triton.jit
def gemv_k(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, K, OUT_N,
           HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
           NSPLIT: tl.constexpr, GDC: tl.constexpr):
    """y[:M, tile] = x @ w.T (+ b) over this program's BK columns of K; NSPLIT programs per tile, the last to
    finish adds their float32 partials in split order. SWIGLU: w's rows are gate then up; y = silu(g) * u."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    col_ok = rn < OUT_N
    rk = pid_k * BK + tl.arange(0, BK)
    k_ok = rk < K
    wm = col_ok[:, None] & k_ok[None, :]
    w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=wm, other=0.0)  # first: not the previous kernel's
    if SWIGLU:
        wu = tl.load(w_ptr + (rn[:, None] + OUT_N) * K + rk[None, :], mask=wm, other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rm = tl.arange(0, BM)
    row_ok = rm < M
    x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w))
    acc_u = acc
    if SWIGLU:
        acc_u = tl.dot(x, tl.trans(wu))
    out_ok = row_ok[:, None] & col_ok[None, :]
    last = True
    if NSPLIT > 1:
        at = (pid_k * BM + rm[:, None]) * OUT_N + rn[None, :]
        tl.store(part_ptr + at, acc, mask=out_ok)
        if SWIGLU:
            tl.store(part_ptr + NSPLIT * BM * OUT_N + at, acc_u, mask=out_ok)
        tl.debug_barrier()
        last = tl.atomic_add(cnt_ptr + pid_n, 1) == NSPLIT - 1
        if last:
            acc = tl.zeros((BM, BN), tl.float32)
            acc_u = tl.zeros((BM, BN), tl.float32)
            for s in tl.static_range(NSPLIT):
                at = (s * BM + rm[:, None]) * OUT_N + rn[None, :]
                acc += tl.load(part_ptr + at, mask=out_ok, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    acc_u += tl.load(part_ptr + NSPLIT * BM * OUT_N + at, mask=out_ok, other=0.0,
                                     cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
    if last:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            g = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
            out = (act * acc_u.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty)
        else:
            out = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * OUT_N + rn[None, :], out, mask=out_ok)


class Gemv:
    """One product's buffers and launch config (preallocated: graph capture)."""

    def __init__(self, w, b, rows, swiglu, bn, kb, warps, dev):
        self.w, self.b, self.swiglu, self.bn, self.kb, self.warps = w, b, swiglu, bn, kb, warps
        self.k = w.shape[1]
        self.out_n = w.shape[0] // 2 if swiglu else w.shape[0]
        self.bm = 16 if rows <= 16 else 32
        self.bk = 128 * kb
        self.nsplit = -(-self.k // self.bk)
        self.grid = (-(-self.out_n // bn), self.nsplit)
        self.part = torch.empty(self.nsplit * self.bm * self.out_n * 2, dtype=torch.float32, device=dev)
        self.cnt = torch.zeros(self.grid[0], dtype=torch.int32, device=dev)
        self.y = torch.empty(rows, self.out_n, dtype=w.dtype, device=dev)

    def __call__(self, x, gdc):
        gemv_k[self.grid](x, self.w, self.b if self.b is not None else self.w, self.y, self.part, self.cnt, x.shape[0],
                          self.k, self.out_n, HAS_BIAS=self.b is not None, SWIGLU=self.swiglu, BM=self.bm, BN=self.bn,
                          BK=self.bk, NSPLIT=self.nsplit, GDC=gdc, num_warps=self.warps, **({"launch_pdl": True} if gdc else {}))
        return self.y


def layer_fn(mode, layers, rows, dev, cfg):
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s, scale=0.02):
        return (torch.randn(*s, generator=g, device=dev, dtype=torch.float32) * scale).to(dt)

    L = []
    for _ in range(layers):
        p = dict(ln1=1 + rnd(HID), qkv_w=rnd(QKV, HID), qkv_b=rnd(QKV), o_w=rnd(HID, HID), ln2=1 + rnd(HID),
                 gu_w=rnd(2 * INTER, HID), down_w=rnd(HID, INTER))
        if mode.startswith("triton"):
            p["qkv"] = Gemv(p["qkv_w"], p["qkv_b"], rows, False, *cfg["qkv"], dev)
            p["o"] = Gemv(p["o_w"], None, rows, False, *cfg["o"], dev)
            p["gu"] = Gemv(p["gu_w"], None, rows, True, *cfg["gu"], dev)
            p["down"] = Gemv(p["down_w"], None, rows, False, *cfg["down"], dev)
        L.append(p)
    h0 = rnd(rows, HID, scale=1.0)
    bufs = dict(h=torch.empty(rows, HID, dtype=dt, device=dev), x=torch.empty(rows, HID, dtype=dt, device=dev),
                q=torch.empty(rows, HID, dtype=dt, device=dev), a=torch.empty(rows, HID, dtype=dt, device=dev),
                h2=torch.empty(rows, HID, dtype=dt, device=dev), x2=torch.empty(rows, HID, dtype=dt, device=dev),
                act=torch.empty(rows, INTER, dtype=dt, device=dev))
    pdl = mode.endswith("pdl")

    def run():
        h = h0
        m = None
        for p in L:
            if m is None:
                norm_k[(rows,)](h, h, p["ln1"], bufs["h"], bufs["x"], HID, HAS_RES=False, BLOCK=1024, GDC=pdl,
                                num_warps=4, launch_pdl=pdl)
                hh = h
            else:
                norm_k[(rows,)](m, h, p["ln1"], bufs["h"], bufs["x"], HID, HAS_RES=True, BLOCK=1024, GDC=pdl,
                                num_warps=4, launch_pdl=pdl)
                hh = bufs["h"]
            if mode.startswith("triton"):
                qkv = p["qkv"](bufs["x"], pdl)
            else:
                qkv = F.linear(bufs["x"], p["qkv_w"], p["qkv_b"])
            elem_k[(rows,)](qkv, bufs["q"], QKV, HID, BLOCK=1024, GDC=pdl, num_warps=4, launch_pdl=pdl)  # rotary
            elem_k[(rows,)](bufs["q"], bufs["a"], HID, HID, BLOCK=1024, GDC=pdl, num_warps=4, launch_pdl=pdl)  # attn
            o = p["o"](bufs["a"], pdl) if mode.startswith("triton") else F.linear(bufs["a"], p["o_w"])
            norm_k[(rows,)](o, hh, p["ln2"], bufs["h2"], bufs["x2"], HID, HAS_RES=True, BLOCK=1024, GDC=pdl,
                            num_warps=4, launch_pdl=pdl)
            if mode.startswith("triton"):
                act = p["gu"](bufs["x2"], pdl)
                m = p["down"](act, pdl)
            else:
                gu = F.linear(bufs["x2"], p["gu_w"])
                silu_k[(rows, -(-INTER // 1024))](gu, bufs["act"], INTER, BLOCK=1024, GDC=pdl, num_warps=4,
                                                   launch_pdl=pdl)
                m = F.linear(bufs["act"], p["down_w"])
            h = bufs["h2"]
        return m

    return run


def graph_ms(fn, reps=5, n=100):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            out = fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = fn()
    gr.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            gr.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / n)
    return statistics.median(times), out.clone(), gr


def tiny_chain(pdl, n=240):
    x = torch.randn(8, HID, device="cuda", dtype=torch.bfloat16)
    bufs = [torch.empty_like(x) for _ in range(2)]

    def run():
        src = x
        for i in range(n):
            dst = bufs[i % 2]
            elem_k[(8,)](src, dst, HID, HID, BLOCK=1024, GDC=pdl, num_warps=4, launch_pdl=pdl)
            src = dst
        return src

    ms, out, _ = graph_ms(run)
    return ms * 1000 / n, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--configs", default="64x1x4,64x2x4,64x4x8,128x2x8",
                    help="GEMV configs to try per product: BNxKBxWARPS")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    for pdl in (False, True):
        us, out = tiny_chain(pdl)
        print(f"tiny chain of 240 kernels, pdl={pdl}: {us:.2f} us per kernel", flush=True)
    _, o1 = tiny_chain(False)
    _, o2 = tiny_chain(True)
    print("tiny chain pdl bitwise equal:", torch.equal(o1, o2), flush=True)

    cfgs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    for rows in [int(r) for r in args.rows.split(",")]:
        res = {}
        outs = {}
        for mode in ("cublas", "cublas_pdl"):
            ms, out, _ = graph_ms(layer_fn(mode, args.layers, rows, dev, None))
            res[mode] = ms
            outs[mode] = out
        for c in cfgs:
            cfg = {k: c for k in ("qkv", "o", "gu", "down")}
            for mode in ("triton", "triton_pdl"):
                try:
                    ms, out, _ = graph_ms(layer_fn(mode, args.layers, rows, dev, cfg))
                except Exception as e:  # a config that does not compile (registers)
                    print(f"rows {rows} cfg {c} {mode}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                res[f"{mode}{c}"] = ms
                outs[f"{mode}{c}"] = out
            if f"triton{c}" in outs and f"triton_pdl{c}" in outs:
                eq = torch.equal(outs[f"triton{c}"], outs[f"triton_pdl{c}"])
                err = (outs[f"triton{c}"].float() - outs["cublas"].float()).abs().max().item()
                print(f"rows {rows} cfg {c}: pdl bitwise equal to no-pdl: {eq}; max |triton - cublas| {err:.3g}",
                      flush=True)
        print(f"rows {rows}: cublas_pdl vs cublas bitwise: {torch.equal(outs['cublas'], outs['cublas_pdl'])}")
        for k, v in res.items():
            print(f"rows {rows:3d} {k:28s} {v * 1000 / args.layers:7.2f} us per layer  ({v:.3f} ms for "
                  f"{args.layers})", flush=True)


if __name__ == "__main__":
    main()
