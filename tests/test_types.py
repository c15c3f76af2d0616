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


def test_a_later_calls_routes_from_a_start_row_extend_the_table_by_rows():
    """slime's ``append_response_tokens(meta_info=...)`` with SGLang's ``routed_experts_start_len``: the rows before
    the start are kept as rows of [layers, top_k] (the built-in paths store the table flat; slicing it flat mixed
    numbers and rows), and a start past the rows the sample holds is refused naming the gap (the rows landed too
    early, misaligned with their tokens)."""
    import base64
    from types import SimpleNamespace

    import torch

    from slime_lite.rollout.turns import routed_experts

    layers, top_k = 2, 2
    args = SimpleNamespace(num_layers=layers, moe_router_topk=top_k)

    def table(rows: int, first: int = 0) -> str:
        ids = torch.arange(first, first + rows * layers * top_k, dtype=torch.int32)
        return base64.b64encode(ids.numpy().tobytes()).decode()

    s = Sample(index=0, tokens=[1, 2, 3], response_length=0)
    s.append_response_tokens(args, tokens=[4, 5], log_probs=[0.0, 0.0], meta_info={})
    s.rollout_routed_experts = routed_experts(table(4))  # as fill_response stores it: flat
    s.append_response_tokens(args, tokens=[6, 7], log_probs=[0.0, 0.0],
                             meta_info={"routed_experts": table(2, first=100), "routed_experts_start_len": 4})
    got = torch.as_tensor(s.rollout_routed_experts)
    assert got.shape == (6, layers, top_k) and got[3, 1].tolist() == [14, 15] and got[4, 0].tolist() == [100, 101]
    s = Sample(index=1, tokens=[1, 2, 3], response_length=0)
    s.append_response_tokens(args, tokens=[4, 5], log_probs=[0.0, 0.0], meta_info={"routed_experts": table(4)})
    s.append_response_tokens(args, tokens=[8, 9, 10], trainable=False)  # a tool turn: no routes for it
    with pytest.raises(ValueError, match="starts at row 8 .* holds 4 rows"):
        s.append_response_tokens(args, tokens=[6, 7], log_probs=[0.0, 0.0],
                                 meta_info={"routed_experts": table(1), "routed_experts_start_len": 8})
