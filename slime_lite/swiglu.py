"""``silu(gate) * up`` of a fused gate/up projection as one Triton kernel (CUDA): the engine's captured decode steps
and the trainer's SwiGLU forward both use it. The activation is rounded to the input's dtype before the product, and
the product after it, as eager PyTorch's ``F.silu(gate) * up`` rounds (computed in float32)."""

from __future__ import annotations

import torch

from slime_lite.triton_build import triton_kernels

BLOCK = 1024


@triton_kernels
def kernel(triton, tl):
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

    return silu_mul


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gu = [..., 2 * inter]`` (gate first), contiguous."""
    if not gu.is_contiguous():
        raise ValueError("silu_and_mul: gu must be contiguous")
    inter = gu.shape[-1] // 2
    rows = gu.numel() // gu.shape[-1]
    out = torch.empty(*gu.shape[:-1], inter, dtype=gu.dtype, device=gu.device)
    with torch.cuda.device(gu.device if gu.is_cuda else -1):  # -1: the Triton interpreter (tests)
        kernel()[(rows, -(-inter // BLOCK))](gu, out, inter, BLOCK=BLOCK, num_warps=4)
    return out
