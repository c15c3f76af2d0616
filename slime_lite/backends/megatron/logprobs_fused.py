"""Log-probs and entropy by two Triton kernels (CUDA): one pass over the logits forward, one backward.

``logprobs.token_log_probs`` uses this on CUDA when Triton is installed; the chunked torch path (``logprobs.py``)
stays the reference and the CPU path. Same maths, same TP contract (this rank holds vocabulary columns
[vocab_start, vocab_start + V_local), columns at or past ``vocab_limit`` are padding):

- forward: each program reads one row of logits once (bf16 or float32, columns in blocks) and keeps, in float32
  with an online max, this slice's max ``m``, ``S = sum exp(z - m)``, ``W = sum exp(z - m) (z - m)`` (z = logits /
  temperature) and the target's z when the target is in the slice. The TP ranks combine these per row (one max and
  one sum all-reduce): with the global max M, ``sum exp(z - M) = S e^(m - M)`` and
  ``sum exp(z - M)(z - M) = e^(m - M) (W + (m - M) S)``;
- backward: each program reads its row once more and writes the gradient of the logits in their dtype:
  ``(-p_j (g_logp + g_ent (s_j - lse + H)) + [j = target] g_logp) / temperature`` (s = z - M, p = e^(s - lse)),
  zero on padding columns.

No [tokens, vocab] temporary in float32: the forward keeps 4 floats per row. Each row is reduced on its own with a
block size fixed by the vocabulary width, so a token's result does not depend on the micro-batch it sits in (no
autotuning: a different block per batch size would change the sums' order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slime_lite.triton_build import triton_kernels

_MAX_BLOCK = 4096  # columns per step of a row: 16 float32 per thread at 8 warps


def all_reduce(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """In place over the TP group (a no-op without one)."""
    if group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return x


def available(logits: torch.Tensor) -> bool:
    """The kernels can run on these logits: CUDA, Triton installed, a floating dtype Triton reads."""
    return (logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and _kernels() is not None)


@triton_kernels
def _kernels(triton, tl):
    """(forward, backward) Triton kernels, or None where Triton is not installed (the CPU build). ``rows`` (the
    micro-batch's tokens) is not specialised on: Triton would compile a variant of each kernel for a count divisible
    by 16 (and for 1), mid-training, whenever a micro-batch first has one."""
    @triton.jit(do_not_specialize=["rows"])
    def row_stats(x_ptr, stride, target_ptr, out_ptr, rows, width, temperature, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        target = tl.load(target_ptr + row)  # this slice's column of the target, or -1
        m = tl.full((), -1.0e30, tl.float32)  # finite: exp(m - new) and (m - new) * S stay 0 at the first block
        s_sum = tl.zeros((), tl.float32)
        w_sum = tl.zeros((), tl.float32)
        picked = tl.zeros((), tl.float32)
        for start in tl.range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < width
            z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) / temperature
            z = tl.where(valid, z, -float("inf"))
            new = tl.maximum(m, tl.max(z, axis=0))
            d = z - new
            e = tl.exp(d)  # 0 on masked columns
            scale = tl.exp(m - new)
            w_sum = scale * (w_sum + (m - new) * s_sum) + tl.sum(tl.where(valid, e * d, 0.0), axis=0)
            s_sum = scale * s_sum + tl.sum(e, axis=0)
            picked += tl.sum(tl.where(cols == target, z, 0.0), axis=0)
            m = new
        tl.store(out_ptr + row, m)
        tl.store(out_ptr + rows + row, s_sum)
        tl.store(out_ptr + 2 * rows + row, w_sum)
        tl.store(out_ptr + 3 * rows + row, picked)

    @triton.jit(do_not_specialize=["rows"])
    def row_grad(x_ptr, stride, g_ptr, target_ptr, stats_ptr, rows, width, columns, temperature,
                 HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        out = g_ptr + row * columns
        target = tl.load(target_ptr + row)
        big_m = tl.load(stats_ptr + row)  # the global max, log-sum-exp minus it, entropy, d loss / d logp, / d H
        lse = tl.load(stats_ptr + rows + row)
        g_lp = tl.load(stats_ptr + 3 * rows + row)
        if HAS_ENT:
            shift = lse - tl.load(stats_ptr + 2 * rows + row)
            g_h = tl.load(stats_ptr + 4 * rows + row)
        for start in tl.range(0, columns, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < width
            s = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) / temperature - big_m
            p = tl.exp(s - lse)
            if HAS_ENT:
                g = -p * ((s - shift) * g_h + g_lp)
            else:
                g = -p * g_lp
            g = tl.where(cols == target, g + g_lp, g) / temperature
            g = tl.where(valid, g, 0.0)
            tl.store(out + cols, g.to(g_ptr.dtype.element_ty), mask=cols < columns)

    return row_stats, row_grad


def _device(x: torch.Tensor):
    """The tensor's CUDA device as the current one while a kernel launches (-1, no switch: a CPU tensor under the Triton
    interpreter, ``TRITON_INTERPRET=1``, which the CPU tests use)."""
    return torch.cuda.device(x.device if x.is_cuda else -1)


def _block(width: int) -> int:
    return max(16, min(_MAX_BLOCK, 1 << max(0, width - 1).bit_length()))


def _forward(logits: torch.Tensor, local: torch.Tensor, temperature: float, width: int, with_entropy: bool, group):
    """Per row: log p(target), entropy (zeros without with_entropy), the global max M and log-sum-exp minus M."""
    rows = logits.shape[0]
    stats = torch.empty(4, rows, dtype=torch.float32, device=logits.device)
    if width == 0:  # a slice of padding only: no max, nothing to add
        stats[0].fill_(-torch.inf)
        stats[1:].zero_()
    elif rows:
        with _device(logits):
            _kernels()[0][(rows,)](logits, logits.stride(0), local, stats, rows, width, float(temperature),
                                   BLOCK=_block(width), num_warps=8)
    m, s_sum, w_sum, picked = stats
    big_m = all_reduce(m.clone(), group, "max")
    if group is not None:  # this slice's sums rescaled to the global max, then summed over the slices
        scale = torch.where(torch.isfinite(m), (m - big_m).exp(), torch.zeros_like(m))
        shift = torch.where(torch.isfinite(m), m - big_m, torch.zeros_like(m))
        sums = torch.stack([s_sum * scale, scale * (w_sum + shift * s_sum), picked])
        s_sum, w_sum, picked = all_reduce(sums, group)
    lse = s_sum.log()
    logp = (picked - big_m) - lse
    ent = lse - w_sum / s_sum if with_entropy else torch.zeros_like(logp)
    return logp, ent, big_m, lse


class FusedLogProbs(torch.autograd.Function):
    """All rows' log-probs and entropy from the kernels; the backward is the chunked path's, in one pass per row.
    The TP all-reduces have an identity backward (as ``logprobs._ChunkLogProbs``)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, vocab_start, vocab_limit, group):
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        width = max(0, min(logits.shape[-1], vocab_limit - vocab_start))
        local = targets - vocab_start
        local = torch.where((local >= 0) & (local < width), local, torch.full_like(local, -1))
        logp, ent, big_m, lse = _forward(logits, local, temperature, width, with_entropy, group)
        ctx.save_for_backward(logits, local, big_m, lse, ent)
        ctx.args = (temperature, with_entropy, width)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, local, big_m, lse, ent = ctx.saved_tensors
        temperature, with_entropy, width = ctx.args
        rows, columns = logits.shape
        grad = torch.empty((rows, columns), dtype=logits.dtype, device=logits.device)
        if width == 0 or rows == 0:
            return grad.zero_(), None, None, None, None, None, None
        has_ent = with_entropy and g_ent is not None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        parts = [big_m, lse, ent, g_logp] + ([g_ent.float()] if has_ent else [])
        stats = torch.stack(parts).contiguous()
        with _device(logits):
            _kernels()[1][(rows,)](logits, logits.stride(0), grad, local, stats, rows, width, columns,
                                   float(temperature), HAS_ENT=has_ent, BLOCK=_block(width), num_warps=8)
        return grad, None, None, None, None, None, None


def token_log_probs(logits, targets, temperature, with_entropy, vocab_start, vocab_limit, group):
    """``logprobs.token_log_probs`` by the kernels, for all rows at once (no chunks: nothing [rows, vocab] is made
    but the gradient)."""
    lp, ent = FusedLogProbs.apply(logits, targets, temperature, with_entropy, vocab_start, vocab_limit, group)
    return lp, (ent if with_entropy else None)
