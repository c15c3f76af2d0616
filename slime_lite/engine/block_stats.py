"""The sampler on CUDA in two Triton kernels: per-block max, argmax and sum of exponentials, then the draw.

``sampling.sample_rows`` needs, per row of logits, the max ``m``, the argmax and float64 sums of
``exp((logit - m) / T)`` over blocks of ``BLOCK`` tokens. In eager PyTorch that takes about seven passes over a
float32 ``[B, vocab]`` matrix (at batch 256 and Qwen2's 151,936 tokens, 60 us each on an H200).
``block_stats_kernel`` reads the logits once, in their own dtype: each program takes one block of one row and writes
the block's max, the index of its first max, and the sum of ``exp((logit - block max) / T)``. Both kernels are used
on CUDA when Triton is importable; elsewhere (CPU) ``sample_rows`` runs its eager passes.

``draw_kernel`` then does the rest of ``sampling.sample_rows`` for one row per program: the row's max and argmax
from its blocks, the float64 block sums, the inverse-CDF search (block first, then the token inside the block from
the block's own float32 exponentials) and the token's log-prob. In eager PyTorch those steps were ~70 small kernels
per decode step (cumsum, searchsorted, gathers, flips), ~0.1 ms of an H200 step at any batch size. Its sums run in
another order than torch's cumsum, so a draw whose uniform falls within float64 rounding of a boundary between two
tokens may pick the other one; the argmax and every other draw are the same.

Both are launched plainly: with programmatic dependent launch (each waiting for the kernel before it) the 0.5B
captured step on an H100 took 0.824-0.830 ms at batch 32 against 0.806-0.812, and the same at batch 8. Also tried
there and dropped, each within 0.005 ms of the default at batch 1, 8 and 32 (same process): 4 or 8 blocks a stats
program, 8 warps, and the draw done by each row's last stats program to finish (no draw kernel).
"""

from __future__ import annotations

import torch

from slime_lite.triton_build import triton_kernels


@triton_kernels
def _kernel(triton, tl):
    @triton.jit
    def block_stats_kernel(logits, temps, out_max, out_sum, out_arg, vocab, row_stride, blocks,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        start = row.to(tl.int64) * row_stride  # 64-bit: B x V can pass 2**31 (large prefills, large vocabularies)
        x = tl.load(logits + start + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        top = tl.max(x, axis=0)
        first = tl.min(tl.where(x == top, offs, vocab), axis=0)  # first index of the max, as torch.argmax
        shift = tl.where(top == float("-inf"), 0.0, top)  # a block of -inf logits sums to 0, not NaN
        # 1 / temperature in float32, rounded as torch's division is (Triton's own is the fast reciprocal)
        inv_t = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.load(temps + row).to(tl.float32))
        total = tl.sum(tl.exp((x - shift) * inv_t), axis=0)
        tl.store(out_max + row * blocks + blk, top)
        tl.store(out_sum + row * blocks + blk, total)
        tl.store(out_arg + row * blocks + blk, first)

    @triton.jit
    def draw_kernel(logits, row_stride, vocab, bmax_ptr, bsum_ptr, barg_ptr, blocks, temps, u_ptr, greedy_ptr,
                    tok_ptr, lp_ptr, NB: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        j = tl.arange(0, NB)
        live = j < blocks
        bmax = tl.load(bmax_ptr + row * blocks + j, mask=live, other=float("-inf"))
        m = tl.max(bmax, axis=0)
        at = tl.min(tl.where(bmax == m, j, NB), axis=0)  # the first block holding the max: the first argmax
        top = tl.load(barg_ptr + row * blocks + at)
        inv_t = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.load(temps + row).to(tl.float32))  # as above
        scale = tl.exp(((bmax - m) * inv_t).to(tl.float64))
        sums = tl.where(live, tl.load(bsum_ptr + row * blocks + j, mask=live, other=0.0).to(tl.float64) * scale, 0.0)
        csum = tl.cumsum(sums, axis=0)
        total = tl.max(csum, axis=0)  # sums are >= 0: the last prefix sum
        target = tl.load(u_ptr + row) * total
        # the block: as torch.searchsorted(right=True), kept off blocks of zero weight past the last positive one
        last = tl.max(tl.where(live & (sums > 0), j, -1), axis=0)
        last = tl.where(last < 0, blocks - 1, last)
        blk = tl.minimum(tl.sum((live & (csum <= target)).to(tl.int32), axis=0), last)
        base = tl.sum(tl.where(j == blk - 1, csum, 0.0), axis=0)  # mass before the block
        bsum = tl.sum(tl.where(j == blk, sums, 0.0), axis=0)
        start = row.to(tl.int64) * row_stride
        k = tl.arange(0, BLOCK)
        idx = blk * BLOCK + k
        x = tl.load(logits + start + tl.minimum(idx, vocab - 1)).to(tl.float32)
        w = tl.where(idx < vocab, tl.exp((x - m) * inv_t).to(tl.float64), 0.0)
        inside = tl.cumsum(w, axis=0)
        frac = tl.minimum(tl.maximum((target - base) / bsum, 0.0), 1.0)
        lastw = tl.max(tl.where(w > 0, k, -1), axis=0)
        lastw = tl.where(lastw < 0, BLOCK - 1, lastw)
        pos = tl.minimum(tl.sum((inside <= frac * tl.max(inside, axis=0)).to(tl.int32), axis=0), lastw)
        token = tl.minimum(blk * BLOCK + pos, vocab - 1).to(tl.int64)
        greedy = tl.load(greedy_ptr + row) != 0
        token = tl.where(greedy, top, token)
        # the token's logit from what is loaded (no third dependent load): the max for the argmax, else its place
        # in the block's tile
        picked = (tl.where(greedy, m, tl.sum(tl.where(k == pos, x, 0.0), axis=0)) - m) * inv_t
        tl.store(tok_ptr + row, token.to(tok_ptr.dtype.element_ty))
        lp = (picked.to(tl.float64) - tl.log(tl.sum(sums, axis=0))).to(tl.float32)
        tl.store(lp_ptr + row, lp.to(lp_ptr.dtype.element_ty))

    return block_stats_kernel, draw_kernel


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _kernel() is not None


def triton_sample(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor, greedy: torch.Tensor, block: int,
                  out: torch.Tensor | None = None):
    """``sampling.sample_rows`` in two kernels: ``(tokens [B] int64, log-probs [B] float32)`` for ``logits [B, V]``
    (any float dtype), ``temps`` (1 for greedy rows; any float dtype), float64 uniforms ``u`` and ``greedy`` (rows
    whose value is not 0 take the argmax; any dtype). ``out [2, >= B]``: the tokens and log-probs are written into
    its two rows instead (converted to its dtype), and ``out``'s first ``B`` columns are returned."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    blocks = -(-v // block)
    dev = logits.device
    bmax = torch.empty(b, blocks, dtype=torch.float32, device=dev)
    bsum = torch.empty_like(bmax)
    barg = torch.empty(b, blocks, dtype=torch.int64, device=dev)
    if out is None:
        tokens = torch.empty(b, dtype=torch.int64, device=dev)
        logprobs = torch.empty(b, dtype=torch.float32, device=dev)
    else:
        tokens, logprobs = out[0, :b], out[1, :b]
    stats, draw = _kernel()
    temps = temps.contiguous()
    with torch.cuda.device(dev if logits.is_cuda else -1):  # -1: the Triton interpreter (tests)
        stats[(b, blocks)](logits, temps, bmax, bsum, barg, v, logits.stride(0), blocks, BLOCK=block, num_warps=4)
        draw[(b,)](logits, logits.stride(0), v, bmax, bsum, barg, blocks, temps, u.double().contiguous(),
                   greedy.contiguous(), tokens, logprobs, NB=max(16, 1 << (blocks - 1).bit_length()), BLOCK=block,
                   num_warps=4)
    return tokens, logprobs
