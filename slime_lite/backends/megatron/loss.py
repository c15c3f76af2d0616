"""Model outputs -> per-token tensors -> rl_math (the loss, slime's metric names). Pure torch, no Megatron.

Per-sample inputs are lists of 1-D tensors over each sample's response tokens (rl_math's convention).
Micro-batching: the trainer splits a global batch of N samples into micro-batches and sums their gradients.
Passing `normalizer=N` to `rl_loss`/`value_rl_loss` makes every micro-batch loss (and metric) its share of the
global per-sample mean, so the sums over micro-batches equal the single-batch values exactly (up to rounding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from slime_lite import rl_math, rollout_correction
from slime_lite.config import LossConfig

Tensors = Sequence[torch.Tensor]


def token_log_probs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each next token (and entropy) under softmax(logits / temperature), in float32.

    logits [..., T, V] and tokens [..., T] cover the same positions; the logits at position t predict tokens[t+1],
    so both outputs are [..., T-1]: out[t] = log p(tokens[t+1] | logits[t]). Entropy is that of the whole
    temperature-scaled distribution at each predicting position. bf16/fp16 logits are upcast before any maths.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} cover different positions")
    z = logits[..., :-1, :].float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    target = tokens[..., 1:].long().unsqueeze(-1)
    logp = z.gather(-1, target).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, entropy


def response_slices(
    per_position: torch.Tensor,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    packed: bool = True,
) -> list[torch.Tensor]:
    """Pick each sample's response part out of a per-position tensor indexed by the *predicting* position.

    `per_position[..., j]` belongs to position j, which predicts token j+1 (the output of
    `token_log_probs_and_entropy`, critic values, or logits along dim 0). The response token at position p of a
    sample is predicted at p-1, so sample i yields positions [prompt_len-1, prompt_len-1+response_len).
    packed=True: samples are concatenated along dim 0 (sample i starts at the sum of the earlier prompt+response
    lengths). packed=False: dim 0 is the sample, dim 1 the position (each row starts at position 0).
    """
    if len(prompt_lengths) != len(response_lengths):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(response_lengths)} response lengths")
    out = []
    start = 0
    for i, (pl, rl) in enumerate(zip(prompt_lengths, response_lengths)):
        if pl < 1:
            raise ValueError(f"sample {i}: prompt length must be >= 1 (the first response token needs a predictor)")
        lo = pl - 1
        if packed:
            out.append(per_position[start + lo : start + lo + rl])
            start += pl + rl
        else:
            out.append(per_position[i, lo : lo + rl])
        if out[-1].shape[0] != rl:
            raise ValueError(f"sample {i}: tensor too short for prompt {pl} + response {rl}")
    return out


def _cat(xs: Tensors) -> torch.Tensor:
    return torch.cat(list(xs)) if len(xs) else torch.zeros(0)


def rl_loss(
    logp: Tensors,
    old_logp: Tensors | None,
    ref_logp: Tensors | None,
    rollout_logp: Tensors | None,
    advantages: Tensors,
    masks: Tensors,
    entropy: Tensors | None,
    cfg: LossConfig,
    normalizer: float | None = None,
    pg_reducer: Callable[[list[torch.Tensor]], Callable[[torch.Tensor], torch.Tensor]] | None = None,
    denominators: list[float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss = pg_loss - entropy_coef*entropy + kl_loss_coef*kl (KL only with use_kl_loss), ``cfg``'s flags.

    ``pg_reducer`` (--custom-pg-loss-reducer-function-path): called with the loss masks (a rejected token's 0 there),
    it gives the reducer of the flat per-token policy loss in place of the sum of per-sample means; its value is
    divided by `normalizer` as every other term (slime's units). The other terms and metrics keep the default.

    Each term is aggregated as per-sample token means divided by `normalizer` (default: samples here); with
    ``denominators`` (``batch.trajectory_denominators``) a split trajectory's samples make one token mean.
    `old_logp` None means on-policy (old = logp detached). Rollout correction (use_tis / use_rs, slime_lite.rollout_correction
    ``rollout_correction`` on old vs rollout_logp): the per-token policy loss is multiplied by the IS weight, and a
    rejected token (tis_mode mask, use_rs) is taken out of every loss term's numerator while the per-sample
    denominators stay the loss-mask counts (as in slime). Metrics (slime's names; 0-dim float64 tensors, brought to
    the host once per step by the trainer): pg_loss, pg_clipfrac, ppo_kl, entropy_loss, kl_loss (when ref_logp is
    given), train_rollout_logprob_abs_diff (when rollout_logp is given, aggregated the same way), loss; with use_tis
    tis, tis_abs, tis_clipfrac (slime's names); with a rejecting correction rejected_frac. Correction metrics count
    every loss token, rejected or not.
    """
    lp = _cat(logp)
    old = lp.detach() if old_logp is None else _cat(old_logp)
    mask = _cat(masks).to(lp.dtype)
    adv = _cat(advantages).to(lp.dtype)
    keep: torch.Tensor | None = None

    def agg(x: torch.Tensor, kept: bool = True) -> torch.Tensor:
        return rl_math.aggregate_loss(x * keep if kept and keep is not None else x, masks, normalizer, denominators)

    pg, clipfrac, ppo_kl = rl_math.POLICY_LOSSES[cfg.loss_type].fn(lp, old, adv, mask, cfg.eps_clip, cfg.eps_clip_high,
                                                                   cfg.eps_clip_c)
    metrics: dict[str, torch.Tensor] = {}
    if rollout_logp is not None:
        rollout = _cat(rollout_logp).to(lp.dtype)
        metrics["train_rollout_logprob_abs_diff"] = agg((old - rollout).abs())
        if cfg.use_tis or cfg.use_rs:
            sizes = [m.numel() for m in masks]
            weights, keeps, stats = rollout_correction.rollout_correction(
                torch.split(old, sizes), torch.split(rollout, sizes), masks, tis=cfg.use_tis,
                tis_level=cfg.tis_level, tis_mode=cfg.tis_mode, tis_low=cfg.tis_clip_low, tis_high=cfg.tis_clip,
                rs=cfg.use_rs, rs_level=cfg.rs_level, rs_low=cfg.rs_lower_bound,
                rs_high=cfg.rs_upper_bound if cfg.rs_upper_bound is not None else cfg.tis_clip,
                rs_veto=cfg.rs_veto_threshold)
            pg = pg * _cat(weights).to(lp.dtype)
            names = ("tis", "tis_abs", "tis_clipfrac") if cfg.use_tis else ()
            if cfg.use_rs or (cfg.use_tis and cfg.tis_mode == "mask"):
                names += ("rejected",)
                keep = _cat(keeps).to(lp.dtype)
            metrics.update({("rejected_frac" if k == "rejected" else k): agg(stats[k].to(lp.dtype), kept=False)
                            for k in names})
    elif cfg.use_tis or cfg.use_rs:
        raise ValueError("--use-tis / --use-rs need the rollout log-probs of every sample")

    if pg_reducer is None:
        pg_loss = agg(pg)
    else:
        kept = list(masks) if keep is None else [m * k for m, k in zip(masks, torch.split(keep, [m.numel()
                                                                                               for m in masks]))]
        pg_loss = pg_reducer(kept)(pg if keep is None else pg * keep) / rl_math.loss_divisor(normalizer, len(masks))
    loss = pg_loss
    metrics.update(pg_loss=pg_loss, pg_clipfrac=agg(clipfrac), ppo_kl=agg(ppo_kl))

    if entropy is not None:
        entropy_loss = agg(_cat(entropy))
        metrics["entropy_loss"] = entropy_loss
        loss = loss - cfg.entropy_coef * entropy_loss
    elif cfg.entropy_coef != 0.0:
        raise ValueError("entropy_coef is set but no entropy was computed")

    if ref_logp is not None:
        kl_loss = agg(rl_math.compute_kl(lp, _cat(ref_logp).to(lp.dtype), cfg.kl_loss_type))
        metrics["kl_loss"] = kl_loss
        if cfg.use_kl_loss:
            loss = loss + cfg.kl_loss_coef * kl_loss
    elif cfg.use_kl_loss:
        raise ValueError("--use-kl-loss needs reference log-probs")

    metrics["loss"] = loss
    # 0-dim float64 tensors where the loss is: the trainer brings a step's metrics to the host in one copy
    values = torch.stack([v.detach().double().reshape(()) for v in metrics.values()]).unbind()
    return loss, dict(zip(metrics, values))


def value_rl_loss(
    values: Tensors,
    old_values: Tensors,
    returns: Tensors,
    masks: Tensors,
    value_clip: float,
    normalizer: float | None = None,
    denominators: list[float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss: clipped value loss aggregated like `rl_loss` -> (loss, {value_loss, value_clipfrac})."""
    v = _cat(values)
    per_token, clipfrac = rl_math.value_loss(v, _cat(old_values).to(v.dtype), _cat(returns).to(v.dtype), value_clip)
    loss = rl_math.aggregate_loss(per_token, masks, normalizer, denominators)
    clip = rl_math.aggregate_loss(clipfrac, masks, normalizer, denominators)
    return loss, {"value_loss": loss.detach().double(), "value_clipfrac": clip.detach().double()}


def mismatch_report(
    samples: Sequence, train_logp: Tensors, rollout_logp: Tensors, masks: Tensors, bound: float, top_k: int,
    decode: Any = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """--get-mismatch-metrics of one rollout: ``mismatch/<name>`` scalars (``rollout_correction.mismatch_metrics``) and the
    ``top_k`` worst tokens as dicts: sample (the rollout sample index), position (in the response), token_id,
    token (``decode([token_id])`` when given), train_log_prob, rollout_log_prob, abs_diff."""
    scalars, worst = rollout_correction.mismatch_metrics(train_logp, rollout_logp, masks, bound, top_k)
    rows = []
    for i, pos, t, r in worst:
        s = samples[i]
        token_id = int(s.tokens[len(s.tokens) - s.response_length + pos])
        rows.append({"sample": s.index if s.index is not None else i, "position": pos, "token_id": token_id,
                     "token": decode([token_id]) if decode is not None else None, "train_log_prob": t,
                     "rollout_log_prob": r, "abs_diff": abs(t - r)})
    return {f"mismatch/{k}": v for k, v in scalars.items()}, rows
