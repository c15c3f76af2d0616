"""Rollout and eval metrics recomputed from Samples, with slime's metric names. Pure Python."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from slime_lite.errors import SlimeLiteError
from slime_lite.rollout.turns import turns
from slime_lite.types import RewardError, Sample, Status, trajectory_ends


def scalar_rewards(samples: list[Sample], reward_key: str | None = None) -> dict[int, float]:
    """``{position: scalar reward}`` of the samples that have a reward; a reward that is not one number is a
    SlimeLiteError naming ``--reward-key``."""
    try:
        return {i: s.scalar_reward(reward_key) for i, s in enumerate(samples) if s.reward is not None}
    except RewardError as exc:
        raise SlimeLiteError(str(exc)) from None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _sample_logprob_mean(sample: Sample) -> float | None:
    """Mean rollout log-prob over the sample's response tokens (loss-masked tokens only, when a mask exists)."""
    lps = sample.rollout_log_probs
    if not lps:
        return None
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * len(lps)
    kept = [float(lp) for lp, m in zip(lps, mask) if m]
    return _mean(kept) if kept else None


def _zero_std_group_ratio(samples: list[Sample], rewards: dict[int, float]) -> float | None:
    """Share of prompt groups (by ``group_index``, size > 1) whose rewards are all equal: no GRPO signal."""
    groups: dict[Any, list[float]] = defaultdict(list)
    for i, s in enumerate(samples):
        if s.group_index is not None and i in rewards:
            groups[s.group_index].append(rewards[i])
    sized = [g for g in groups.values() if len(g) > 1]
    if not sized:
        return None
    return sum(1 for g in sized if max(g) == min(g)) / len(sized)


def _group_centred(samples: list[Sample], rewards: dict[int, float]) -> list[float]:
    """Each reward minus its group's mean."""
    groups: dict[Any, list[float]] = defaultdict(list)
    for i, s in enumerate(samples):
        if i in rewards:
            groups[s.group_index].append(rewards[i])
    return [r - sum(g) / len(g) for g in groups.values() for r in g]


def pass_at_k(samples: list[Sample], rewards: dict[int, float]) -> dict[str, float]:
    """``pass@k`` for k = 1, 2, 4, ... up to the smallest prompt group (``group_index``), as slime's --log-passrate:
    per group of n samples with c rewards of exactly 1 (a sample without a reward fails), the unbiased estimate
    1 - C(n - c, k) / C(n, k), averaged over the groups; {} when a group has one sample."""
    groups: dict[Any, list[bool]] = defaultdict(list)
    for i, s in enumerate(samples):
        groups[s.group_index if s.group_index is not None else ("sample", i)].append(rewards.get(i) == 1.0)
    smallest = min((len(g) for g in groups.values()), default=0)
    out, k = {}, 1
    while smallest > 1 and k <= smallest:
        est = [1.0 - math.comb(len(g) - sum(g), k) / math.comb(len(g), k) for g in groups.values()]
        out[f"pass@{k}"] = _mean(est)
        k *= 2
    return out


def groups_rewards(args: Any) -> bool:
    """Whether the run's estimator normalises rewards within each prompt's group (GRPO, REINFORCE++-baseline)."""
    from slime_lite.rl_math import estimator  # torch

    return estimator(args.advantage_estimator).needs_groups


def rollout_metrics(samples: list[Sample], reward_key: str | None = None,
                    grouped: bool = False, passrate: bool = False,
                    reward_category: str | None = None) -> dict[str, float]:
    """Metrics of one rollout batch: ``rollout/raw_reward``, ``rollout/response_len/mean`` and so on.

    Rewards are averaged over the samples that have one. ``rollout/rewards`` is, as in slime, the mean of the
    rewards the estimator trains on: with ``grouped`` (the estimator normalises within each prompt's group) each
    reward minus its group's mean (slime also divides by the group's std for GRPO, which leaves the mean alone),
    so it stays about 0; otherwise the raw rewards. ``rollout/rollout_log_probs`` is the per-sample token mean
    (loss-masked) averaged over samples, as slime averages per-token quantities. With ``passrate``
    (--log-passrate): ``passrate/pass@k`` over the prompt groups. With ``reward_category`` (--log-reward-category
    KEY): ``error_cat/<value>``, the share of the samples whose dict reward has that value at KEY. The group
    metrics (zero-std groups, pass@k) count trajectories: a trajectory split into several samples by its end.
    """
    if not samples:
        return {}
    out: dict[str, float] = {}
    rewards = scalar_rewards(samples, reward_key)
    if rewards:
        out["rollout/raw_reward"] = _mean(list(rewards.values()))
        processed = _group_centred(samples, rewards) if grouped else rewards.values()
        out["rollout/rewards"] = _mean(list(processed))
    lengths = [s.effective_response_length for s in samples]  # as slime: the loss-masked (model) tokens
    out["rollout/response_len/mean"] = _mean(lengths)
    out["rollout/response_len/max"] = float(max(lengths))
    out["rollout/response_len/min"] = float(min(lengths))
    out["rollout/truncated_ratio"] = _mean([s.status == Status.TRUNCATED for s in samples])
    out["rollout/aborted_ratio"] = _mean([s.status == Status.ABORTED for s in samples])
    out["rollout/failed_ratio"] = _mean([s.status == Status.FAILED for s in samples])
    out.update(multi_turn_metrics(samples))
    lp_means = [m for m in map(_sample_logprob_mean, samples) if m is not None]
    if lp_means:
        out["rollout/rollout_log_probs"] = _mean(lp_means)
    # per trajectory (a trajectory split into several samples counts once, by its end's reward)
    ends = [samples[i] for i in trajectory_ends(samples)]
    end_rewards = scalar_rewards(ends, reward_key) if len(ends) < len(samples) else rewards
    zero_std = _zero_std_group_ratio(ends, end_rewards)
    if zero_std is not None:
        out["rollout/zero_std_groups"] = zero_std
    if passrate:
        out.update({f"passrate/{k}": v for k, v in pass_at_k(ends, end_rewards).items()})
    out.update(category_shares(samples, reward_category, "error_cat/"))
    return out


def category_shares(samples: list[Sample], key: str | None, prefix: str) -> dict[str, float]:
    """--log-reward-category KEY: ``<prefix><value>``, the share of the samples whose dict reward has that value at
    KEY (as slime logs them); {} without KEY."""
    if key is None or not samples:
        return {}
    cats = [str(s.reward[key]) for s in samples if isinstance(s.reward, dict) and key in s.reward]
    return {f"{prefix}{c}": cats.count(c) / len(samples) for c in dict.fromkeys(cats)}


def multi_turn_metrics(samples: list[Sample]) -> dict[str, float]:
    """``rollout/turns/mean|max`` (model turns per sample), ``rollout/tool_calls`` and ``rollout/tool_errors`` (the
    rollout's), ``rollout/masked_token_share`` (response tokens with loss mask 0); {} when no sample has turns."""
    if not any(s.metadata.get("turns") for s in samples):
        return {}
    model = [sum(1 for t in turns(s) if t["source"] == "model") for s in samples]
    response = sum(s.response_length for s in samples)
    masked = sum(s.response_length - sum(s.loss_mask) if s.loss_mask is not None else 0 for s in samples)
    return {"rollout/turns/mean": _mean(model), "rollout/turns/max": float(max(model)),
            "rollout/tool_calls": float(sum(s.metadata.get("tool_calls", 0) for s in samples)),
            "rollout/tool_errors": float(sum(s.metadata.get("tool_errors", 0) for s in samples)),
            "rollout/masked_token_share": masked / response if response else 0.0}


def eval_metrics(name: str, samples: list[Sample], reward_key: str | None = None,
                 passrate: bool = False, reward_category: str | None = None) -> dict[str, float]:
    """``eval/<name>`` (mean reward), ``eval/<name>/response_len/mean`` (loss-masked tokens, as slime),
    ``eval/<name>/truncated_ratio`` and ``eval/<name>/aborted_ratio``; with ``passrate`` (--log-passrate)
    ``eval/<name>-pass@k`` over the prompts' groups of --n-samples-per-eval-prompt. The mean reward and pass@k count
    each trajectory once, by its end (a split trajectory's parts are not attempts), and one without a reward (ABORTED:
    e.g. SGLang refuses an input past its context) as 0."""
    if not samples:
        return {}
    ends = [samples[i] for i in trajectory_ends(samples)]
    by_position = scalar_rewards(ends, reward_key)
    out: dict[str, float] = {}
    if passrate:
        out.update({f"eval/{name}-{k}": v for k, v in pass_at_k(ends, by_position).items()})
    out[f"eval/{name}"] = _mean([by_position.get(i, 0.0) for i in range(len(ends))])
    out[f"eval/{name}/response_len/mean"] = _mean([s.effective_response_length for s in samples])
    out[f"eval/{name}/truncated_ratio"] = _mean([s.status == Status.TRUNCATED for s in samples])
    out[f"eval/{name}/aborted_ratio"] = _mean([s.status == Status.ABORTED for s in samples])
    out.update(category_shares(samples, reward_category, f"eval/{name}/error_cat/"))
    return out
