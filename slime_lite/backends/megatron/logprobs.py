"""Next-token log-probs and entropy from (vocab-parallel) logits, chunk by chunk: never a float32 [tokens, vocab].

The output layer of a TP group leaves each rank with its slice of the vocabulary. Log-softmax over the whole
vocabulary needs, per token, the max and the sum of exp over every slice: each rank reduces its slice and the
results are all-reduced over the TP group (Megatron's vocab-parallel cross-entropy does the same). The target's
logit lives on one rank (the others add 0). The sums are all-reduced with an identity backward (as Megatron's
``reduce_from_tensor_model_parallel_region``: every TP rank holds the same loss, so each back-propagates its own
slice only); the max is a constant for autograd (log-sum-exp does not depend on it). Pure torch: no Megatron import.

Tokens are processed in chunks of ``chunk_tokens`` rows. A chunk's forward keeps only per-row statistics (the
max, the log-sum-exp, the entropy) next to the model's own logits; its backward rebuilds the softmax from them and
writes the gradient of the logits in a few passes over the chunk (an autograd graph of the forward's ops, recomputed
by checkpointing, took about twice as many passes over the float32 [chunk, vocab] tensors: on an H200 these passes
were a large part of a 0.5B model's train step). Every row is reduced on its own, so a token's result does not
depend on the chunk or micro-batch it sits in. On CUDA with Triton, ``logprobs_fused`` does the same in one read of
the logits forward and one backward (this module stays the reference and the CPU path).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from slime_lite.backends.megatron import logprobs_fused
from slime_lite.backends.megatron.batch import to_device
from slime_lite.backends.megatron.logprobs_fused import all_reduce as _all_reduce
from slime_lite.backends.megatron.loss import response_slices

CHUNK_TOKENS = 1024


def _scaled(logits: torch.Tensor, temperature: float, width: int) -> torch.Tensor:
    """The chunk's real-vocabulary columns in float32, divided by the temperature (a new tensor)."""
    z = logits[..., :width].to(torch.float32, copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def _chunk_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                   vocab_start: int, vocab_limit: int, group) -> tuple[torch.Tensor, ...]:
    """Per row: log p(target), entropy (zeros without with_entropy), the max and the log-sum-exp minus it."""
    width = max(0, min(logits.shape[-1], vocab_limit - vocab_start))  # columns past the real vocabulary: padding
    s = _scaled(logits, temperature, width)
    m = s.max(dim=-1).values if width else s.new_full(s.shape[:-1], -torch.inf)  # a slice of padding only: no max
    m = _all_reduce(m, group, "max")
    s.sub_(m.unsqueeze(-1))  # shifted logits, <= 0
    local = targets - vocab_start
    inside = (local >= 0) & (local < width)
    picked = s.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) if width else torch.zeros_like(m)
    picked = _all_reduce(torch.where(inside, picked, torch.zeros_like(picked)), group)
    e = s.exp()
    sum_exp = _all_reduce(e.sum(-1), group)
    lse = sum_exp.log()  # log-sum-exp minus m
    logp = picked - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp), m, lse
    # H = lse - E_p[shifted] (shifted <= 0: two non-negative terms, no cancellation); global sums of slice terms
    weighted = _all_reduce((e.mul_(s)).sum(-1), group)
    return logp, lse - weighted / sum_exp, m, lse


class _ChunkLogProbs(torch.autograd.Function):
    """One chunk's log-probs and entropy with a hand-written backward. With p = softmax(z) over the whole
    vocabulary (z = logits / temperature) and s = z - m: d logp / dz_j = [j = target] - p_j and
    d H / dz_j = -p_j (s_j - lse + H). The TP all-reduces of the forward have an identity backward (as Megatron's
    ``reduce_from_tensor_model_parallel_region``: every rank holds the same loss, each back-propagates its own
    slice); the max is a constant for autograd (log-sum-exp does not depend on it)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, vocab_start, vocab_limit, group):
        logp, ent, m, lse = _chunk_forward(logits, targets, temperature, with_entropy, vocab_start, vocab_limit,
                                           group)
        ctx.save_for_backward(logits, targets, m, lse, ent)
        ctx.args = (temperature, with_entropy, vocab_start, vocab_limit)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, m, lse, ent = ctx.saved_tensors
        temperature, with_entropy, vocab_start, vocab_limit = ctx.args
        width = max(0, min(logits.shape[-1], vocab_limit - vocab_start))
        if width == 0:  # all padding: no gradient
            return torch.zeros_like(logits), None, None, None, None, None, None
        s = _scaled(logits, temperature, width).sub_(m.unsqueeze(-1))
        p = (s - lse.unsqueeze(-1)).exp_()  # log p = s - lse
        if with_entropy and g_ent is not None:  # -p * (g_logp + g_ent * (s - lse + H))
            grad = s.sub_((lse - ent).unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(g_logp.unsqueeze(-1))
            grad = grad.mul_(p).neg_()
        else:
            grad = p.mul_(g_logp.unsqueeze(-1)).neg_()
        local = targets - vocab_start
        inside = (local >= 0) & (local < width)
        own = torch.where(inside, g_logp, torch.zeros_like(g_logp)).unsqueeze(-1)  # the target's own term
        grad.scatter_add_(-1, local.clamp(0, width - 1).unsqueeze(-1), own)  # (no host sync, unlike nonzero)
        if temperature != 1.0:
            grad.div_(temperature)
        out = torch.zeros_like(logits) if width < logits.shape[-1] else None
        if out is None:
            return grad.to(logits.dtype), None, None, None, None, None, None
        out[..., :width] = grad
        return out, None, None, None, None, None, None


def token_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    vocab_start: int = 0,
    vocab_limit: int | None = None,
    tp_group=None,
    chunk_tokens: int = CHUNK_TOKENS,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[n] | logits[n]) and the entropy of softmax(logits[n] / temperature), float32, for rows n.

    logits [N, V_local]: this rank's vocabulary columns [vocab_start, vocab_start + V_local) (all of them with
    tp_group None); vocab_limit: the real vocabulary size (columns at or past it are padding); targets [N] global ids.
    fused: the Triton kernels of ``logprobs_fused`` (None: wherever they can run, i.e. CUDA with Triton), else the
    chunked torch ops below (chunk_tokens rows at a time).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape or logits.dim() != 2:
        raise ValueError(f"logits {tuple(logits.shape)} must be [N, V] for targets [N], got {tuple(targets.shape)}")
    limit = vocab_start + logits.shape[-1] if vocab_limit is None else vocab_limit
    targets = targets.to(logits.device).long()
    if fused or (fused is None and logprobs_fused.available(logits)):
        return logprobs_fused.token_log_probs(logits, targets, temperature, with_entropy, vocab_start, limit, tp_group)
    outs_lp, outs_ent = [], []
    grad = torch.is_grad_enabled() and logits.requires_grad
    # split, not a slice per chunk: a slice's backward writes into a zeroed copy of the whole logits (O(chunks x N))
    for part, target in zip(logits.split(chunk_tokens), targets.split(chunk_tokens)):
        args = (part, target, temperature, with_entropy, vocab_start, limit, tp_group)
        lp, ent = _ChunkLogProbs.apply(*args) if grad else _chunk_forward(*args)[:2]
        outs_lp.append(lp)
        outs_ent.append(ent)
    if not outs_lp:
        empty = logits.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(outs_lp), (torch.cat(outs_ent) if with_entropy else None)


def sample_log_probs(output: torch.Tensor, mb, temperature: float, vocab_limit: int, with_entropy: bool = False,
                     tp: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Each sample's response-token log-probs (and entropies) from a micro-batch's model output [B, T, V_local]
    (padded rows, or one packed row: ``mb.packed``), chunked and over TP vocabulary slices (tp=True)."""

    rows, width = output.shape[0], output.shape[-1]
    tokens = to_device(mb.tokens, output.device)
    group, start = None, 0
    if tp:
        if ps.get_tensor_model_parallel_world_size() > 1:
            group, start = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank() * width
    # every position against the next token (the last one's target wraps and is dropped): the logits stay a view,
    # never a sliced copy of [T, V]
    lp, ent = token_log_probs(output.reshape(-1, width), tokens.roll(-1, dims=1).reshape(-1), temperature,
                             with_entropy, vocab_start=start, vocab_limit=vocab_limit, tp_group=group)

    def pick(x: torch.Tensor) -> list[torch.Tensor]:
        x = x.view(rows, -1)[:, :-1]
        return response_slices(x[0] if mb.packed else x, mb.prompt_lengths, mb.response_lengths, packed=mb.packed)

    return pick(lp), (pick(ent) if ent is not None else None)
