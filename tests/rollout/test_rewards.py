"""Rewards: built-in --rm-type addition/math, --custom-rm-path hooks (async and plain), dict rewards, errors."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from slime_lite.args import parser_defaults
from slime_lite.errors import SlimeLiteError
from slime_lite.rollout.rewards import (
    RM_TYPES,
    compute_reward,
    extract_final_answer,
)
from slime_lite.rollout.stats import scalar_rewards
from slime_lite.types import Sample


def score(args, samples: list[Sample]) -> list[float]:
    """As the generator scores a group: every reward at once, stored on its sample; then the scalars."""
    async def all_rewards():
        return await asyncio.gather(*(compute_reward(args, s) for s in samples))

    for sample, value in zip(samples, asyncio.run(all_rewards())):
        sample.reward = value
    return list(scalar_rewards(samples, args.reward_key).values())


def reward(args, response: str, label: str | None) -> float | dict:
    return asyncio.run(compute_reward(args, Sample(index=0, response=response, label=label)))


@pytest.mark.parametrize(
    ("response", "expected"),
    [("85", 1.0), ("85<|endoftext|>", 1.0), (" 85\n", 1.0), ("86", 0.0), ("850", 0.0), ("8 5", 0.0), ("", 0.0),
     ("85 apples", 0.0)],
)
def test_addition_is_exact_match_after_stripping_eos_and_whitespace(response, expected):
    assert reward(parser_defaults(rm_type="addition"), response, "85") == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("51", "51", 1.0),
        ("7*8 = 56, minus 5 is 51", "51", 1.0),
        ("so the answer is \\boxed{51}.", "51", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("first 12 then\n#### 1,024", "1024", 1.0),
        ("-15<|endoftext|>", "-15", 1.0),
        ("51.0", "51", 1.0),
        ("the answer is 52", "51", 0.0),
        ("\\boxed{50} but maybe 51", "51", 0.0),  # the boxed answer wins over a later number
        ("no number here", "51", 0.0),
    ],
)
def test_math_compares_the_final_answer_numerically(response, label, expected):
    assert reward(parser_defaults(rm_type="math"), response, label) == expected


@pytest.mark.parametrize("rm_type", ["math", "boxed_math"])
@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("\\boxed{-\\frac{1}{2}}", "-1/2", 1.0),  # the sign in front of the fraction
        ("\\boxed{-\\dfrac{1}{2}}", "-0.5", 1.0),
        ("\\boxed{\\frac12}", "0.5", 1.0),  # LaTeX's one-digit shorthand
        ("\\boxed{$5$}", "5", 1.0),
        ("\\boxed{10\\%}", "10", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{\u22123}", "-3", 1.0),  # a Unicode minus sign
        ("\\boxed{1,000,000}", "1000000", 1.0),
        ("\\boxed{-\\frac{1}{2}}", "1/2", 0.0),
        ("\\boxed{3,4}", "34", 0.0),  # two numbers, not thirty-four
        ("\\boxed{34}", "3,4", 0.0),
    ],
)
def test_math_reads_plausible_forms_of_a_number(rm_type, response, label, expected):
    assert reward(parser_defaults(rm_type=rm_type), response, label) == expected


def test_math_extracts_nested_boxed():
    assert extract_final_answer("x \\boxed{\\frac{3}{4}} y") == "\\frac{3}{4}"


def test_unknown_rm_type_names_the_flag_and_choices():
    with pytest.raises(SlimeLiteError, match="--rm-type") as exc:
        reward(parser_defaults(rm_type="f1"), "1", "1")
    assert all(name in str(exc.value) for name in RM_TYPES)


def test_missing_label_names_label_key():
    with pytest.raises(SlimeLiteError, match="--label-key"):
        reward(parser_defaults(rm_type="addition"), "1", None)


def _write_rm(tmp_path, monkeypatch, body: str) -> str:
    name = f"my_rm_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}.rm"


def test_custom_async_rm_gets_args_and_sample(tmp_path, monkeypatch):
    path = _write_rm(tmp_path, monkeypatch, (
        "async def rm(args, sample, **kwargs):\n"
        "    return float(len(sample.response)) + args.bonus\n"
    ))
    args = parser_defaults(custom_rm_path=path, rm_type=None)
    args.bonus = 0.5  # a flag of the user's own, read by the hook
    assert reward(args, "abcd", "x") == 4.5


def test_custom_plain_def_rm_works_too(tmp_path, monkeypatch):
    path = _write_rm(tmp_path, monkeypatch, "def rm(args, sample, **kwargs):\n    return sample.response == sample.label\n")
    args = parser_defaults(custom_rm_path=path)
    assert reward(args, "yes", "yes") == 1.0
    assert reward(args, "no", "yes") == 0.0


def test_custom_rm_overrides_rm_type(tmp_path, monkeypatch):
    path = _write_rm(tmp_path, monkeypatch, "def rm(args, sample, **kwargs):\n    return -1.0\n")
    assert reward(parser_defaults(custom_rm_path=path, rm_type="addition"), "85", "85") == -1.0


def test_custom_rm_returning_junk_is_a_clear_error(tmp_path, monkeypatch):
    path = _write_rm(tmp_path, monkeypatch, "def rm(args, sample, **kwargs):\n    return 'good'\n")
    with pytest.raises(SlimeLiteError, match="--custom-rm-path"):
        reward(parser_defaults(custom_rm_path=path), "a", "a")


def test_custom_rm_that_cannot_be_imported_names_the_flag():
    with pytest.raises(SlimeLiteError, match="--custom-rm-path"):
        reward(parser_defaults(custom_rm_path="no_such_module_xyz.rm"), "a", "a")


def test_batched_rewards_store_dict_and_return_reward_key(tmp_path, monkeypatch):
    path = _write_rm(tmp_path, monkeypatch, (
        "import asyncio\n"
        "async def rm(args, sample, **kwargs):\n"
        "    await asyncio.sleep(0.01)\n"
        "    ok = float(sample.response == sample.label)\n"
        "    return {'score': ok, 'length': len(sample.response)}\n"
    ))
    args = parser_defaults(custom_rm_path=path, reward_key="score")
    samples = [Sample(index=i, response=r, label="12") for i, r in enumerate(["12", "13", "12"])]
    assert score(args, samples) == [1.0, 0.0, 1.0]
    assert samples[1].reward == {"score": 0.0, "length": 2}
    assert samples[0].scalar_reward(args.reward_key) == 1.0


def test_dict_reward_without_reward_key_asks_for_it(tmp_path, monkeypatch):
    path = _write_rm(tmp_path, monkeypatch, "def rm(args, sample, **kwargs):\n    return {'score': 1.0}\n")
    args = parser_defaults(custom_rm_path=path, reward_key=None)
    with pytest.raises(SlimeLiteError, match="--reward-key"):
        score(args, [Sample(index=0, response="a", label="a")])


def test_batched_builtin_rewards_in_order():
    args = parser_defaults(rm_type="addition")
    samples = [Sample(index=i, response=r, label="7") for i, r in enumerate(["7", "8", "7<|endoftext|>"])]
    assert score(args, samples) == [1.0, 0.0, 1.0]
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]


def test_the_nonzero_std_filter_drops_a_group_without_two_rewards():
    """A group whose samples all failed (no reward) has no advantage to give: dropped, not a crash on max([])."""
    from types import SimpleNamespace

    from slime_lite.rollout.filters import check_reward_nonzero_std

    args = SimpleNamespace(reward_key=None)
    assert not check_reward_nonzero_std(args, [Sample(index=0, prompt="p"), Sample(index=1, prompt="p")])
    assert not check_reward_nonzero_std(args, [Sample(index=0, prompt="p", reward=1.0), Sample(index=1, prompt="p")])
    assert check_reward_nonzero_std(args, [Sample(index=0, prompt="p", reward=1.0),
                                           Sample(index=1, prompt="p", reward=0.0)])
