"""engine/fused_layer.py: the fused norm, rotary and gated-MLP kernels of captured decode steps, against the eager
layer pieces (engine/model.py ``layer_functions``). On the CPU in Triton's interpreter (tests/triton_interpreter.py:
float32 and float16); on a GPU (skipped without CUDA) compiled, in bf16 too, and inside the engine's graphs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

HEADS, KV_HEADS, EPS = 4, 2, 1e-6  # 2 KV heads: a KV-head index that is off shows


def _pieces(head_dim: int, inter: int):
    from slime_lite.engine import fused_layer
    from slime_lite.engine.model import layer_functions

    eager = layer_functions(EPS, HEADS, KV_HEADS, head_dim, inter, F.silu)
    return eager, fused_layer.layer_functions(eager, EPS, HEADS, KV_HEADS, head_dim, silu=True)


def _inputs(rows: int, head_dim: int, inter: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = HEADS * head_dim
    width = (HEADS + 2 * KV_HEADS) * head_dim

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    angle = torch.rand(rows, head_dim, generator=g) * 6.3
    half = head_dim // 2
    sin = torch.sin(angle)
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # rotate_half's sign folded in, as CausalLM does
    qkv_args = (r(rows, 1, hidden, scale=3.0), r(hidden, scale=0.5) + 1, r(width, hidden, scale=0.1), r(width),
                torch.cos(angle).to(dtype).to(device)[:, None, None, :], sin.to(dtype).to(device)[:, None, None, :])
    mlp_args = (qkv_args[0], r(rows, 1, hidden), r(hidden, hidden, scale=0.1), None, r(hidden, scale=0.5) + 1,
                r(2 * inter, hidden, scale=0.1), None, r(hidden, inter, scale=0.1), None)
    return qkv_args, mlp_args


def _check(dtype: torch.dtype, head_dim: int, inter: int, device: str, tol: float) -> None:
    """The fused pieces against the eager ones: the rotary and the residual add bit for bit on the same input (no
    sum in them); the norm and what follows it within ``tol`` (the norm's float32 sum runs in another order)."""
    from slime_lite.engine import fused_layer
    from slime_lite.engine.model import _rms, layer_functions

    eager, fused = _pieces(head_dim, inter)
    (h, ln, qkv_w, qkv_b, cos, sin), mlp_args = _inputs(5, head_dim, inter, dtype, device)
    q, kv = fused[0](h, ln, qkv_w, qkv_b, cos, sin)
    q_want, kv_want = eager[0](h, ln, qkv_w, qkv_b, cos, sin)
    assert q.shape == q_want.shape and kv.shape == kv_want.shape
    torch.testing.assert_close(q, q_want, rtol=tol, atol=tol)
    torch.testing.assert_close(kv, kv_want, rtol=tol, atol=tol)
    # The rotary alone on any rows: bit for bit in the interpreter; compiled, within one rounding step of the dtype
    # (on an H200 some bf16/fp16 elements differ from eager by a rounding, the float32 ones by the compiler's fused
    # multiply-add)
    width = (HEADS + 2 * KV_HEADS) * head_dim
    rows = torch.randn(5, width, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    got_q, got_kv = fused_layer.rotary(rows, cos.reshape(5, -1), sin.reshape(5, -1), HEADS, KV_HEADS, head_dim)
    heads = rows.view(5, 1, -1, head_dim)
    qk = heads[:, :, : HEADS + KV_HEADS]
    roped = qk * cos + qk.roll(head_dim // 2, dims=-1) * sin
    want_kv = torch.cat((roped[:, 0, HEADS:], heads[:, 0, HEADS + KV_HEADS:]), dim=1)
    one_step = torch.finfo(dtype).eps  # relative size of one rounding step
    for got, want in ((got_q, roped[:, 0, :HEADS]), (got_kv, want_kv)):
        if device == "cpu":
            assert torch.equal(got, want)
        else:
            differ = (got != want).float().mean().item()
            print(f"rotary {dtype}: {differ:.4%} of elements differ from eager")
            # a rounding of a product at the inputs' largest magnitude (the sum can be far smaller than its terms)
            torch.testing.assert_close(got, want, rtol=one_step, atol=one_step * rows.abs().max().item())
    out = fused[1](*mlp_args)
    torch.testing.assert_close(out, eager[1](*mlp_args), rtol=tol, atol=tol)
    x, res = mlp_args[0], mlp_args[1]
    summed, normed = fused_layer.rms_norm(x, mlp_args[4], EPS, residual=res)
    assert torch.equal(summed, x + res)
    torch.testing.assert_close(normed, mlp_args[4] * F.rms_norm(summed.float(), (x.shape[-1],), None, EPS).to(dtype),
                               rtol=tol, atol=tol)
    gu = torch.randn(5, 1, 2 * inter, generator=torch.Generator().manual_seed(2)).to(dtype).to(device) * 4
    torch.testing.assert_close(fused_layer.silu_and_mul(gu), F.silu(gu[..., :inter]) * gu[..., inter:], rtol=tol,
                               atol=tol)
    small = x * 1e-3  # where eps matters
    torch.testing.assert_close(fused_layer.rms_norm(small, mlp_args[4], 1e-2), _rms(small, mlp_args[4], 1e-2),
                               rtol=tol, atol=tol)
    gelu = layer_functions(EPS, HEADS, KV_HEADS, head_dim, inter, F.gelu)  # another activation: the eager MLP
    assert torch.equal(fused_layer.layer_functions(gelu, EPS, HEADS, KV_HEADS, head_dim, silu=False)[1](*mlp_args),
                       gelu[1](*mlp_args))


def _kernels_on_cpu() -> None:
    """Run by ``test_the_kernels_in_the_triton_interpreter`` with TRITON_INTERPRET=1 (CPU tensors count as usable)."""
    from slime_lite.engine import fused_layer

    fused_layer.usable = lambda x: True
    _check(torch.float32, 32, 1100, "cpu", 1e-5)  # gate/up wider than one block of silu_mul
    _check(torch.float16, 24, 40, "cpu", 2e-3)  # a head size that is not a power of two


def test_the_kernels_in_the_triton_interpreter():
    from tests.triton_interpreter import run_interpreted

    run_interpreted("tests.engine.test_fused_layer:_kernels_on_cpu")


def test_the_eager_pieces_run_where_the_kernels_cannot():
    """On CPU (and with ENABLED off) the fused functions are the eager ones, bit for bit."""
    from slime_lite.engine import fused_layer

    eager, fused = _pieces(32, 80)
    qkv_args, mlp_args = _inputs(4, 32, 80, torch.float32)
    assert not fused_layer.usable(qkv_args[0])
    for a, b in zip(fused[0](*qkv_args), eager[0](*qkv_args)):
        assert torch.equal(a, b)
    assert torch.equal(fused[1](*mlp_args), eager[1](*mlp_args))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,head_dim,tol", [(torch.bfloat16, 64, 2e-2), (torch.float16, 128, 2e-3),
                                                (torch.float32, 80, 1e-5)])
def test_the_kernels_compiled_on_a_gpu(dtype, head_dim, tol):
    from slime_lite.engine import fused_layer

    assert fused_layer.usable(torch.zeros(1, device="cuda", dtype=dtype))
    _check(dtype, head_dim, 4864 // 4, "cuda", tol)
