"""The sampler's one pass over the vocabulary on CUDA: per-block max, argmax and sum of exponentials in a Triton kernel.

``sample_rows`` needs, per row of logits, the max ``m``, the argmax and float64 sums of ``exp((logit - m) / T)``
over blocks of ``BLOCK`` tokens. In eager PyTorch that takes about seven passes over a float32 ``[B, vocab]``
matrix (at batch 256 and Qwen2's 151,936 tokens, 60 us each on an H200). The kernel here reads the logits once,
in their own dtype: each program takes one block of one row and writes the block's max, the index of its first
max, and the sum of ``exp((logit - block max) / T)``; the rows' numbers follow from those ``[B, blocks]`` tensors.
It is used on CUDA when Triton is importable; elsewhere (CPU) the eager ``plain_stats`` of ``sampling`` runs.
"""

from __future__ import annotations

import torch

from slime_lite.triton_build import triton_kernels


@triton_kernels
def _kernel(triton, tl):
    @triton.jit
    def block_stats_kernel(logits, inv_t, out_max, out_sum, out_arg, vocab, row_stride, blocks,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        start = row.to(tl.int64) * row_stride  # 64-bit: B x V can pass 2**31 (large prefills, large vocabularies)
        x = tl.load(logits + start + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        top = tl.max(x, axis=0)
        first = tl.min(tl.where(x == top, offs, vocab), axis=0)  # first index of the max, as torch.argmax
        shift = tl.where(top == float("-inf"), 0.0, top)  # a block of -inf logits sums to 0, not NaN
        total = tl.sum(tl.exp((x - shift) * tl.load(inv_t + row)), axis=0)
        tl.store(out_max + row * blocks + blk, top)
        tl.store(out_sum + row * blocks + blk, total)
        tl.store(out_arg + row * blocks + blk, first)

    return block_stats_kernel


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _kernel() is not None


def triton_stats(logits: torch.Tensor, inv_t: torch.Tensor, block: int):
    """``plain_stats`` from one read of ``logits [B, V]`` (any float dtype, rows contiguous): ``m [B, 1]`` float32,
    float64 block sums ``[B, ceil(V / block)]`` of ``exp((logits - m) * inv_t)``, argmax ``[B]``."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    blocks = -(-v // block)
    bmax = torch.empty(b, blocks, dtype=torch.float32, device=logits.device)
    bsum = torch.empty_like(bmax)
    barg = torch.empty(b, blocks, dtype=torch.int64, device=logits.device)
    _kernel()[(b, blocks)](logits, inv_t.reshape(b).float().contiguous(), bmax, bsum, barg, v, logits.stride(0),
                           blocks, BLOCK=block, num_warps=4)
    m, at = bmax.max(-1, keepdim=True)  # the first block holding the row's max
    sums = bsum.double() * ((bmax - m) * inv_t.reshape(b, 1)).double().exp()
    return m, sums, barg.gather(1, at)[:, 0]
