"""slime's DynamicFilterOutput read in full (keep, reason, keep_when_insufficient) and what the --deterministic-mode
waves count, through the real Generator against the FAKE engine of test_oversample.py (its answers never match the
label: every group's rewards agree)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from slime_lite.rollout.filters import FilterVerdict
from slime_lite.rollout.oversample import GENERATED_TOKENS
from tests.rollout.test_oversample import make, rollout, tokenizer  # noqa: F401 - the fixture


@dataclass
class DynamicFilterOutput:  # slime's (slime/rollout/filter_hub/base_types.py), without importing slime
    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def zero_std_with_fallback(args, samples) -> DynamicFilterOutput:  # slime's check_reward_nonzero_std_with_fallback
    rewards = [s.reward for s in samples]
    keep = max(rewards) - min(rewards) > 1e-6
    return DynamicFilterOutput(keep, None if keep else f"zero_std_{round(rewards[0], 1)}", keep_when_insufficient=True)


def even_dropped(args, samples) -> DynamicFilterOutput:  # no fallback: a dropped group is replaced
    keep = samples[0].metadata["prompt_index"] % 2 == 1
    return DynamicFilterOutput(keep, None if keep else "even")


def test_slimes_rule_for_a_group_not_kept() -> None:
    """Dropped, unless keep_when_insufficient and the groups not dropped (this one included) are at most the target."""
    assert not FilterVerdict(True).drops(9, 2) and FilterVerdict(False).drops(1, 2)
    assert FilterVerdict(False, keep_when_insufficient=True).drops(3, 2)
    assert not FilterVerdict(False, keep_when_insufficient=True).drops(2, 2)


@pytest.mark.parametrize("deterministic", [False, True])
def test_keep_when_insufficient_keeps_rejected_groups_instead_of_another_round(tokenizer, tiny_model_dir,
                                                                               deterministic) -> None:
    """4 groups generated for a batch of 2, every one rejected (zero std) but asking to be kept when insufficient:
    two are dropped (counted by reason, as slime names it), the other two kept, no more prompts used; over-sampling
    and the deterministic waves alike."""
    gen, source, _ = make(tokenizer, tiny_model_dir, "s" * 8, deterministic_mode=deterministic,
                          dynamic_sampling_filter_path="tests.rollout.test_dynamic_filter.zero_std_with_fallback")
    samples, stats = rollout(gen, source, 0)
    assert len(samples) == 4 and source.state() == {"epoch": 0, "offset": 4}
    assert stats["rollout/dynamic_filter/dropped_groups"] == 2.0
    assert stats["rollout/dynamic_filter/drop_zero_std_0.0"] == 2.0


@pytest.mark.parametrize("deterministic", [False, True])
def test_groups_dropped_are_counted_by_the_filters_reason(tokenizer, tiny_model_dir, deterministic) -> None:
    gen, source, _ = make(tokenizer, tiny_model_dir, "s" * 16, rollout_batch_size=3, deterministic_mode=deterministic,
                          dynamic_sampling_filter_path="tests.rollout.test_dynamic_filter.even_dropped")
    samples, stats = rollout(gen, source, 0)
    assert len(samples) == 6 and all(s.metadata["prompt_index"] % 2 for s in samples)
    assert stats["rollout/dynamic_filter/drop_even"] == stats["rollout/dynamic_filter/dropped_groups"] >= 2


def test_deterministic_waves_count_the_tokens_and_groups_they_generated_but_did_not_keep(tokenizer,
                                                                                        tiny_model_dir) -> None:
    """A wave of 4 groups for a batch of 2: perf/rollout_tokens_per_s counts all 4 groups' tokens (what the engine
    generated), and the 2 finished groups not kept are logged as the over-sampler logs them."""
    gen, source, engine = make(tokenizer, tiny_model_dir, "s" * 8, deterministic_mode=True)
    samples, stats = rollout(gen, source, 0)
    generated = sum(n for _, n, _ in engine.log)
    assert len(samples) == 4 and len(gen.all_groups) == 4 and generated == 32
    assert stats[GENERATED_TOKENS] == generated
    assert stats["rollout/over_sampling/submitted_groups"] == 4.0
    assert stats["rollout/over_sampling/tokens_wasted"] == generated - sum(s.response_length for s in samples)
