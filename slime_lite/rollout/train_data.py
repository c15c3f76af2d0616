"""What the rollout manager does to a rollout after logging it and before training takes it: the steps of slime's
samples-to-train-data conversion that apply to Samples (slime-lite's trainer takes the Samples themselves), and the
custom log hooks' say over the default logging.

- A sample with ``remove_sample`` set (by ``--rollout-sample-filter-path``, or any hook) trains with loss mask 0;
  its reward still enters the group normalisation, as in slime.
- ``--custom-reward-post-process-path``: ``post_process(args, samples) -> (raw_rewards, rewards)`` over the
  rollout's samples; each sample's reward for the estimator is kept as ``metadata["post_processed_reward"]``
  (the trainer takes it as it is, in place of its group normalisation), and ``rollout/raw_reward`` /
  ``rollout/rewards`` log the means of the two lists.
- Trajectories split into several samples (sharing ``rollout_id``: an agent whose history was rewritten, a
  generate hook returning a list) under a group estimator (GRPO, REINFORCE++-baseline): the groups are normalised
  over their trajectories, each scored by its end's reward (the part that holds its last call), and every sample
  of a trajectory trains on the trajectory's normalised reward (kept as the post-processed reward above).
- ``--custom-rollout-log-function-path`` returning True: the rollout's metrics are left out of the log, but for
  those the driver's checks read (``READ_BY_CHECKS``, the token-drift counts).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from slime_lite import rl_math
from slime_lite.errors import SlimeLiteError
from slime_lite.types import POST_PROCESSED_REWARD, RewardError, Sample, trajectory_ends

FLAG = "--custom-reward-post-process-path"
# the rollout metrics the driver reads back (the --ci-test checks, the async timeline); the drift counts too
READ_BY_CHECKS = ("rollout/weight_version", "rollout/async/newest_lag", "perf/rollout_time")


def mask_removed(samples: list[Sample]) -> None:
    """Loss mask 0 on every sample with ``remove_sample`` set."""
    for s in samples:
        if s.remove_sample:
            s.loss_mask = [0] * s.response_length


def _floats(values: Any, name: str, n: int) -> list[float]:
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise SlimeLiteError(f"{FLAG} returned {name} {values!r:.200}: expected {n} numbers, one per sample.") from None
    if len(out) != n:
        raise SlimeLiteError(f"{FLAG} returned {len(out)} {name} for the rollout's {n} samples: give one per sample, "
                             "in the order of the samples it was given.")
    bad = next((i for i, v in enumerate(out) if not math.isfinite(v)), None)
    if bad is not None:
        raise SlimeLiteError(f"{FLAG} returned {name}[{bad}] = {out[bad]}: every reward must be a finite number.")
    return out


def keep_post_processed(out: Any, samples: list[Sample]) -> dict[str, float]:
    """The hook's answer ``out`` for ``samples``: each sample's reward for the estimator kept in its metadata;
    returns the metrics of the two lists."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise SlimeLiteError(f"{FLAG} returned {type(out).__name__}: expected (raw_rewards, rewards), two lists with "
                             "one number per sample (slime's signature).")
    raw = _floats(out[0], "raw_rewards", len(samples))
    rewards = _floats(out[1], "rewards", len(samples))
    for s, r in zip(samples, rewards):
        s.metadata[POST_PROCESSED_REWARD] = r
    if not samples:
        return {}
    return {"rollout/raw_reward": sum(raw) / len(raw), "rollout/rewards": sum(rewards) / len(rewards)}


def normalize_split_trajectories(samples: list[Sample], group_size: int, estimator: str, std_normalization: bool,
                                 reward_key: str | None) -> dict[str, float]:
    """A group estimator compares a prompt's ``group_size`` trajectories. Where some trajectory was split into
    several samples, each sample's reward for the estimator is its trajectory's reward (its end's:
    ``types.trajectory_ends``) normalised over the group's trajectories, kept as the post-processed reward the
    trainer takes as it is, and the metric ``rollout/samples_per_trajectory`` is returned. Otherwise nothing is
    kept (a kept value left from an earlier pass is dropped): the trainer normalises the groups itself."""
    for s in samples:
        s.metadata.pop(POST_PROCESSED_REWARD, None)
    trajectories: dict[tuple, list[Sample]] = {}
    for s in samples:
        trajectories.setdefault(s.trajectory, []).append(s)
    if not rl_math.estimator(estimator).needs_groups or len(trajectories) == len(samples):
        return {}
    by_group: dict[Any, list[list[Sample]]] = {}
    for key, parts in trajectories.items():
        by_group.setdefault(key[0], []).append(parts)
    wrong = next((g for g, ts in by_group.items() if len(ts) != group_size), None)
    if wrong is not None:  # the manager's group check runs first; this guards other callers
        raise SlimeLiteError(f"rollout group {wrong} has {len(by_group[wrong])} trajectories, --n-samples-per-prompt "
                             f"is {group_size}.")
    ordered = [parts for ts in by_group.values() for parts in ts]
    end = {samples[i].trajectory: samples[i] for i in trajectory_ends(samples)}
    try:
        raw = [end[parts[0].trajectory].scalar_reward(reward_key) for parts in ordered]
    except RewardError as exc:
        raise SlimeLiteError(str(exc)) from None
    normalized = rl_math.group_normalized(estimator, torch.tensor(raw, dtype=torch.float64), group_size,
                                          std_normalization).tolist()
    for parts, r in zip(ordered, normalized):
        for s in parts:
            s.metadata[POST_PROCESSED_REWARD] = r
    return {"rollout/samples_per_trajectory": len(samples) / len(trajectories)}


def checked_only(metrics: dict[str, Any], drift_keys: set[str]) -> dict[str, Any]:
    """What a rollout's record keeps when ``--custom-rollout-log-function-path`` took over its logging."""
    return {k: v for k, v in metrics.items() if k in READ_BY_CHECKS or k in drift_keys}

