from __future__ import annotations

import pytest

from slime_lite.errors import SlimeLiteError
from slime_lite.rollout.stats import eval_metrics, rollout_metrics
from slime_lite.types import Sample, Status


def _s(group: int, index: int, reward, length: int, status=Status.COMPLETED, lps=None, mask=None) -> Sample:
    return Sample(group_index=group, index=index, tokens=[1, 2] + [3] * length, response_length=length,
                  reward=reward, status=status, rollout_log_probs=lps, loss_mask=mask)


def test_rollout_metrics_names_and_values() -> None:
    samples = [
        _s(0, 0, 1.0, 2, lps=[-1.0, -3.0]),
        _s(0, 1, 1.0, 4, status=Status.TRUNCATED, lps=[-1.0, -1.0, -1.0, -1.0]),
        _s(1, 2, 0.0, 3, lps=[-2.0, -9.0, -2.0], mask=[1, 0, 1]),  # the masked token is not counted
        _s(1, 3, 1.0, 1, status=Status.ABORTED, lps=[-0.5]),
    ]
    m = rollout_metrics(samples)
    assert m["rollout/raw_reward"] == pytest.approx(0.75)
    assert m["rollout/rewards"] == pytest.approx(0.75)  # no group normalisation: the raw rewards
    assert m["rollout/response_len/mean"] == pytest.approx(2.25)  # loss-masked tokens (2 of sample 2's 3)
    assert m["rollout/response_len/max"] == 4 and m["rollout/response_len/min"] == 1
    assert m["rollout/truncated_ratio"] == pytest.approx(0.25)
    assert m["rollout/aborted_ratio"] == pytest.approx(0.25)
    # per-sample means -2, -1, -2, -0.5 averaged
    assert m["rollout/rollout_log_probs"] == pytest.approx(-1.375)
    # group 0 rewards (1, 1) carry no signal; group 1 (0, 1) does
    assert m["rollout/zero_std_groups"] == pytest.approx(0.5)


def test_dict_rewards_need_a_reward_key() -> None:
    samples = [_s(0, 0, {"acc": 1.0, "fmt": 0.0}, 1), _s(0, 1, {"acc": 0.0, "fmt": 1.0}, 1)]
    assert rollout_metrics(samples, reward_key="fmt")["rollout/raw_reward"] == pytest.approx(0.5)
    with pytest.raises(SlimeLiteError, match="--reward-key"):
        rollout_metrics(samples)
    with pytest.raises(SlimeLiteError, match="'nope'.*acc"):
        rollout_metrics(samples, reward_key="nope")


def test_samples_without_reward_are_left_out_of_the_mean() -> None:
    m = rollout_metrics([_s(0, 0, None, 1), _s(0, 1, 2.0, 1)])
    assert m["rollout/raw_reward"] == 2.0
    assert "rollout/raw_reward" not in rollout_metrics([_s(0, 0, None, 1)])
    assert "rollout/rollout_log_probs" not in rollout_metrics([_s(0, 0, 1.0, 1)])
    assert rollout_metrics([]) == {}


def test_eval_metrics() -> None:
    m = eval_metrics("gsm8k", [_s(0, 0, 1.0, 2), _s(1, 1, 0.0, 4, status=Status.TRUNCATED)])
    assert m == {"eval/gsm8k": 0.5, "eval/gsm8k/response_len/mean": 3.0, "eval/gsm8k/truncated_ratio": 0.5,
                 "eval/gsm8k/aborted_ratio": 0.0}


def test_an_eval_sample_without_a_reward_counts_as_a_wrong_answer_in_every_eval_metric() -> None:
    """An eval sample the engine aborted (SGLang does for an input past its context) has no reward: it counts 0 in
    ``eval/<name>`` as in pass@k (not left out of the mean), and ``eval/<name>/aborted_ratio`` shows how many."""
    samples = [_s(0, 0, 0.0, 1), _s(0, 1, 0.0, 1), _s(1, 2, None, 0, status=Status.ABORTED),
               _s(1, 3, None, 0, status=Status.ABORTED), _s(2, 4, 1.0, 1), _s(2, 5, 1.0, 1)]
    m = eval_metrics("ev", samples, passrate=True)
    assert m["eval/ev"] == pytest.approx(1 / 3) and m["eval/ev-pass@1"] == pytest.approx(1 / 3)
    assert m["eval/ev/aborted_ratio"] == pytest.approx(1 / 3)
    assert eval_metrics("ev", samples[2:4])["eval/ev"] == 0.0  # all aborted: 0, not missing


def test_eval_metrics_count_a_split_trajectory_once_by_its_end() -> None:
    """A trajectory split into several samples (an agent, a generate hook returning a list) is one attempt, scored
    by its end, in ``eval/<name>`` and pass@k, as ``rollout_metrics`` counts it: prompt 0's trajectories [1, 0] (the
    first split in three, its two earlier parts scored 0), prompt 1's [1, 1]."""
    from slime_lite.types import TRAJECTORY_END

    samples = [_s(0, i, r, 1) for i, r in enumerate((0.0, 0.0, 1.0, 0.0))] + [_s(1, 4, 1.0, 1), _s(1, 5, 1.0, 1)]
    for s in samples[:3]:
        s.rollout_id = 0
    samples[2].metadata[TRAJECTORY_END] = True
    m = eval_metrics("ev", samples, passrate=True)
    assert m["eval/ev"] == pytest.approx(0.75)
    assert m["eval/ev-pass@1"] == pytest.approx(0.75) and m["eval/ev-pass@2"] == pytest.approx(1.0)


def test_response_lengths_count_the_loss_masked_tokens_as_slime() -> None:
    """slime's ``response_len/*`` (rollout and eval) are over ``effective_response_length`` = sum(loss_mask): a
    multi-turn sample's tool tokens (loss mask 0) are not counted; ``rollout/masked_token_share`` shows them."""
    s = _s(0, 0, 1.0, 45, mask=[1] * 10 + [0] * 30 + [1] * 5)
    m = rollout_metrics([s])
    assert m["rollout/response_len/mean"] == m["rollout/response_len/max"] == m["rollout/response_len/min"] == 15
    assert eval_metrics("ev", [s])["eval/ev/response_len/mean"] == 15


def test_rollout_rewards_are_the_group_centred_rewards_as_slime_logs_them() -> None:
    from slime_lite.args import parser_defaults
    from slime_lite.rollout.stats import _group_centred, groups_rewards

    samples = [_s(0, 0, 1.0, 2), _s(0, 1, 0.0, 2), _s(0, 2, 0.0, 2), _s(1, 3, 0.5, 2), _s(1, 4, 0.5, 2),
               _s(2, 5, None, 2)]  # a sample without a reward is left out
    assert _group_centred(samples, {i: s.reward for i, s in enumerate(samples) if s.reward is not None}) == \
        pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0])
    for estimator, grouped in [("grpo", True), ("reinforce_plus_plus_baseline", True), ("ppo", False),
                               ("reinforce_plus_plus", False)]:
        assert groups_rewards(parser_defaults(advantage_estimator=estimator)) == grouped
        m = rollout_metrics(samples, grouped=grouped)
        assert m["rollout/raw_reward"] == pytest.approx(0.4)
        assert m["rollout/rewards"] == pytest.approx(0.0 if grouped else 0.4, abs=1e-9)


def test_pass_at_k_is_the_unbiased_estimate_per_group_and_logged_under_slimes_names():
    """--log-passrate: per group of n samples with c rewards of 1, 1 - C(n-c, k) / C(n, k), averaged over the
    groups, for k = 1, 2, 4 up to the group size; a sample without a reward or with 0.5 fails."""
    from math import comb

    from slime_lite.rollout.stats import eval_metrics, pass_at_k, rollout_metrics

    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, None], [0.0] * 4]
    samples = [Sample(group_index=g, index=4 * g + i, reward=r, response_length=1)
               for g, group in enumerate(rewards) for i, r in enumerate(group)]
    want = {f"pass@{k}": (1 - comb(3, k) / comb(4, k) + 1 - comb(2, k) / comb(4, k) + 0) / 3 for k in (1, 2, 4)}
    assert want["pass@1"] == (1 / 4 + 2 / 4) / 3 and want["pass@4"] == 2 / 3
    got = rollout_metrics(samples, passrate=True)
    assert {k: got[f"passrate/{k}"] for k in want} == pytest.approx(want)
    assert not any(k.startswith("passrate/") for k in rollout_metrics(samples))  # off without the flag
    got = eval_metrics("gsm8k", samples, passrate=True)
    assert {k: got[f"eval/gsm8k-{k}"] for k in want} == pytest.approx(want)
    assert pass_at_k(samples[:4] + [Sample(group_index=9, reward=1.0)], {0: 1.0, 4: 1.0}) == {}  # a group of one
    assert pass_at_k([Sample(reward=1.0), Sample(reward=0.0)], {0: 1.0, 1: 0.0}) == {}  # no groups


def test_reward_category_shares_count_the_dict_rewards_values():
    """--log-reward-category KEY: error_cat/<value> = the share of the rollout's samples whose reward[KEY] is it."""
    from slime_lite.rollout.stats import rollout_metrics

    rewards = [{"score": 0.0, "why": "no_answer"}, {"score": 0.0, "why": "wrong"}, {"score": 1.0, "why": "ok"},
               {"score": 0.0, "why": "wrong"}]
    samples = [Sample(index=i, reward=r, response_length=1) for i, r in enumerate(rewards)]
    got = rollout_metrics(samples, "score", reward_category="why")
    assert {k: v for k, v in got.items() if k.startswith("error_cat/")} == {
        "error_cat/no_answer": 0.25, "error_cat/wrong": 0.5, "error_cat/ok": 0.25}
    assert not any(k.startswith("error_cat/") for k in rollout_metrics(samples, "score"))
    got = eval_metrics("gsm8k", samples, "score", reward_category="why")  # eval sets too, as slime
    assert got["eval/gsm8k/error_cat/wrong"] == 0.5 and got["eval/gsm8k/error_cat/ok"] == 0.25


def test_group_metrics_and_the_std_filter_count_a_split_trajectory_once_by_its_end() -> None:
    """Two trajectories, both solved, each split into a part scored 0 and an end scored 1: the group has no GRPO
    signal (zero-std, dropped by the built-in filter) and pass@1 is 1 over two trajectories, not 0.5 over four
    samples; an end marked earlier than the last part (an agent's later side call) is the one read."""
    from types import SimpleNamespace

    from slime_lite.rollout.filters import check_reward_nonzero_std
    from slime_lite.types import TRAJECTORY_END

    samples = [_s(0, i, reward, 1) for i, reward in enumerate((0.0, 1.0, 0.0, 1.0))]
    samples[0].rollout_id = samples[1].rollout_id = 0
    samples[2].rollout_id = samples[3].rollout_id = 2
    m = rollout_metrics(samples, passrate=True)
    assert m["rollout/zero_std_groups"] == 1.0 and m["passrate/pass@1"] == 1.0 and "passrate/pass@4" not in m
    assert m["rollout/raw_reward"] == 0.5  # per sample, as before
    assert not check_reward_nonzero_std(SimpleNamespace(reward_key=None), samples)
    samples[2].metadata[TRAJECTORY_END] = True  # the second trajectory ended in its part scored 0
    m = rollout_metrics(samples, passrate=True)
    assert m["rollout/zero_std_groups"] == 0.0 and m["passrate/pass@1"] == 0.5
    assert check_reward_nonzero_std(SimpleNamespace(reward_key=None), samples)
