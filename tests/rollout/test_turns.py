"""The scripts' check of a multi-turn dump: inserted (tool) tokens are counted only while every one of them is at
loss_mask 0; a sample whose tool turn has a trained token is named."""

from __future__ import annotations

import pytest

from slime_lite.rollout.turns import append_turn, inserted_and_trained
from slime_lite.types import Sample


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
