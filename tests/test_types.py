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


# slime's Sample fields in its order (slime/utils/types.py at the commit of tests/data/slime_scripts.json)
SLIME_FIELDS = ["group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs",
                "multimodal_train_inputs", "multimodal_train_input_id", "apply_chat_template_kwargs", "response",
                "response_length", "label", "reward", "loss_mask", "weight_versions", "rollout_log_probs",
                "rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_routed_experts", "remove_sample",
                "teacher_log_probs", "status", "metadata", "generate_function_path", "custom_rm_path",
                "train_metadata", "session_id", "non_generation_time", "spec_info", "prefix_cache_info"]


def test_sample_has_slimes_fields_in_slimes_order_and_its_methods() -> None:
    import dataclasses

    assert [f.name for f in dataclasses.fields(Sample)] == SLIME_FIELDS
    s = Sample(tokens=[1, 2])
    s.append_response_tokens(tokens=[3, 4], log_probs=[-1.0, -2.0], meta_info={
        "finish_reason": {"type": "length"}, "cached_tokens": 1, "prompt_tokens": 2, "weight_version": "7"})
    s.append_response_tokens(tokens=[9], trainable=False)  # a tool's tokens: masked out, log-prob 0
    assert s.status is Sample.Status.TRUNCATED and s.weight_versions == ["7"]
    assert s.loss_mask == [1, 1, 0] and s.rollout_log_probs == [-1.0, -2.0, 0.0] and s.effective_response_length == 2
    assert s.prefix_cache_info.prefix_cache_hit_rate == 0.5 and Sample.SpecInfo().spec_accept_rate == 0.0
    with pytest.raises(ValueError, match="require rollout log probabilities"):
        s.append_response_tokens(tokens=[5])
    assert Sample.from_dict(s.to_dict()) == s
