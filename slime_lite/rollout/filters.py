"""Dynamic-sampling filters (``--dynamic-sampling-filter-path``): the built-in ones, slime's ``keep(args, samples)``
shape, and how a filter's answer is read (slime's ``DynamicFilterOutput`` rule)."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from slime_lite.rollout.stats import scalar_rewards
from slime_lite.types import Sample, trajectory_ends


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> bool:
    """Keep a prompt group only when its rewards disagree (a group whose rewards all agree has zero advantage; so
    has one with fewer than two rewards, e.g. every sample failed). A trajectory split into several samples counts
    once, by its end's reward (as the estimator scores it)."""
    rewards = list(scalar_rewards([samples[i] for i in trajectory_ends(samples)], args.reward_key).values())
    return len(rewards) > 1 and max(rewards) - min(rewards) > 1e-8


@dataclass(frozen=True)
class FilterVerdict:
    """A dynamic-sampling filter's answer on a group, as slime's ``DynamicFilterOutput``: ``keep``, the ``reason``
    it was not kept (counted as ``rollout/dynamic_filter/drop_<reason>``) and ``keep_when_insufficient``."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False

    def drops(self, remaining: int, target: int) -> bool:
        """slime's rule: a group not kept is dropped, unless it asks to be kept when insufficient and ``remaining``
        (the groups submitted and not dropped: kept or still generating, this one included) is at most ``target``
        (dropping it would leave the batch short and start another round)."""
        return not self.keep and not (self.keep_when_insufficient and remaining <= target)


def filter_verdict(filter_fn: Callable[..., Any]) -> Callable[..., FilterVerdict]:
    """A dynamic-sampling filter's answer as a FilterVerdict: slime's filters return ``DynamicFilterOutput(keep=...,
    reason=..., keep_when_insufficient=...)`` (an object that is always true); a plain bool (or a one-element tensor)
    is ``keep``."""

    @functools.wraps(filter_fn)
    def verdict(args: Any, samples: list[Sample], **kwargs: Any) -> FilterVerdict:
        out = filter_fn(args, samples, **kwargs)
        if not hasattr(out, "keep"):
            return FilterVerdict(bool(out))
        reason = getattr(out, "reason", None)
        return FilterVerdict(bool(out.keep), None if reason is None else str(reason),
                             bool(getattr(out, "keep_when_insufficient", False)))

    return verdict


def drop_reasons(reasons: Counter[str | None]) -> dict[str, float]:
    """``rollout/dynamic_filter/drop_<reason>``: the groups dropped for each reason a filter gave (slime's names)."""
    return {f"rollout/dynamic_filter/drop_{r}": float(n) for r, n in reasons.items() if r}
