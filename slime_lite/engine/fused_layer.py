"""The layer pieces of captured decode steps in fewer kernels (Triton, CUDA): norms, rotary and the gated MLP.

At small batches a decode step is a chain of small kernels, ~25 per layer in eager PyTorch (an H200 profile at
batch 8: 140 copies, 131 multiplies, 75 adds and 49 norms per step, 2-6 us each), and an RL rollout's tail runs
about a thousand such steps with a few rows each. Three kernels replace most of them:

- ``rms``: RMSNorm of a row, with the residual add before it when given (``h + o``, rounded to the model dtype as
  the eager add is, written out as the new residual);
- ``rope``: the rotary embedding of the q and k heads of one row, with the v heads copied beside the k heads (the
  ``[q], [k, v]`` layout the KV cache write takes);
- ``silu_mul``: ``silu(gate) * up`` of the fused gate/up projection.

Each computes in float32 and rounds to the model dtype where eager PyTorch does (after the norm, after each
product, after the add). In Triton's interpreter the rotary and the residual add then give eager's bits; compiled
(H200), about a fifth of the rotary's elements differ from eager's by one rounding step (the compiler may fuse a
product into the sum), and the norm's float32 sum runs in another order. The matrix products stay with cuBLAS.
Used by captured steps on CUDA with Triton for models with a SiLU MLP (``layer_functions``); elsewhere, and with
``ENABLED = False`` (benchmarks compare), the eager pieces run.
``--enable-torch-compile`` replaces both with compiled ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime_lite.triton_build import triton_kernels

ENABLED = True


@triton_kernels
def _kernels(triton, tl):
    @triton.jit
    def rms(x_ptr, res_ptr, w_ptr, h_ptr, y_ptr, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        live = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=live, other=0.0)
        if HAS_RES:  # the residual add, rounded as the eager add rounds, is the layer's new hidden state
            x = (x.to(tl.float32) + tl.load(res_ptr + row * n + cols, mask=live, other=0.0).to(tl.float32))
            x = x.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * n + cols, x, mask=live)
        xf = x.to(tl.float32)
        normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n + cols, (w * normed.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def rope(qkv_ptr, cos_ptr, sin_ptr, q_ptr, kv_ptr, qkv_row, heads, kv_heads, DH: tl.constexpr,
             D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        dims = tl.arange(0, D)  # D: the head size DH padded to a power of two
        live = dims < DH
        src = qkv_ptr + row * qkv_row + head * DH
        x = tl.load(src + dims, mask=live, other=0.0)
        out = x
        half: tl.constexpr = DH // 2
        if head < heads + kv_heads:  # q and k heads: x * cos + roll(x, DH / 2) * sin (sin carries rotate_half's sign)
            partner = tl.load(src + tl.where(dims < half, dims + half, dims - half), mask=live, other=0.0)
            c = tl.load(cos_ptr + row * DH + dims, mask=live, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + row * DH + dims, mask=live, other=0.0).to(tl.float32)
            a = (x.to(tl.float32) * c).to(x.dtype)
            b = (partner.to(tl.float32) * s).to(x.dtype)
            out = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
        if head < heads:
            tl.store(q_ptr + (row * heads + head) * DH + dims, out, mask=live)
        else:
            tl.store(kv_ptr + (row * 2 * kv_heads + head - heads) * DH + dims, out, mask=live)

    @triton.jit
    def silu_mul(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=live, other=0.0)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=live, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(out_ptr + row * inter + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=live)

    return rms, rope, silu_mul


def usable(x: torch.Tensor) -> bool:
    """The kernels serve ``x``'s step: CUDA, Triton, a float dtype, and not switched off."""
    return (ENABLED and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and _kernels() is not None)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``weight * rmsnorm(x)`` over the last dimension; with ``residual``: ``(x + residual, weight *
    rmsnorm(x + residual))``. ``x`` (and ``residual``) contiguous, in the model dtype."""
    if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
        raise ValueError("rms_norm: x and residual must be contiguous")
    n = x.shape[-1]
    rows = x.numel() // n
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else y
    with torch.cuda.device(x.device if x.is_cuda else -1):  # -1: the Triton interpreter (tests)
        _kernels()[0][(rows,)](x, residual if residual is not None else x, weight, h, y, n, float(eps),
                               HAS_RES=residual is not None, BLOCK=_pow2(n), num_warps=4)
    return (h, y) if residual is not None else y


def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """``qkv [R, (heads + 2 kv_heads) * head_dim]`` (rows contiguous), ``cos``/``sin`` ``[R, head_dim]`` (contiguous)
    -> roped q ``[R, heads, head_dim]`` and ``[R, 2 kv_heads, head_dim]``: roped k heads, then the v heads."""
    if head_dim % 2 or qkv.stride(-1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rotary: an even head size, rows of qkv with a contiguous last dimension, contiguous cos/sin")
    rows = qkv.shape[0]
    q = torch.empty(rows, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    kv = torch.empty(rows, 2 * kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    with torch.cuda.device(qkv.device if qkv.is_cuda else -1):  # -1: the Triton interpreter (tests)
        _kernels()[1][(rows, heads + 2 * kv_heads)](qkv, cos, sin, q, kv, qkv.stride(0), heads, kv_heads,
                                                    DH=head_dim, D=_pow2(head_dim), num_warps=1)
    return q, kv


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gu = [..., 2 * inter]`` (gate first), contiguous."""
    if not gu.is_contiguous():
        raise ValueError("silu_and_mul: gu must be contiguous")
    inter = gu.shape[-1] // 2
    rows = gu.numel() // gu.shape[-1]
    out = torch.empty(*gu.shape[:-1], inter, dtype=gu.dtype, device=gu.device)
    block = 1024
    with torch.cuda.device(gu.device if gu.is_cuda else -1):  # -1: the Triton interpreter (tests)
        _kernels()[2][(rows, -(-inter // block))](gu, out, inter, BLOCK=block, num_warps=4)
    return out


def layer_functions(eager: tuple, eps: float, heads: int, kv_heads: int, head_dim: int, silu: bool) -> tuple:
    """``qkv_rope`` and ``mlp_residual`` with the signatures of ``model.layer_functions``' (``eager``), by the
    kernels where ``usable`` (and the MLP's activation is SiLU), else by ``eager``."""
    eager_qkv, eager_mlp = eager

    def qkv_rope(h, ln, qkv_w, qkv_b, cos, sin):
        b, t, _ = h.shape
        if not usable(h) or cos.numel() != b * t * head_dim or not h.is_contiguous():
            return eager_qkv(h, ln, qkv_w, qkv_b, cos, sin)
        qkv = F.linear(rms_norm(h, ln, eps), qkv_w, qkv_b)
        q, kv = rotary(qkv.view(b * t, -1), cos.reshape(b * t, head_dim).contiguous(),
                       sin.reshape(b * t, head_dim).contiguous(), heads, kv_heads, head_dim)
        return q.view(b, t, heads, head_dim), kv.view(b, t, 2 * kv_heads, head_dim)

    def mlp_residual(h, attn_out, o_w, o_b, ln2, gu_w, gu_b, down_w, down_b):
        if not silu or not usable(h) or not h.is_contiguous():
            return eager_mlp(h, attn_out, o_w, o_b, ln2, gu_w, gu_b, down_w, down_b)
        h, normed = rms_norm(h, ln2, eps, residual=F.linear(attn_out, o_w, o_b).contiguous())
        return h + F.linear(silu_and_mul(F.linear(normed, gu_w, gu_b)), down_w, down_b)

    return qkv_rope, mlp_residual
