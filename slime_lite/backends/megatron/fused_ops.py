"""The trainer's SwiGLU and RoPE on CUDA as Triton kernels, forward and backward, rounded as eager PyTorch rounds.

Megatron's local layer spec computes them with unfused torch ops: the gated MLP's ``silu(gate) * (up + 0.0)`` on
the two strided halves of the fc1 output (an H200 profile of the 0.5B shape's log-prob pass: 18% of the device
time, in kernels that read strided bf16 at a fraction of the bandwidth), and RoPE as ``t * cos + rotate_half(t) *
sin`` with a ``cat`` and a ``neg`` and cos/sin recomputed for every q and k of every layer. Each is one kernel here,
forward and backward:

- ``swiglu(x)``: ``x = [.., 2I]`` (gate first) -> ``silu(gate) * up``, the activation rounded to the model dtype
  before the product, as the eager ops (the forward kernel is ``slime_lite.swiglu``'s, shared with the engine); the
  backward computes what autograd through them computes
  (``dup = g * act``, ``dgate = silu'(gate) * (g * up)``, each rounded where autograd rounds);
- ``rope(t, cos, sin, interleaved)``: ``t [T, H, D]`` (any token and head strides) with ``cos``/``sin`` ``[T, R]``
  in ``t``'s dtype (R <= D rotary dims; the rest of each head passes through), the same roundings as Megatron's
  ``_apply_rotary_pos_emb_bshd`` (``t * cos`` and ``rotate_half(t) * sin`` rounded, then their sum); its backward is
  the transposed rotation.

- a linear layer with a bias (Qwen2's q/k/v projection) as one ``F.linear``, whose cuBLAS call adds the bias in
  its epilogue, instead of Megatron's matrix product then a separate add over the [tokens, outputs] result (the
  bias is added before the one rounding to the model dtype, not after); only for a plain local linear (no tensor
  parallel communication, no gradient-accumulation fusion), where Megatron's autograd function computes what
  ``F.linear``'s does.

The element-wise float32 math follows torch's kernels (``silu``, ``silu_backward``); Triton's ``exp`` may differ from
CUDA's in the last float32 bit, which rounding to bf16 almost always hides. Used on CUDA when Triton is installed
(``available``); ``ENABLED = False`` gives back Megatron's ops (benchmarks and a GPU test compare the two).
"""

from __future__ import annotations

import torch

from slime_lite.swiglu import BLOCK, silu_and_mul
from slime_lite.triton_build import triton_kernels

ENABLED = True


@triton_kernels
def _kernels(triton, tl):
    @triton.jit
    def swiglu_bwd(x_ptr, dy_ptr, dx_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < inter
        g = tl.load(x_ptr + row * 2 * inter + cols, mask=live, other=0.0)
        u = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=live, other=0.0)
        dy = tl.load(dy_ptr + row * inter + cols, mask=live, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gf))
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        d_up = (dy * act.to(tl.float32)).to(g.dtype)
        d_act = (dy * u.to(tl.float32)).to(g.dtype).to(tl.float32)
        d_gate = (d_act * sig * (1.0 + gf * (1.0 - sig))).to(g.dtype)
        tl.store(dx_ptr + row * 2 * inter + cols, d_gate, mask=live)
        tl.store(dx_ptr + row * 2 * inter + inter + cols, d_up, mask=live)

    @triton.jit
    def rope(t_ptr, cos_ptr, sin_ptr, out_ptr, s_t, s_h, heads, ROT: tl.constexpr, D: tl.constexpr,
             DP: tl.constexpr, HP: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)  # one token per program, all its heads ([HP, DP] tile)
        hs = tl.arange(0, HP)
        d = tl.arange(0, DP)
        live = (hs[:, None] < heads) & (d[None, :] < D)
        rot_d = d < ROT
        rot = (hs[:, None] < heads) & rot_d[None, :]
        if INTERLEAVED:  # pairs (0, 1), (2, 3), ...: rotate_half gives (-x1, x0)
            partner = d ^ 1
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        else:  # halves: rotate_half gives (-x2, x1)
            half: tl.constexpr = ROT // 2
            partner = tl.where(d < half, d + half, d - half)
            sign = tl.where(d < half, -1.0, 1.0)
        src = t_ptr + tok * s_t + hs[:, None].to(tl.int64) * s_h
        x = tl.load(src + d[None, :], mask=live, other=0.0)
        xp = tl.load(src + partner[None, :], mask=rot, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + tok * ROT + d, mask=rot_d, other=0.0).to(tl.float32)[None, :]
        a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
        if BACKWARD:  # the transpose of rotate_half: (y2, -y1) of y = g * sin, sin taken at the partner's place
            s_p = tl.load(sin_ptr + tok * ROT + partner, mask=rot_d, other=0.0).to(tl.float32)[None, :]
            b = -sign[None, :] * (xp * s_p).to(x.dtype).to(tl.float32)
        else:
            s_here = tl.load(sin_ptr + tok * ROT + d, mask=rot_d, other=0.0).to(tl.float32)[None, :]
            b = (sign[None, :] * xp * s_here).to(x.dtype).to(tl.float32)
        out = tl.where(rot, (a + b).to(x.dtype), x)
        tl.store(out_ptr + (tok * heads + hs[:, None]) * D + d[None, :], out, mask=live)

    return swiglu_bwd, rope


def available(x: torch.Tensor) -> bool:
    return (ENABLED and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and _kernels() is not None)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x)
        return silu_and_mul(x)  # the forward kernel the engine's decode steps use

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        inter = x.shape[-1] // 2
        rows = x.numel() // x.shape[-1]
        dx = torch.empty_like(x)
        with torch.cuda.device(x.device if x.is_cuda else -1):
            _kernels()[0][(rows, -(-inter // BLOCK))](x, dy, dx, inter, BLOCK=BLOCK, num_warps=4)
        return dx


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [..., 2I]`` (gate first), by the kernels."""
    return _SwiGLU.apply(x)


def _rope_call(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool):
    tokens, heads, d = t.shape
    rot = cos.shape[-1]
    if t.stride(-1) != 1 or rot > d or rot % 2 or cos.shape != (tokens, rot) or sin.shape != cos.shape:
        raise ValueError(f"fused_ops.rope: t {tuple(t.shape)} (last dim contiguous) and cos/sin {tuple(cos.shape)} "
                         "([T, R], R even, R <= D) do not fit")
    out = torch.empty(tokens, heads, d, dtype=t.dtype, device=t.device)
    with torch.cuda.device(t.device if t.is_cuda else -1):
        _kernels()[1][(tokens,)](t, cos.contiguous(), sin.contiguous(), out, t.stride(0), t.stride(1), heads,
                                 ROT=rot, D=d, DP=max(16, 1 << (d - 1).bit_length()),
                                 HP=max(2, 1 << (heads - 1).bit_length()), INTERLEAVED=interleaved, BACKWARD=backward,
                                 num_warps=4)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rope_call(t, cos, sin, interleaved, backward=False)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        g = g if g.stride(-1) == 1 else g.contiguous()
        return _rope_call(g, cos, sin, ctx.interleaved, backward=True), None, None, None


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Megatron's ``_apply_rotary_pos_emb_bshd`` for ``t [T, H, D]`` with ``cos``/``sin`` ``[T, R]`` (already
    ``cos(freqs) * mscale`` in ``t``'s dtype), by the kernel; a new contiguous tensor."""
    return _Rope.apply(t, cos, sin, interleaved)


def _swiglu_impl(x: torch.Tensor, bias: torch.Tensor | None, *unused) -> torch.Tensor:
    """Megatron's ``bias_swiglu_impl`` (its MLP calls it with ``bias_activation_fusion``): the kernels where
    ``available``, else the eager ops of Megatron's unfused path."""
    if bias is not None:
        x = x + bias
    if available(x):
        return swiglu(x)
    gate, up = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def install_swiglu() -> None:
    """Route the dense MLP's fused SwiGLU (``bias_activation_fusion=True``) through ``_swiglu_impl``, and a
    ColumnParallelLinear with a bias through ``F.linear`` where ``available`` (both idempotent)."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import mlp

    mlp.bias_swiglu_impl = _swiglu_impl
    original = layers.ColumnParallelLinear._forward_impl
    if getattr(original, "slime_lite", False):
        return

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, grad_output_buffer=None, **rest):
        if (bias is not None and available(input) and weight.requires_grad and not gradient_accumulation_fusion
                and not allreduce_dgrad and not sequence_parallel and grad_output_buffer is None):
            return torch.nn.functional.linear(input, weight, bias)
        return original(self, input, weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                        allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                        grad_output_buffer=grad_output_buffer, **rest)

    _forward_impl.slime_lite = True
    layers.ColumnParallelLinear._forward_impl = _forward_impl
