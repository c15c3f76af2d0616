"""Built-in dynamic-sampling filters (``--dynamic-sampling-filter-path``), slime's ``keep(args, samples)`` shape."""

from __future__ import annotations

from typing import Any

from slime_lite.rollout.stats import scalar_rewards
from slime_lite.types import Sample, trajectory_ends


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> bool:
    """Keep a prompt group only when its rewards disagree (a group whose rewards all agree has zero advantage; so
    has one with fewer than two rewards, e.g. every sample failed). A trajectory split into several samples counts
    once, by its end's reward (as the estimator scores it)."""
    rewards = list(scalar_rewards([samples[i] for i in trajectory_ends(samples)], args.reward_key).values())
    return len(rewards) > 1 and max(rewards) - min(rewards) > 1e-8
