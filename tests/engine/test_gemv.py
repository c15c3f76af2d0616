"""engine/gemv.py: the decode step's products at a few rows (split-K Triton kernels launched with programmatic
dependent launch on Hopper), against ``F.linear`` and the eager SwiGLU. On the CPU in Triton's interpreter
(tests/triton_interpreter.py: float32 and float16, no PDL there); on a GPU (skipped without CUDA) compiled, in bf16
too, and chained with PDL inside a CUDA graph, where a missing wait would show as a race."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from tests.engine.engine_helpers import captured


def _want(x, w, b, swiglu):
    y = F.linear(x.float(), w.float(), None if b is None else b.float())
    if not swiglu:
        return y.to(x.dtype)
    g, u = y.to(x.dtype).chunk(2, dim=-1)
    return (F.silu(g.float()).to(x.dtype).float() * u.float()).to(x.dtype)


def _check(dtype: torch.dtype, device: str, tol: float) -> None:
    from slime_lite import triton_build
    from slime_lite.engine import gemv

    gen = torch.Generator().manual_seed(0)
    for rows, k, n, bias, swiglu in [(1, 96, 40, True, False),  # one K slice, a partial column tile
                                     (5, 300, 130, False, False),  # three K slices, a partial last slice
                                     (20, 600, 2 * 70, True, True),  # 32-row tiles, SwiGLU, biases on both halves
                                     (32, 128, 2 * 64, False, True),
                                     (3, 2100, 40, False, False)]:  # down's tiles: split-K in float16 too
        x = torch.randn(rows, 1, k, generator=gen).to(dtype).to(device)
        w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype).to(device)
        b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
        got = gemv.linear(x, w, b, swiglu=swiglu)
        assert got.shape == (rows, 1, n // 2 if swiglu else n) and got.dtype == dtype
        torch.testing.assert_close(got, _want(x, w, b, swiglu), rtol=tol, atol=tol)
        again = gemv.linear(x, w, b, swiglu=swiglu)  # the tile counters were reset: the same sums again
        assert torch.equal(got, again)
        bn, bk, warps = gemv.config(rows, n, k, swiglu)[:3]
        for ksteps, swap, stages in ((2, 0, 1), (3, 0, 1), (1, 1, 1), (3, 1, 1), (3, 0, 3), (4, 1, 2)):
            # a program adding up several K slices (fewer or no partial sums), a partial last one (gemv.config's
            # tiles); swap: the tile products as w @ x.T; stages: the slices after the first in a pipelined loop
            torch.testing.assert_close(gemv.linear(x, w, b, swiglu=swiglu, cfg=(bn, bk, warps, ksteps, swap, stages)),
                                       _want(x, w, b, swiglu), rtol=tol, atol=tol)
    for rows, k0, k, n, swiglu in [(3, 300, 300, 40, False), (16, 64, 200, 2 * 48, True),
                                   (24, 96, 600, 2 * 40, True)]:  # 32-row tiles
        # a product with the residual add and its rows' sums of squares (split-K in the first), then one with the
        # RMSNorm from those sums
        x0, w0 = torch.randn(rows, k0, generator=gen).to(dtype).to(device), torch.randn(k, k0, generator=gen) * 0.3
        res = torch.randn(rows, k, generator=gen).to(dtype).to(device)
        y, sq = gemv.linear(x0, w0.to(dtype).to(device), residual=res, sums=True)
        tiles32 = torch.stack([t.sum(-1) for t in y.float().pow(2).split(32, dim=-1)])  # one sum per 32 columns
        if k0 > 64:  # two programs of two K slices each, the last one's second slice empty (300 of 4 x 128)
            y2, sq2 = gemv.linear(x0, w0.to(dtype).to(device), residual=res, sums=True, cfg=(32, 128, 4, 2))
            torch.testing.assert_close(y2, y, rtol=tol, atol=tol)
            torch.testing.assert_close(sq2[:, :rows], tiles32, rtol=tol, atol=tol)
        want_y = (res.float() + _want(x0, w0.to(dtype).to(device), None, False).float()).to(dtype)
        torch.testing.assert_close(y, want_y, rtol=tol, atol=tol)
        default = (gemv.FLOAT32_TILES[gemv.kind(k0, False)] if dtype == torch.float32
                   else gemv.config(rows, k, k0, False))
        tiles = y.float().pow(2).split(default[0], dim=-1)  # the default tiles' columns
        torch.testing.assert_close(sq[:, :rows], torch.stack([t.sum(-1) for t in tiles]), rtol=tol, atol=tol)
        assert (sq[:, rows:] == 0).all()  # the tile's rows past the input's
        ln = (1 + torch.randn(k, generator=gen) * 0.2).to(dtype).to(device)
        w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype).to(device)
        got = gemv.linear(y, w, swiglu=swiglu, norm=(ln, 1e-6, sq))  # the norm inside the kernel
        normed = (ln.float() * (y.float() * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6))
                  .to(dtype).float()).to(dtype)
        torch.testing.assert_close(got, _want(normed, w, None, swiglu), rtol=tol, atol=tol)
        cfg = (*gemv.config(rows, n, k, swiglu)[:3], 4)  # the norm's weight read slice by slice
        for swap, stages in ((0, 1), (1, 1), (0, 3)):
            got = gemv.linear(y, w, swiglu=swiglu, norm=(ln, 1e-6, sq), cfg=(*cfg, swap, stages))
            torch.testing.assert_close(got, _want(normed, w, None, swiglu), rtol=tol, atol=tol)
        y3, sq3 = gemv.linear(x0, w0.to(dtype).to(device), residual=res, sums=True, cfg=(32, 64, 4, 1, 1))
        torch.testing.assert_close(y3, y, rtol=tol, atol=tol)  # swapped, with the residual and the sums
        torch.testing.assert_close(sq3[:, :rows], tiles32, rtol=tol, atol=tol)
    for rows, k, n, bias in [(5, 300, 40, True), (20, 600, 70, False)]:  # silu_in: the SiLU of gate/up's output
        gu = (torch.randn(rows, 1, 2 * k, generator=gen) * 2).to(dtype).to(device)  # as the product reads it
        w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype).to(device)
        b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
        g, u = gu.float().chunk(2, dim=-1)
        act = (F.silu(g).to(dtype).float() * u).to(dtype)  # silu_and_mul's rounding
        for cfg in (None, (*gemv.config(rows, n, k, False)[:3], 3), (*gemv.config(rows, n, k, False)[:3], 3, 1),
                    (*gemv.config(rows, n, k, False)[:3], 3, 0, 2)):
            # one K slice a program, then three, then three with the tile products swapped, then pipelined
            got = gemv.linear(gu, w, b, silu_in=True, cfg=cfg)
            assert got.shape == (rows, 1, n)
            torch.testing.assert_close(got, _want(act, w, b, False), rtol=tol, atol=tol)
        res = torch.randn(rows, 1, n, generator=gen).to(dtype).to(device)
        got, sq = gemv.linear(gu, w, b, silu_in=True, residual=res, sums=True)  # o's and down's adds, with it
        want = (res.float() + _want(act, w, b, False).float()).to(dtype)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        torch.testing.assert_close(sq[:, :rows].sum(0), got.float().pow(2).sum(-1).flatten(), rtol=tol, atol=tol)
        with pytest.raises(ValueError, match="silu_in, not with swiglu"):
            gemv.linear(gu, torch.zeros(2 * n, k, dtype=dtype, device=device), swiglu=True, silu_in=True)
        with pytest.raises(ValueError, match="silu_in, not with swiglu or norm"):
            gemv.linear(gu, w, norm=(torch.ones(k, dtype=dtype, device=device), 1e-6, sq), silu_in=True)
        with pytest.raises(ValueError, match="silu_in"):  # gate and up of k columns each, not k + 1
            gemv.linear(gu[..., 1:].contiguous(), w, silu_in=True)
    # the output projection's way: all of K a program, so more column tiles than counters, written into ``out``
    xh, wh = torch.randn(3, 1, 96, generator=gen).to(dtype).to(device), torch.randn(100, 96, generator=gen).to(dtype)
    wh, out = wh.to(device), torch.full((3, 1, 100), float("nan"), dtype=dtype, device=device)
    saved, gemv.MAX_TILES = gemv.MAX_TILES, 2
    try:
        assert gemv.linear(xh, wh, cfg=gemv._fit((16, 64, 4, 1 << 30, 1, 2), 96), out=out) is out
        torch.testing.assert_close(out, _want(xh, wh, None, False), rtol=tol, atol=tol)
        with pytest.raises(ValueError, match="tiles of 16 when K is split"):  # 7 tiles, 2 counters
            gemv.linear(xh, wh, cfg=(16, 32, 4, 1))
    finally:
        gemv.MAX_TILES = saved
    for bad in (torch.empty(3, 1, 200, dtype=dtype, device=device)[:, :, ::2],  # the right shape, strided
                torch.empty(3, 1, 100, dtype=torch.float64, device=device), out[:, :, :50]):  # dtype; shape
        with pytest.raises(ValueError, match="out .* must be contiguous"):
            gemv.linear(xh, wh, out=bad)
    assert not any(c.any() for c in triton_build._COUNTERS.values())
    # a program adds up several slices, pipelined (the 0.5B shape's gate/up, down, q/k/v and o): all of k but for down
    for rows in (1, 16, 32):
        assert [gemv.config(rows, *shape)[3:] for shape in ((4864, 896, True), (896, 4864, False), (896, 896, False))
                ] == [(14, 1, 6), (10, 0, 5), (7, 0, 4)]
    with pytest.raises(ValueError, match="residual .not with swiglu"):
        gemv.linear(y, w, swiglu=True, residual=y)
    with pytest.raises(ValueError, match="at most 32 rows"):
        gemv.linear(torch.zeros(33, 8, dtype=dtype, device=device), torch.zeros(4, 8, dtype=dtype, device=device))


def _on_cpu() -> None:
    """Run by ``test_the_products_in_the_triton_interpreter`` with TRITON_INTERPRET=1."""
    _check(torch.float32, "cpu", 1e-5)
    _check(torch.float16, "cpu", 2e-3)


def test_the_products_in_the_triton_interpreter():
    from tests.triton_interpreter import run_interpreted

    run_interpreted("tests.engine.test_gemv:_on_cpu")


def test_the_products_serve_pdl_devices_only(monkeypatch):
    from slime_lite import triton_build
    from slime_lite.engine import gemv

    w = torch.zeros(4, 8)
    assert not gemv.usable(torch.zeros(3, 8), w)  # CPU: no programmatic dependent launch, cuBLAS keeps the products
    assert triton_build.pdl_args(torch.zeros(3)) == {"GDC": False}
    hopper = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # a tensor on a PDL device
    monkeypatch.setattr(triton_build, "_pdl_device", lambda index: True)
    assert triton_build.pdl_args(hopper) == {"GDC": True, "launch_pdl": True}
    monkeypatch.setattr(triton_build, "PDL", False)  # switched off: plain launches, cuBLAS's products
    assert triton_build.pdl_args(hopper) == {"GDC": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs Hopper")
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_the_products_compiled_and_chained_with_pdl_in_a_graph(dtype, tol, monkeypatch):
    from slime_lite import triton_build
    from slime_lite.engine import fused_layer, gemv

    w = torch.zeros(4, 8, device="cuda", dtype=dtype)
    assert gemv.usable(torch.zeros(32, 8, device="cuda", dtype=dtype), w)
    assert not gemv.usable(torch.zeros(33, 8, device="cuda", dtype=dtype), w)
    wide = torch.zeros(gemv.WIDE // 64, 64, device="cuda", dtype=dtype)  # the wide products by gemv at 32 rows too
    assert gemv.usable(torch.zeros(32, 64, device="cuda", dtype=dtype), wide)
    with monkeypatch.context() as m:
        m.setattr(gemv, "WIDE_MAX_ROWS", 16)  # benchmarks: cuBLAS's past 16 rows
        assert not gemv.usable(torch.zeros(17, 64, device="cuda", dtype=dtype), wide)
    assert not gemv.usable(torch.zeros(17, 128, device="cuda", dtype=dtype), wide, silu_in=True)  # off by default
    with monkeypatch.context() as m:
        m.setattr(gemv, "SILU_IN_MAX_ROWS", 64)  # past 16 rows; never past MAX_ROWS
        assert gemv.usable(torch.zeros(32, 128, device="cuda", dtype=dtype), wide, silu_in=True)
        assert not gemv.usable(torch.zeros(33, 128, device="cuda", dtype=dtype), wide, silu_in=True)
    head = torch.zeros(151936, 64, device="cuda", dtype=dtype)  # the output projection: bf16/fp16 only
    assert gemv.head_usable(torch.zeros(16, 64, device="cuda", dtype=dtype), head) == (dtype != torch.float32)
    assert not gemv.head_usable(torch.zeros(gemv.HEAD_MAX_ROWS + 1, 64, device="cuda", dtype=dtype), head)
    _check(dtype, "cuda", tol)
    gen = torch.Generator(device="cuda").manual_seed(0)
    hid, inter = 896, 4864
    layers = [((torch.randn(2 * inter, hid, generator=gen, device="cuda") * 0.03).to(dtype),
               (torch.randn(hid, inter, generator=gen, device="cuda") * 0.03).to(dtype),
               (1 + torch.randn(hid, generator=gen, device="cuda") * 0.1).to(dtype)) for _ in range(12)]
    for rows in (8, 32):  # 32-row tiles at 32; bf16: several K slices a program, pipelined (gemv.config); float32:
        # one slice a program (gemv.FLOAT32_TILES)
        x0 = torch.empty(rows, hid, device="cuda", dtype=dtype)  # the graph's input, new before every replay
        inputs = [torch.randn(rows, hid, generator=gen, device="cuda").to(dtype) for _ in range(20)]

        def chain():  # 12 x (norm, gate/up with SiLU, down): each kernel reads what the one before wrote
            h = x0
            for gu, down, ln in layers[:6]:
                h = gemv.linear(gemv.linear(fused_layer.rms_norm(h, ln, 1e-6), gu, swiglu=True), down)
            sq = None
            for gu, down, ln in layers[6:]:  # the residual add in down's kernel, the norm in gate/up's, as the engine
                x = fused_layer.rms_norm(h, ln, 1e-6) if sq is None else h
                act = gemv.linear(x, gu, swiglu=True, norm=None if sq is None else (ln, 1e-6, sq))
                h, sq = gemv.linear(act, down, residual=h, sums=True)
            return h

        outs = {}
        for pdl in (True, False):
            monkeypatch.setattr(triton_build, "PDL", pdl)
            assert gemv.usable(x0[:8], layers[0][0]) == pdl
            graph, out = captured(chain)
            replays = []
            for x in inputs:  # a kernel that read its predecessor's output before its wait would see the last replay's
                x0.copy_(x)
                graph.replay()
                replays.append(out.clone())
            outs[pdl] = replays
        monkeypatch.setattr(triton_build, "PDL", True)
        # the same kernels launched with PDL and without: the same bits, every replay
        assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False])), rows
        assert outs[True][0].abs().sum() > 0 and not torch.equal(outs[True][0], outs[True][1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs Hopper")
def test_the_l2_prefetches_change_no_bit():
    from slime_lite.engine import gemv

    gen = torch.Generator(device="cuda").manual_seed(2)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") * 0.05).to(torch.bfloat16)

    later = rand(2 * 4864, 896)  # a later product's weights, asked into L2 by the kernel's programs (``ahead``)
    cases = [(8, 1000, 896, False), (32, 2 * 4864, 896, True),  # a partial column tile; gate/up with its SiLU
             (8, 896, 4864, False), (1, 40, 100, False)]  # K split over programs; one row, a K of 100
    for rows, n, k, swiglu in cases:
        x, w = rand(rows, k), rand(n, k)
        outs = []
        for ahead in (None, later):
            outs.append(gemv.linear(x, w, swiglu=swiglu, ahead=ahead))
        assert torch.equal(outs[0], outs[1]), (rows, n, k)
        torch.testing.assert_close(outs[1], _want(x, w, None, swiglu), atol=2e-2, rtol=2e-2)
