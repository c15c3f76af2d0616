"""Sample.scalar_reward: the one number the trainer and the metrics use, with errors that say what to pass."""

from __future__ import annotations

import pytest

from slime_lite.types import RewardError, Sample


def test_scalar_reward_reads_numbers_and_dicts_at_the_reward_key() -> None:
    assert Sample(reward=1).scalar_reward() == 1.0
    assert Sample(reward={"acc": 1.0, "fmt": 0.0}).scalar_reward("fmt") == 0.0


@pytest.mark.parametrize("reward, key, needle", [
    ({"acc": 1.0}, None, "--reward-key"),
    ({"acc": 1.0}, "nope", "'nope'.*acc"),
    (None, None, "has no reward"),
    ("good", None, "not a number"),
])
def test_a_reward_that_is_not_one_number_is_a_reward_error(reward, key, needle) -> None:
    with pytest.raises(RewardError, match=needle):
        Sample(index=3, reward=reward).scalar_reward(key)
