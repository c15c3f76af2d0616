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
        ("\\boxed{5}", "\\boxed{5}", 1.0),  # a boxed label is its content (as slime's math and deepscaler)
        ("\\boxed{\\$18}", "18", 1.0),
        ("\\boxed{18 \\text{ dollars}}", "18", 1.0),  # a unit after the number
        ("\\boxed{x^2 + 1}", "x^2+1", 1.0),  # text answers compared without LaTeX's spacing
        ("\\boxed{\\dfrac{\\pi}{2}}", "\\frac{\\pi}{2}", 1.0),
        ("\\boxed{\\left(1,2\\right)}", "(1,2)", 1.0),
        ("\\boxed{1{,}000}", "1000", 1.0),
        ("\\boxed{- 5}", "-5", 1.0),
        ("\\boxed{\\frac {1}{2}}", "1/2", 1.0),
        ("\\boxed{x^2 + 2}", "x^2+1", 0.0),
        ("\\boxed{12", "12", 0.0),  # cut off inside its box: no answer (not the number before it)
    ],
)
def test_math_answers_compare_through_latex_variants(rm_type, response, label, expected):
    assert reward(parser_defaults(rm_type=rm_type), response, label) == expected


def test_math_without_a_box_reads_a_latex_fraction_as_the_last_number():
    assert reward(parser_defaults(rm_type="math"), "The answer is $\\frac{3}{4}$.", "3/4") == 1.0
    assert reward(parser_defaults(rm_type="math"), "3 4", "34") == 0.0  # two numbers are not one


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
        # as slime's normaliser: a whole answer in \text{}, a choice's parentheses, case, a mixed number
        ("\\boxed{\\text{5}}", "5", 1.0),
        ("\\boxed{\\textbf{(C)}}", "C", 1.0),
        ("\\boxed{C}", "\\text{(C)}", 1.0),
        ("\\boxed{monday}", "Monday", 1.0),
        ("\\boxed{\\frac{9}{4}}", "2\\frac{1}{4}", 1.0),
        ("\\boxed{-3\\frac{1}{2}}", "-3.5", 1.0),
        ("\\boxed{\\text{a} or \\text{b}}", "a} or \\text{b", 0.0),  # two \text{}: not one unwrapped
        ("\\boxed{D}", "\\text{(C)}", 0.0),
        ("\\boxed{2\\frac{1}{4}}", "2.5", 0.0),
    ],
)
def test_math_reads_plausible_forms_of_a_number(rm_type, response, label, expected):
    assert reward(parser_defaults(rm_type=rm_type), response, label) == expected


def test_math_extracts_nested_boxed():
    assert extract_final_answer("x \\boxed{\\frac{3}{4}} y") == "\\frac{3}{4}"


def test_unknown_rm_type_names_the_flag_and_choices(capsys):
    with pytest.raises(SlimeLiteError, match="--rm-type") as exc:
        reward(parser_defaults(rm_type="ifbench"), "1", "1")
    assert all(name in str(exc.value) for name in RM_TYPES) and "--custom-rm-path" in str(exc.value)
    from slime_lite.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--rm-type", "ifbench"])
    err = capsys.readouterr().err
    assert "--rm-type: 'ifbench' is not a reward type" in err and "score it with --custom-rm-path" in err
    from slime_lite.args import build_parser

    assert build_parser().parse_args(["--rm-type", "boxed_f1"]).rm_type == "boxed_f1"


@pytest.mark.parametrize(("response", "label", "score", "pred"), [
    ("so the total is 42.\nAnswer: 42", "42", 1.0, "42"),
    ("Answer: 42", "42.0", 1.0, "42"),  # DAPO's labels are integers
    ("Answer: $1,000$ dollars.", "1000", 1.0, "1000"),  # a unit in words after the number
    ("Answer: 1,000 or so, maybe 2", "1000", -1.0, "1,000orso,maybe2"),
    ("Answer: $1{,}000$", "1000", 1.0, "1000"),
    ("Answer: x = \\boxed{7}.", "7", 1.0, "7"),
    ("answer: 3\nwait, Answer: 5", "5", 1.0, "5"),  # the last answer line
    ("the answer is 42", "42", -1.0, None),  # no "Answer:" line
    ("Answer: 41", "42", -1.0, "41"),
    ("Answer: \\$18", "18", 1.0, "18"),  # an escaped dollar sign
    ("Answer: \\boxed{\\$1{,}000}", "1000", 1.0, "1000"),
])
def test_dapo_reads_the_last_answer_line_against_an_integer_label(response, label, score, pred):
    got = reward(parser_defaults(rm_type="dapo", reward_key="score"), response, label)
    assert got == {"score": score, "acc": score > 0, "pred": pred}


def test_dapo_sees_only_the_last_300_characters():
    assert reward(parser_defaults(rm_type="dapo"), "Answer: 42" + " " * 300 + "done", "42")["score"] == -1.0
    assert reward(parser_defaults(rm_type="dapo"), "x" * 500 + "Answer: 42", "42")["score"] == 1.0


@pytest.mark.parametrize(("response", "label", "meta", "expected"), [
    ("The answer is (B).", "B", {}, 1.0),
    ("The answer is (B).", "C", {}, 0.0),
    ("<think>maybe A? The answer is A</think> Answer: C", "C", {}, 1.0),  # after the reasoning only
    ("I pick D", 3, {}, 1.0),  # an integer label: an index into the letters
    ("The answer is B", "1", {"choices": ["x", "y", "z", "w"]}, 1.0),  # digits as text, matching no choice
    ("The answer is B", "2", {"choices": ["1", "2", "3", "4"]}, 1.0),  # digits matching a choice: the choice
    ("The answer is C", 2, {"choices": ["1", "2", "3", "4"]}, 1.0),  # an integer: the index, whatever the texts
    ("The answer is B", 2, {"choices": ["1", "2", "3", "4"]}, 0.0),
    ("Let me check choice D first... no. The answer is (B).", "B", {}, 1.0),  # the letter it concludes with
    ("Let me check choice D first... no. The answer is (B).", "D", {}, 0.0),
    ("Answer: I think so. Answer: C", "C", {"choices": ["a", "b", "c", "d"]}, 1.0),  # I is no choice: C after it
    ("Option B is the one.", "blue", {"choices": ["red", "blue", "green"]}, 1.0),  # the label is a choice's text
    ("It is blue, clearly.", "blue", {"choices": ["red", "blue", "green"]}, 1.0),  # no letter: the choice's text
    ("the answer is a mixture", "A", {}, 0.0),  # a lower-case article is not option A
    ("B is correct", "x", {"correct_letter": "b"}, 1.0),
    ("The answer is E", "E", {"choices": ["1", "2", "3", "4"]}, 0.0),  # E is not among four choices' letters
])
def test_gpqa_reads_the_option_letter_the_answer_picks(response, label, meta, expected):
    sample = Sample(index=0, response=response, label=label, metadata={**meta, "rm_type": "gpqa"})
    assert asyncio.run(compute_reward(parser_defaults(rm_type="math"), sample)) == expected


def test_boxed_prefix_scores_only_the_last_boxed_answer():
    args = parser_defaults(rm_type="boxed_f1")
    assert reward(args, "maybe Lyon... so \\boxed{Paris}", "Paris") == 1.0
    assert reward(args, "Paris", "Paris") == 0.0  # nothing boxed: an empty answer
    assert reward(parser_defaults(rm_type="boxed_addition"), "2+2: \\boxed{4}", "4") == 1.0


def test_rows_with_their_own_rm_type_need_no_flag_and_dapo_needs_a_reward_key():
    from slime_lite.rollout.rewards import check_data_rm_types

    none = parser_defaults()
    check_data_rm_types(none, [{"rm_type": "f1"}, {"rm_type": "math"}], "--prompt-data p.jsonl")
    with pytest.raises(SlimeLiteError, match="prompt 1 has no rm_type field and no --rm-type is given"):
        check_data_rm_types(none, [{"rm_type": "f1"}, {}], "--prompt-data p.jsonl")
    with pytest.raises(SlimeLiteError, match="prompt 0 is scored by dapo.*--reward-key score"):
        check_data_rm_types(none, [{"rm_type": "dapo"}], "--prompt-data p.jsonl")
    check_data_rm_types(parser_defaults(reward_key="score"), [{"rm_type": "dapo"}], "x")
    check_data_rm_types(parser_defaults(eval_reward_key="score"), [{"rm_type": "dapo"}], "x", eval_data=True)
    with pytest.raises(SlimeLiteError, match="dapo"):
        check_data_rm_types(parser_defaults(eval_reward_key="score"), [{"rm_type": "dapo"}], "x")


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


def test_f1_is_the_normalised_word_f1_and_yes_no_answers_match_exactly():
    from slime_lite.rollout.rewards import f1_reward

    assert f1_reward("The Eiffel Tower!", "eiffel tower") == 1.0  # case, punctuation and articles dropped
    assert f1_reward("Paris France", "Paris") == pytest.approx(2 * 0.5 * 1.0 / 1.5)  # precision 1/2, recall 1
    assert f1_reward("yes", "yes it is") == 0.0 and f1_reward("Yes.", "yes") == 1.0
    assert f1_reward("", "Paris") == 0.0 and f1_reward("London", "Paris") == 0.0
    assert reward(parser_defaults(rm_type="f1"), "the tower", "tower") == 1.0


def test_a_rows_rm_type_picks_its_reward_and_a_bad_one_is_refused_before_the_rollout():
    """slime reads a sample's metadata rm_type (a field of a mixed data set) before --rm-type."""
    from slime_lite.rollout.rewards import check_data_rm_types

    args = parser_defaults(rm_type="addition")
    text = Sample(index=0, response="the tower", label="tower", metadata={"rm_type": "f1"})
    number = Sample(index=1, response="so 12", label="12")  # no field: --rm-type addition
    assert score(args, [text, number]) == [1.0, 0.0]
    check_data_rm_types(args, [{"rm_type": "f1"}, {}], "--prompt-data p.jsonl")
    with pytest.raises(SlimeLiteError, match=r"--prompt-data p.jsonl: prompt 1: its rm_type 'gpq' is not a reward"):
        check_data_rm_types(args, [{}, {"rm_type": "gpq"}], "--prompt-data p.jsonl")
    with pytest.raises(SlimeLiteError, match="prompt 0 has rm_type remote_rm: give the reward model's --rm-url"):
        check_data_rm_types(args, [{"rm_type": "remote_rm"}], "--prompt-data p.jsonl")
    check_data_rm_types(parser_defaults(custom_rm_path="m.f"), [{"rm_type": "anything"}], "x")  # the hook's field
    with pytest.raises(SlimeLiteError, match="sample 3: its data's rm_type field 'gpq'"):
        reward_of = Sample(index=3, response="1", label="1", metadata={"rm_type": "gpq"})
        asyncio.run(compute_reward(args, reward_of))
    # a blank field is no type (the row has --rm-type, as in slime); one with spaces around its name is that type
    check_data_rm_types(args, [{"rm_type": ""}, {"rm_type": " f1 "}], "--prompt-data p.jsonl")
    blank, spaced = (Sample(index=i, response="the tower", label="tower", metadata={"rm_type": t})
                     for i, t in ((4, "  "), (5, " f1 ")))
    assert score(args, [blank, spaced]) == [0.0, 1.0]


@pytest.fixture
def reward_server():
    """A local HTTP reward model service (a real server on a port): answers each POST with the next of
    ``answers`` (status, body), recording the bodies it got."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers: list[tuple[int, str]] = []
    got: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            status, body = answers.pop(0) if answers else (200, "1.0")
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score", answers, got
    server.shutdown()
    server.server_close()


def test_remote_rm_posts_the_sample_and_retries_only_what_may_pass(reward_server, monkeypatch):
    from slime_lite.rollout import rewards

    url, answers, got = reward_server
    args = parser_defaults(rm_type="remote_rm", rm_url=url, reward_key="acc")
    sample = Sample(index=4, prompt="1+1=", response="2", label="2")
    answers += [(200, "0.75"), (200, '{"acc": 1, "why": "ok"}'), (503, "busy"), (200, "1")]
    assert asyncio.run(compute_reward(args, sample)) == 0.75
    assert got[0] == {"prompt": "1+1=", "response": "2", "label": "2"}
    assert asyncio.run(compute_reward(args, sample)) == {"acc": 1, "why": "ok"}
    assert asyncio.run(compute_reward(args, sample)) == 1.0 and len(got) == 4  # the 503 was sent again
    answers += [(400, "no label field"), (200, "1")]
    with pytest.raises(SlimeLiteError, match=r"--rm-url .*: sample 4: .*HTTP 400: no label field; 1 attempt"):
        asyncio.run(compute_reward(args, sample))  # a 4xx is the request's fault: not sent again
    assert answers == [(200, "1")]
    answers[:] = [(200, "<html>")]
    with pytest.raises(SlimeLiteError, match="not a JSON number or object: '<html>'"):
        asyncio.run(compute_reward(args, sample))
    monkeypatch.setattr(rewards, "REMOTE_RM_ATTEMPTS", 2)
    closed = parser_defaults(rm_type="remote_rm", rm_url="http://127.0.0.1:9/score")
    with pytest.raises(SlimeLiteError, match=r"did not answer \(ClientConnectorError.*; 2 attempt"):
        asyncio.run(compute_reward(closed, sample))


@pytest.mark.parametrize("flags, says", [
    (["--rm-type", "remote_rm"], "--rm-type remote_rm posts each sample to a reward model service: give its --rm-url"),
    (["--rm-type", "math", "--group-rm", "--partial-rollout", "--over-sampling-batch-size", "16"],
     "--group-rm scores a prompt's group at once, but --partial-rollout"),
])
def test_remote_and_group_reward_flags_are_checked_before_ray_starts(tmp_path, flags, says):
    from slime_lite.args import parse_args

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(SlimeLiteError, match=says):
        parse_args(["--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "p.jsonl"), *flags])


def test_group_rm_gives_a_custom_reward_model_the_group_and_checks_its_answer(tmp_path, monkeypatch):
    from slime_lite.rollout.rewards import compute_group_rewards

    monkeypatch.syspath_prepend(str(tmp_path))
    mod = f"group_rm_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(
        "async def rank(args, samples):\n"
        "    order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))\n"
        "    return [order.index(i) / (len(samples) - 1) for i in range(len(samples))]\n"
        "def short(args, samples):\n    return [1.0]\n"
        "def text(args, samples):\n    return ['good'] * len(samples)\n")
    group = [Sample(index=i, response="x" * n) for i, n in enumerate((5, 1, 3))]
    assert asyncio.run(compute_group_rewards(parser_defaults(custom_rm_path=f"{mod}.rank"), group)) == [1.0, 0, 0.5]
    with pytest.raises(SlimeLiteError, match=r"\.short with --group-rm: returned 1 values for a group of 3"):
        asyncio.run(compute_group_rewards(parser_defaults(custom_rm_path=f"{mod}.short"), group))
    with pytest.raises(SlimeLiteError, match=r"\.text with --group-rm: returned a str reward"):
        asyncio.run(compute_group_rewards(parser_defaults(custom_rm_path=f"{mod}.text"), group))
    group[0].label = group[1].label = group[2].label = "xxx"  # without a hook: the built-in type, sample by sample
    assert asyncio.run(compute_group_rewards(parser_defaults(rm_type="addition"), group)) == [0.0, 0.0, 1.0]


def test_remote_rm_keeps_at_most_its_limit_of_requests_in_flight(monkeypatch):
    """A rollout scores every sample at once: the requests to --rm-url in flight are capped (file descriptors)."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from slime_lite.rollout import rewards

    state = {"now": 0, "most": 0}
    lock = threading.Lock()

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            time.sleep(0.2)
            with lock:
                state["now"] -= 1
            self.send_response(200)
            self.send_header("Content-Length", "1")
            self.end_headers()
            self.wfile.write(b"1")

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(rewards, "REMOTE_RM_CONCURRENCY", 2)
    args = parser_defaults(rm_type="remote_rm", rm_url=f"http://127.0.0.1:{server.server_address[1]}/")
    try:
        got = score(args, [Sample(index=i, response="r", label="l") for i in range(6)])
    finally:
        server.shutdown()
        server.server_close()
    assert got == [1.0] * 6 and state["most"] == 2


def test_a_generate_hook_that_may_set_rewards_needs_no_rm_type_but_is_told(caplog):
    """No --rm-type and no rm_type field: a --custom-generate-function-path hook may set sample.reward itself (a
    warning says it must), the tool task's hook, which sets none, is refused before the run as before."""
    import logging

    from slime_lite.args import parser_defaults
    from slime_lite.rollout.rewards import NO_REWARD_HOOK, check_data_rm_types

    with caplog.at_level(logging.WARNING):
        check_data_rm_types(parser_defaults(custom_generate_function_path="my_env.generate"), [{}, {}], "data.jsonl")
    assert "2 prompts have no rm_type field" in caplog.text and "my_env.generate must set sample.reward" in caplog.text
    with pytest.raises(SlimeLiteError, match="prompt 0 has no rm_type field and no --rm-type is given"):
        check_data_rm_types(parser_defaults(custom_generate_function_path=NO_REWARD_HOOK), [{}], "data.jsonl")
