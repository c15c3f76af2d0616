"""The scripts' check of a multi-turn dump: inserted (tool) tokens are counted only while every one of them is at
loss_mask 0; a sample whose tool turn has a trained token is named."""

from __future__ import annotations

import pytest

from slime_lite.rollout.turns import RESTARTED, append_turn, inserted_and_trained, restart
from slime_lite.types import TOKEN_VERSIONS, Sample, Status


def _sample(index: int) -> Sample:
    s = Sample(index=index, prompt="1+1=", tokens=[5, 6, 7, 8])
    append_turn(s, [9, 10, 11], [-0.1, -0.2, -0.3])
    append_turn(s, [12, 13], source="tool", trainable=True)  # an inserted turn is never trained
    append_turn(s, [14], [-0.5])
    return s


def test_inserted_tokens_at_mask_0_are_counted_and_a_trained_one_is_named():
    samples = [_sample(0), _sample(1)]
    assert inserted_and_trained(samples) == (4, 8)
    samples[1].loss_mask[3] = 1  # the tool turn's first token, trained as if the model wrote it
    with pytest.raises(ValueError, match=r"sample 1: its tool turn at 3 has loss_mask 1"):
        inserted_and_trained(samples)


def test_turns_keep_one_weight_version_per_token_until_a_model_turn_has_none():
    s = Sample(index=0, prompt="1+1=", tokens=[5, 6])
    append_turn(s, [9, 10], [-0.1, -0.2], versions=[3, 4])  # a request across a push: two versions
    append_turn(s, [12, 13, 14], source="tool")  # inserted: the version of the turn before
    append_turn(s, [15], [-0.5], versions=[4])
    assert s.metadata[TOKEN_VERSIONS] == [3, 4, 4, 4, 4, 4] and len(s.metadata[TOKEN_VERSIONS]) == s.response_length
    append_turn(s, [16], [-0.5])  # no version reported: unknown from here (the rollout stamps the last request's)
    assert TOKEN_VERSIONS not in s.metadata
    append_turn(s, [17], [-0.5], versions=[5])  # never half a list
    assert TOKEN_VERSIONS not in s.metadata


def test_an_opening_inserted_turn_takes_the_first_model_turns_version():
    """An environment's observation before the first model turn has no version yet: it takes the first model
    turn's, and the per-token versions are kept (--max-weight-staleness can mask the old turn)."""
    from slime_lite.rollout.fully_async import apply_staleness
    from slime_lite.rollout.oversample import stamp_versions

    s = Sample(index=0, prompt="p", tokens=[1, 2], status=Status.COMPLETED, reward=1.0)
    append_turn(s, [7, 7], source="env")
    append_turn(s, [8], source="env")
    assert TOKEN_VERSIONS not in s.metadata
    append_turn(s, [10, 11, 12], [-0.1] * 3, versions=[1, 1, 1])
    append_turn(s, [8], source="tool")
    append_turn(s, [13, 14], [-0.1] * 2, versions=[3, 3])
    assert s.metadata[TOKEN_VERSIONS] == [1, 1, 1, 1, 1, 1, 1, 3, 3]
    s.weight_versions = ["1", "3"]
    stamp_versions(s)
    assert s.metadata[TOKEN_VERSIONS] == [1, 1, 1, 1, 1, 1, 1, 3, 3]
    _, stats = apply_staleness([[s]], trainer_version=3, max_staleness=1, mode="mask")
    assert stats["rollout/async/masked_tokens"] == 3 and s.loss_mask == [0] * 7 + [1, 1]
    restart(s)
    assert TOKEN_VERSIONS not in s.metadata and "age_masked_positions" not in s.metadata


def test_restart_takes_a_carried_sample_back_to_its_prompt_and_counts_the_tokens():
    s = _sample(0)
    s.weight_versions, s.status, s.metadata[TOKEN_VERSIONS] = ["1"], Status.ABORTED, [1] * s.response_length
    assert restart(s) == 6
    assert (s.tokens, s.response, s.response_length, s.loss_mask, s.rollout_log_probs) == ([5, 6, 7, 8], "", 0,
                                                                                          None, None)
    assert s.status is Status.PENDING and s.weight_versions == [] and s.metadata[RESTARTED] == 6
    assert "turns" not in s.metadata and TOKEN_VERSIONS not in s.metadata
    append_turn(s, [9], [-0.1], versions=[2])  # grows again from the prompt
    assert s.tokens == [5, 6, 7, 8, 9] and s.metadata[TOKEN_VERSIONS] == [2]
