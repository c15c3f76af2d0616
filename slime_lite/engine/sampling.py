"""Sampling parameters and the batched sampler of the embedded engine.

Log-probs: each generated token's log-prob is taken from ``log_softmax(logits / temperature)`` over the whole
vocabulary, before top-k/top-p/min-p truncation and before the ``min_new_tokens`` ban (which, as in SGLang, applies
before top-p: top-p keeps its share of the tokens not banned); greedy rows
(temperature < 1e-6) use temperature 1. That is the quantity the trainer recomputes (it divides its logits by
``--rollout-temperature``), so rollout and training log-probs agree at step 1.

Randomness: inverse-CDF sampling over the truncated distribution with one uniform number per request and step,
a hash of ``(seed, step)``. A request's samples therefore depend only on its seed and its logits, not on which other
requests share the batch (nor on the order requests arrive in).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from slime_lite.engine import block_stats
from slime_lite.engine import validate as check
from slime_lite.rl_math import GREEDY_EPS
_MASK64 = (1 << 64) - 1

# Fields SGLang accepts that the embedded engine takes at their neutral value only.
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
_IGNORED = {"spaces_between_special_tokens", "n", "stream_interval"}


def mix64(a: int, b: int) -> int:
    """Hash two integers to a non-negative 63-bit seed (splitmix64 finalizer)."""
    x = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that depends only on ``(seed, step)`` (53 random bits)."""
    return (mix64(seed, step) >> 10) / float(1 << 53)


def uniforms(seeds: Sequence[int], steps: Sequence[int]) -> list[float]:
    """``[uniform(seed, step) ...]`` computed with wrapping uint64 array arithmetic (same bits, one pass)."""

    a = np.array(seeds, dtype=np.uint64)
    b = np.array(steps, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = a * np.uint64(0x9E3779B97F4A7C15) + b + np.uint64(0x632BE59BD9B4E019)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = (x ^ (x >> np.uint64(31))) >> np.uint64(11)
    return (x.astype(np.float64) / float(1 << 53)).tolist()


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128  # None (JSON null): up to the context limit (the batch slot)
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    logit_bias: dict[int, float] | None = None  # added to the logits before sampling (and its log-probs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0

    @functools.cached_property
    def stop_id_set(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids)

    @functools.cached_property
    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``logit_bias`` as (token ids, biases) CPU tensors, built once a request, not once a step."""
        bias = self.logit_bias or {}
        return torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values()), dtype=torch.float32)

    @classmethod
    def from_dict(cls, d: Any) -> "SamplingParams":
        """Validate SGLang-style ``sampling_params``; ``ValueError`` names the bad field."""
        if d is not None and not isinstance(d, dict):
            raise ValueError("sampling_params must be an object (or a list of them, one per prompt)")
        to_limit = d is not None and "max_new_tokens" in d and d["max_new_tokens"] is None
        d = {k: x for k, x in (d or {}).items() if x is not None and k not in _IGNORED}
        for k, neutral in _NEUTRAL.items():
            val = d.pop(k, None)
            if val is not None and check.number(val, f"sampling_params.{k}") != neutral:
                raise ValueError(f"sampling_params.{k}={val} is not supported by the embedded engine "
                                 f"(only {neutral})")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unsupported sampling_params field(s): {', '.join(unknown)}")
        stop = check.string_list(d.get("stop", []), "sampling_params.stop")
        if not all(stop) or len(stop) > check.MAX_STOP:
            raise ValueError(f"sampling_params.stop: at most {check.MAX_STOP} strings, none empty")
        stop_ids = d.get("stop_token_ids", [])
        if not isinstance(stop_ids, list):
            raise ValueError("sampling_params.stop_token_ids must be a list of token ids")
        f = "sampling_params."
        top_k = check.integer(d.get("top_k", -1), f + "top_k", -1)
        if top_k == 0:
            raise ValueError("sampling_params.top_k=0 must be -1 (all) or >= 1")
        seed = d.get("sampling_seed")
        if seed is not None:
            seed = check.integer(seed, f + "sampling_seed")  # int64, as SGLang checks it
        max_new = None if to_limit else check.integer(d.get("max_new_tokens", 128), f + "max_new_tokens", 0)
        min_new = check.integer(d.get("min_new_tokens", 0), f + "min_new_tokens", 0)
        if max_new is not None and min_new > max_new:
            raise ValueError(f"sampling_params.min_new_tokens={min_new} must be at most "
                             f"sampling_params.max_new_tokens={max_new}")
        return cls(
            max_new_tokens=max_new,
            min_new_tokens=min_new,
            temperature=check.number(d.get("temperature", 1.0), f + "temperature", 0.0),
            top_p=check.number(d.get("top_p", 1.0), f + "top_p", 0.0, 1.0, lo_open=True),
            top_k=top_k,
            min_p=check.number(d.get("min_p", 0.0), f + "min_p", 0.0, 1.0),
            stop=stop,
            stop_token_ids=[check.integer(t, f + "stop_token_ids", 0) for t in stop_ids],
            ignore_eos=check.boolean(d.get("ignore_eos", False), f + "ignore_eos"),
            skip_special_tokens=check.boolean(d.get("skip_special_tokens", True), f + "skip_special_tokens"),
            no_stop_trim=check.boolean(d.get("no_stop_trim", False), f + "no_stop_trim"),
            sampling_seed=seed,
            logit_bias=_logit_bias(d.get("logit_bias")),
        )


def _logit_bias(value: Any) -> dict[int, float] | None:
    """SGLang's ``logit_bias``: ``{"token_id": bias}`` (keys are strings in JSON), each bias within
    +-``MAX_LOGIT_BIAS``; the vocabulary range is checked by the scheduler."""
    if value is None:
        return None
    name = "sampling_params.logit_bias"
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object {{token_id: bias}}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: key {key!r} is not a token id") from None
        out[tid] = check.number(bias, f"{name}[{key}]", -check.MAX_LOGIT_BIAS, check.MAX_LOGIT_BIAS)
    return out or None


BLOCK = 1024  # the inverse CDF is searched block sums first, then one block: no full-vocabulary cumsum


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int],
           banned: Sequence[Sequence[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of float32 ``logits [B, V]``; return ``(token ids [B], log-probs [B])``.

    ``banned[i]`` lists token ids row ``i`` may not sample now (``min_new_tokens``); they keep their log-prob.
    Every row is first drawn by ``sample_rows``, the sampler CUDA-graph steps run; rows with truncation or a ban are
    then drawn again from their truncated distribution. So a plain row's token does not depend on what the other
    rows of its batch ask for.
    """
    dev = logits.device
    greedy_rows = [p.greedy for p in params]
    temps = [1.0 if g else p.temperature for g, p in zip(greedy_rows, params)]
    u = torch.tensor(uniforms(seeds, steps), dtype=torch.float64, device=dev)
    tokens, logprobs = sample_rows(logits, torch.tensor(temps, device=dev), u, torch.tensor(greedy_rows, device=dev))
    special = [p.truncates or bool(banned and banned[i]) for i, p in enumerate(params)]
    if not any(special):
        return tokens, logprobs
    picked = [i for i, sp in enumerate(special) if sp]
    rows = torch.tensor(picked, device=dev)
    sub = [params[i] for i in picked]
    x = logits[rows] / torch.tensor([temps[i] for i in picked], device=dev)[:, None]
    logp = x - torch.logsumexp(x, dim=-1, keepdim=True)
    samp = _ban(logp.clone(), [banned[i] for i in picked]) if banned else logp
    probs = _truncate(samp, logp, sub, any(p.top_k > 0 for p in sub), any(p.top_p < 1.0 for p in sub)).exp()
    drawn = _inverse_cdf(probs, u[rows])
    drawn = torch.where(torch.tensor([p.greedy for p in sub], device=dev), probs.argmax(-1), drawn)
    tokens, logprobs = tokens.clone(), logprobs.clone()
    tokens[rows] = drawn
    logprobs[rows] = logp.gather(1, drawn[:, None])[:, 0]
    return tokens, logprobs


def sample_rows(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor, greedy: torch.Tensor,
                out: torch.Tensor | None = None):
    """Rows with no truncation and no banned tokens, from tensors only (no host sync, fixed shapes: it runs inside
    captured CUDA graphs): ``logits [B, V]`` (any float dtype; computed in float32), ``temps`` (1 for greedy
    rows), ``u`` from ``uniforms``, ``greedy`` (a row not 0 is greedy). ``out [2, >= B]``: the tokens and log-probs
    go into its rows (on CUDA the kernels write them there: no copies). The token is the inverse CDF of
    ``softmax(logits / temperature)`` at ``u`` (the argmax for greedy rows); its log-prob is
    ``(logit - max) / temperature - log(sum)``, with the sum in float64. On CUDA two Triton kernels do it all
    (``block_stats``); here, the max and float64 sums of ``exp((logits - max) / T)`` over blocks of ``BLOCK`` tokens
    are the only full passes over the vocabulary, then one block is searched."""
    if block_stats.available(logits.device):
        return block_stats.triton_sample(logits, temps, u, greedy, BLOCK, out=out)
    if out is not None:
        for row, value in zip(out, sample_rows(logits, temps, u, greedy)):
            row[: len(value)].copy_(value)
        return out[0, : len(logits)], out[1, : len(logits)]
    greedy = greedy.bool()
    inv_t = (1.0 / temps.float())[:, None]
    x = logits.float()
    m = x.amax(-1, keepdim=True)
    sums, top = _block_sums((x - m).mul_(inv_t).exp_()), x.argmax(-1)
    v = logits.shape[-1]

    def weights(idx: torch.Tensor) -> torch.Tensor:  # float32 exponentials of one block, as the block sums
        block = logits.gather(1, idx.clamp(max=v - 1)).float()
        return (block - m).mul_(inv_t).exp_().double().masked_fill_(idx >= v, 0.0)

    tokens = torch.where(greedy, top, _search(sums, u.double(), weights, v))
    picked = ((logits.gather(1, tokens[:, None]).float() - m) * inv_t)[:, 0]
    return tokens, (picked.double() - sums.sum(-1).log()).float()


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """Per row of ``x [B, N]``, the index of its last entry > 0, as ``[B, 1]`` (N - 1 when there is none)."""
    return x.shape[-1] - 1 - (x > 0).flip(-1).int().argmax(-1, keepdim=True)


def _ban(t: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """Log-probs ``t`` with row ``i``'s ``banned[i]`` at -inf and the row normalized again (SGLang bans them in the
    logits, before the softmax: top-p counts the mass of the tokens left). Rows with no ban are left as they are."""
    for i, ids in enumerate(banned):
        if ids:
            t[i, list(ids)] = float("-inf")
            t[i] -= torch.logsumexp(t[i], dim=-1).nan_to_num(neginf=0.0)  # nothing left: unchanged
    return t


def _block_sums(w: torch.Tensor) -> torch.Tensor:
    """Float64 sums of ``w [B, V]`` over consecutive blocks of ``BLOCK`` tokens (the last one may be partial)."""
    b, v = w.shape
    size = min(BLOCK, v)
    full, rest = divmod(v, size)
    sums = w[:, : full * size].reshape(b, full, size).sum(-1, dtype=torch.float64)
    if rest:
        sums = torch.cat([sums, w[:, full * size :].sum(-1, dtype=torch.float64, keepdim=True)], dim=1)
    return sums


def _search(sums: torch.Tensor, u: torch.Tensor, weights, v: int) -> torch.Tensor:
    """The first token whose cumulative weight exceeds ``u * total``: the block from the block ``sums``, then the
    token from the cumsum of that block's float64 ``weights(token ids [B, min(BLOCK, v)])``."""
    size = min(BLOCK, v)
    csum = sums.cumsum(-1)
    target = (u * csum[:, -1])[:, None]
    # Clamps keep float64 rounding (target at the very top) off zero-weight blocks and tokens.
    blk = torch.minimum(torch.searchsorted(csum, target, right=True), _last_positive(sums))
    base = F.pad(csum, (1, 0)).gather(1, blk)  # mass before the block: <= target exactly
    idx = blk * size + torch.arange(size, device=sums.device)
    w = weights(idx)
    inside = w.cumsum(-1)
    # The target's place inside the block, as a fraction of the block's sum, on the block's own cumsum: the
    # block sums may round differently from the weights (they come from another kernel on CUDA), and a target
    # past the block's cumsum must not fall to its last token.
    frac = ((target - base) / sums.gather(1, blk)).clamp_(0.0, 1.0)
    pos = torch.minimum(torch.searchsorted(inside, frac * inside[:, -1:], right=True), _last_positive(w))
    return idx.gather(1, pos)[:, 0].clamp_(max=v - 1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative (float64) probability exceeds ``u * total``. ``probs [B, V]`` are
    non-negative and need not sum to 1."""
    v = probs.shape[-1]

    def weights(idx: torch.Tensor) -> torch.Tensor:
        return probs.gather(1, idx.clamp(max=v - 1)).double().masked_fill_(idx >= v, 0.0)

    return _search(_block_sums(probs), u, weights, v)


def _truncate(samp: torch.Tensor, logp: torch.Tensor, params: Sequence[SamplingParams], need_k: bool,
              need_p: bool) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p (on the full tempered distribution) and min-p remove; keep the top token."""
    dev, vocab = samp.device, samp.shape[-1]
    sorted_lp, order = samp.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_lp, dtype=torch.bool)
    ranks = torch.arange(vocab, device=dev)[None, :]
    if need_k:
        k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
        remove |= ranks >= k[:, None]
    probs = sorted_lp.exp()
    if need_p:  # only rows that ask: float32 cumsums pass 1.0 in the tail, which top_p = 1 must keep
        top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
        remove |= ((probs.cumsum(-1) - probs) > top_p) & (top_p < 1.0)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    out = torch.full_like(samp, float("-inf"))
    return out.scatter_(1, order, sorted_lp.masked_fill(remove, float("-inf")))
