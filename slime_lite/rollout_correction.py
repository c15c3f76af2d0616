"""Rollout correction: importance weights and rejection of tokens and samples between the trainer's (old) policy
and the engine's (the rollout policy), and the mismatch metrics of the two. Pure torch functions, the conventions of
``slime_lite.rl_math`` (ragged lists of 1-D tensors with their loss masks).

The importance ratio of a token is exp(train - rollout) with ``train`` the trainer's (old) log-prob and ``rollout``
the engine's. Levels: "token" (each token its own ratio), "sequence" (the product over the sample's loss tokens:
exp of the summed log differences) and "geometric" (exp of their mean). Log-ratios are clamped to
[-LOG_RATIO_BOUND, LOG_RATIO_BOUND] before exp, so a long sequence cannot overflow.
"""

from __future__ import annotations

import math

from slime_lite.rl_math import Tensors, torch  # torch loads lazily there: the flag parser reads IS_LEVELS

IS_LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "mask")
LOG_RATIO_BOUND = 20.0


def level_log_ratios(train: Tensors, rollout: Tensors, masks: Tensors, level: str) -> list[torch.Tensor]:
    """Per sample, the log importance ratio at `level`, broadcast over the sample's tokens (not clamped)."""
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; expected one of {IS_LEVELS}")
    out = []
    for t, r, m in zip(train, rollout, masks):
        d = t - r
        if level != "token":
            mf = m.to(d.dtype)
            s = (d * mf).sum()
            d = torch.ones_like(d) * (s if level == "sequence" else s / mf.sum().clamp(min=1))
        out.append(d)
    return out


def rollout_correction(
    train: Tensors,
    rollout: Tensors,
    masks: Tensors,
    *,
    tis: bool = False,
    tis_level: str = "token",
    tis_mode: str = "truncate",
    tis_low: float | None = None,
    tis_high: float = 2.0,
    rs: bool = False,
    rs_level: str = "token",
    rs_low: float | None = None,
    rs_high: float = 2.0,
    rs_veto: float | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, torch.Tensor]]:
    """Importance weights and rejection masks per sample for the policy loss -> (weights, keep, per-token stats).

    IS (`tis`), ratio w at `tis_level`: mode "truncate" uses min(w, tis_high), floored at tis_low when given
    (slime's --use-tis with --tis-clip-low); mode "mask" keeps w where tis_low <= w <= tis_high (tis_low None:
    1/tis_high) and rejects the token (keep 0) elsewhere. RS (`rs`): tokens (or whole samples, at sequence or
    geometric level) whose ratio at `rs_level` is outside [rs_low (None: 1/rs_high), rs_high] are rejected, their
    weight unchanged; `rs_veto` rejects a whole sample with any loss token whose token ratio is below it.
    Weights are 1 and keep equals the mask when a switch is off; nothing carries a gradient. Stats (per token,
    shaped like the inputs, for masked aggregation): tis (w before bounds), tis_abs (|w - 1|), tis_clipfrac (1
    where the IS bounds changed or rejected the token), rejected (1 where keep is 0 on a loss token).
    """
    if tis_mode not in TIS_MODES:
        raise ValueError(f"unknown tis mode {tis_mode!r}; expected one of {TIS_MODES}")
    weights, keeps = [], []
    stats: dict[str, list[torch.Tensor]] = {"tis": [], "tis_abs": [], "tis_clipfrac": [], "rejected": []}
    tis_logs = level_log_ratios(train, rollout, masks, tis_level)
    rs_logs = level_log_ratios(train, rollout, masks, rs_level) if rs else tis_logs
    for t, r, m, lt, lr in zip(train, rollout, masks, tis_logs, rs_logs):
        t, r = t.detach(), r.detach()
        loss_tok = m.bool()
        keep = loss_tok.clone()
        raw = torch.exp(lt.detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        w = torch.ones_like(raw)
        changed = torch.zeros_like(loss_tok)
        if tis:
            if tis_mode == "truncate":
                w = raw.clamp(min=tis_low if tis_low is not None else None, max=tis_high)
                changed = w != raw
            else:
                low = tis_low if tis_low is not None else 1.0 / tis_high
                inside = (raw >= low) & (raw <= tis_high)
                w = torch.where(inside, raw, torch.zeros_like(raw))
                changed = ~inside
                keep = keep & inside
        if rs:
            ratio = torch.exp(lr.detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
            low = rs_low if rs_low is not None else 1.0 / rs_high
            keep = keep & (ratio >= low) & (ratio <= rs_high)
            if rs_veto is not None and bool(((t - r < math.log(rs_veto)) & loss_tok).any()):
                keep = torch.zeros_like(keep)
        weights.append(w)
        keeps.append(keep.to(raw.dtype))
        stats["tis"].append(raw)
        stats["tis_abs"].append((raw - 1).abs())
        stats["tis_clipfrac"].append((changed & loss_tok).to(raw.dtype))
        stats["rejected"].append((loss_tok & ~keep).to(raw.dtype))
    return weights, keeps, {k: torch.cat(v) if v else torch.zeros(0) for k, v in stats.items()}


def mismatch_metrics(
    train: Tensors, rollout: Tensors, masks: Tensors, bound: float, top_k: int = 0
) -> tuple[dict[str, float], list[tuple[int, int, float, float]]]:
    """Train vs rollout log-probs over every loss token of a batch -> (scalars, worst tokens), in float64.

    Token level, r = exp(train - rollout) over all loss tokens pooled: token_ratio_mean/max/min and
    token_ratio_outside_frac (share outside [1/bound, bound]). Sequence level, one ratio per sample with loss
    tokens, exp of its summed log differences (log clamped to +-LOG_RATIO_BOUND): seq_ratio_mean/max/min and
    seq_ratio_outside_frac. k3_kl: mean over loss tokens of r - 1 - log r, the k3 estimate of KL(rollout || train);
    kl: mean of rollout - train (the k1 estimate). Worst tokens: the `top_k` loss tokens of largest
    |train - rollout|, as (sample, position in the response, train, rollout), largest first.
    """
    d_tok, seq, where = [], [], []
    for i, (t, r, m) in enumerate(zip(train, rollout, masks)):
        keep = m.bool()
        d = (t.detach().double() - r.detach().double())[keep]
        if d.numel():
            seq.append(d.sum())
            d_tok.append(d)
            where.append(torch.stack([torch.full_like(d, i), torch.nonzero(keep).flatten().double(),
                                      t.detach().double()[keep], r.detach().double()[keep]], dim=1))
    if not d_tok:
        return {}, []
    d = torch.cat(d_tok)
    ratio = torch.exp(d)
    s_ratio = torch.exp(torch.stack(seq).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    lo = 1.0 / bound

    def outside(x: torch.Tensor) -> float:
        return float(((x < lo) | (x > bound)).double().mean())

    out = {
        "token_ratio_mean": float(ratio.mean()), "token_ratio_max": float(ratio.max()),
        "token_ratio_min": float(ratio.min()), "token_ratio_outside_frac": outside(ratio),
        "seq_ratio_mean": float(s_ratio.mean()), "seq_ratio_max": float(s_ratio.max()),
        "seq_ratio_min": float(s_ratio.min()), "seq_ratio_outside_frac": outside(s_ratio),
        "k3_kl": float((ratio - 1 - d).mean()), "kl": float((-d).mean()),
    }
    rows = torch.cat(where)
    order = torch.argsort(d.abs(), descending=True, stable=True)[: max(top_k, 0)]
    worst = [(int(rows[j, 0]), int(rows[j, 1]), float(rows[j, 2]), float(rows[j, 3])) for j in order.tolist()]
    return out, worst
