"""The calculator tool task: tool-call parsing, the calculator, the multi-turn generate hook (model turns are the
engine's tokens and log-probs, tool turns the chat template's text at loss_mask 0), the reward, the warm start's
transcripts and loss mask."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from slime_lite.hooks import HookArgs
from slime_lite.rollout import calc_task
from slime_lite.rollout.tool_calls import format_tool_call, inserted_text, parse_tool_calls
from slime_lite.rollout.turns import append_turn
from slime_lite import tiny_model
from slime_lite.tiny_model import _encode_examples, make_tiny_model
from slime_lite.tokenizer import build_tokenizer, save_tokenizer
from slime_lite.types import TOKEN_VERSIONS, Status

TOK = build_tokenizer()
END = calc_task.END_OF_TURN


def test_parse_tool_calls_well_formed_malformed_and_string_arguments():
    text = 'ok <tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call><|im_end|>'
    parsed = parse_tool_calls(text, strip=(END,))
    assert parsed.calls == [{"name": "calc", "arguments": {"expr": "2*3"}}] and parsed.content == "ok"
    assert parsed.malformed == 0
    as_string = parse_tool_calls('<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"1+1\\"}"}</tool_call>')
    assert as_string.calls == [{"name": "calc", "arguments": {"expr": "1+1"}}]
    for bad in ('<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}</tool_call>',  # JSON does not parse
                '<tool_call>{"arguments": {}}</tool_call>',  # no name
                '<tool_call>{"name": "calc", "arguments": [1]}</tool_call>',  # arguments not an object
                '<tool_call>{"name": "calc", "arguments": {}}'):  # never closed
        parsed = parse_tool_calls("before " + bad)
        assert parsed.calls == [] and parsed.malformed == 1
        assert parsed.content == ("before " + bad).strip()  # kept as the model wrote it
    two = parse_tool_calls(format_tool_call("calc", {"expr": "1+2"}) + '<tool_call>{"name": 1}</tool_call>')
    assert len(two.calls) == 1 and two.malformed == 1 and two.content == '<tool_call>{"name": 1}</tool_call>'


def test_calculator_and_solutions():
    assert calc_task.calc({"expr": "34*5"}) == ("170", True)
    assert calc_task.calc({"expr": "-1-4"}) == ("-5", True)
    assert calc_task.calc({"expr": "1+2*3"})[1] is False  # one operation per call
    assert calc_task.calc({"x": "1+2"})[1] is False
    assert calc_task.solve("12+34*5=") == (["34*5", "12+170"], "182")
    assert calc_task.solve("12*3-5=") == (["12*3", "36-5"], "31")
    assert calc_task.solve("2-3-4=") == (["2-3", "-1-4"], "-5")
    rng = random.Random(0)
    for _ in range(200):
        expr = "".join([str(rng.randint(1, 25)), rng.choice("+-*"), str(rng.randint(1, 25)), rng.choice("+-*"),
                        str(rng.randint(1, 25))])
        assert int(calc_task.solve(expr + "=")[1]) == eval(expr)


def test_transcript_is_the_chat_template_rendering_and_the_warm_start_trains_only_model_turns():
    pieces = calc_task.transcript(TOK, "12+34*5=")
    steps, answer = calc_task.solve("12+34*5=")
    messages = [{"role": "user", "content": "12+34*5="}]
    for expr in steps:
        messages += [{"role": "assistant", "content": None, "tool_calls": [
                         {"type": "function", "function": {"name": "calc", "arguments": f'{{"expr": "{expr}"}}'}}]},
                     {"role": "tool", "content": calc_task.calc({"expr": expr})[0]}]
    messages.append({"role": "assistant", "content": answer})
    rendered = TOK.apply_chat_template(messages, tokenize=False)
    joined = "".join(text for text, _ in pieces)
    assert rendered == joined + "\n"  # the template closes the last turn with a newline the model never writes
    (ids, mask), = _encode_examples(TOK, [{"prompt": "12+34*5=", "label": answer}], "tool_math")
    trained = TOK.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "".join(text for text, model in pieces if model)
    assert "<|im_start|>" not in trained and "\n170<|im_end|>" not in trained  # tool turns are not trained


class FakeEngine:
    """A fake of the engine's /generate (SGLang's response shape) that answers each turn from a script: the tiny
    random-init model of the test session never writes a tool call. It records every request it gets."""

    def __init__(self, turns: list[str], finish: str = "stop") -> None:
        self.turns, self.finish, self.requests = list(turns), finish, []

    async def generate(self, body):
        self.requests.append(body)
        text = self.turns.pop(0)
        ids = TOK(text, add_special_tokens=False)["input_ids"]
        lps = [-0.01 * (k + 1) - 0.5 * len(self.requests) for k in range(len(ids))]
        return {"text": text, "output_ids": ids, "meta_info": {
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)], "weight_version": "3",
            "finish_reason": {"type": self.finish if not self.turns else "stop"},
            "cached_tokens": 5, "prompt_tokens": len(body["input_ids"])}}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(TOK, out)
    return str(out)


def run_hook(tok_dir, turns, prompt="12+34*5=", max_new_tokens=300, finish="stop", carried=0, max_inserted=256):
    """``carried``: the sample comes as --partial-rollout carries one aborted, with that many response tokens."""
    engine = FakeEngine(turns, finish)
    args = HookArgs(SimpleNamespace(hf_checkpoint=tok_dir, max_turns=5, max_inserted_tokens_per_turn=max_inserted,
                                    rollout_max_context_len=4096, tool_call_timeout=5.0,
                                    apply_chat_template_kwargs={}, use_rollout_routing_replay=False), engine)
    text = TOK.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    from slime_lite.types import Sample

    prompt_ids = TOK(text, add_special_tokens=False)["input_ids"]
    sample = Sample(index=0, prompt=prompt, label=calc_task.solve(prompt)[1], tokens=list(prompt_ids))
    if carried:
        append_turn(sample, [9] * carried, [-0.1] * carried, versions=[1] * carried)
        sample.status = Sample.Status.ABORTED
    params = {"temperature": 1.0, "max_new_tokens": max_new_tokens, "sampling_seed": 11}
    sample = asyncio.run(calc_task.generate(args, sample, params))
    return sample, engine, prompt_ids


def test_hook_builds_the_conversation_from_engine_tokens_with_tool_turns_masked(tok_dir):
    model_turns = [text for text, model in calc_task.transcript(TOK, "12+34*5=") if model]
    sample, engine, prompt_ids = run_hook(tok_dir, list(model_turns))
    assert sample.status == Status.COMPLETED and calc_task.reward(None, sample) == 1.0
    assert sample.metadata["tool_calls"] == 2 and sample.metadata["tool_errors"] == 0
    assert TOK.decode(sample.tokens) == "".join(text for text, _ in calc_task.transcript(TOK, "12+34*5="))
    n = sample.response_length
    assert len(sample.tokens) == len(prompt_ids) + n and len(sample.loss_mask) == n == len(sample.rollout_log_probs)
    sources = [t["source"] for t in sample.metadata["turns"]]
    assert sources == ["model", "tool", "model", "tool", "model"]
    for k, turn in enumerate(t for t in sample.metadata["turns"] if t["source"] == "model"):
        span = slice(turn["start"], turn["start"] + turn["length"])
        ids = TOK(model_turns[k], add_special_tokens=False)["input_ids"]
        assert sample.tokens[len(prompt_ids):][span] == ids  # the engine's own ids
        assert sample.rollout_log_probs[span] == [-0.01 * (j + 1) - 0.5 * (k + 1) for j in range(len(ids))]
        assert set(sample.loss_mask[span]) == {1}
    for turn in (t for t in sample.metadata["turns"] if t["source"] == "tool"):
        span = slice(turn["start"], turn["start"] + turn["length"])
        assert set(sample.loss_mask[span]) == {0} and set(sample.rollout_log_probs[span]) == {0.0}
    # token in: each turn sends the conversation so far as ids, and every turn gets its own seed
    for req, turn in zip(engine.requests, [t for t in sample.metadata["turns"] if t["source"] == "model"]):
        assert req["input_ids"] == sample.tokens[:len(prompt_ids) + turn["start"]]
        assert req["sampling_params"]["stop_token_ids"] == [TOK.convert_tokens_to_ids(END)]
    assert len({r["sampling_params"]["sampling_seed"] for r in engine.requests}) == 3
    assert sample.weight_versions == ["3", "3", "3"] and sample.prefix_cache_info.cached_tokens == 15
    assert sample.metadata[TOKEN_VERSIONS] == [3] * n  # each token the version of the turn that wrote it


def test_hook_runs_a_sample_carried_aborted_again_from_its_prompt(tok_dir):
    """--partial-rollout hands the hook a sample aborted mid-trajectory: the hook cannot resume the conversation, so
    it generates the sample again from its prompt, and the dropped tokens are counted."""
    sample, engine, prompt_ids = run_hook(tok_dir, ["9" + END], carried=5)
    assert engine.requests[0]["input_ids"] == prompt_ids and sample.tokens[:len(prompt_ids)] == prompt_ids
    assert sample.response_length == len(sample.tokens) - len(prompt_ids) and 9 not in sample.tokens[len(prompt_ids):]
    assert sample.metadata["restarted_tokens"] == 5 and sample.status == Status.COMPLETED
    assert [t["source"] for t in sample.metadata["turns"]] == ["model"]


def test_hook_wrong_answer_malformed_call_and_errors(tok_dir):
    bad = '<tool_call>{"name": "calc", "arguments": {"expr": "12+34*5"}}</tool_call>' + END  # two operations
    broken = '<tool_call>{"name": "calc"' + END
    sample, engine, _ = run_hook(tok_dir, [bad, broken, "9" + END], max_new_tokens=1000)
    assert sample.metadata["tool_calls"] == 1 and sample.metadata["malformed_tool_calls"] == 1
    assert sample.metadata["tool_errors"] == 2 and calc_task.reward(None, sample) == 0.0
    texts = [t["text"] for t in sample.metadata["turns"]]
    assert "error: expr must be one operation" in texts[1] and "malformed tool call" in texts[3]
    assert texts[2] == broken  # the malformed call stays in the trajectory as the model wrote it


def test_hook_stops_at_the_response_budget_and_at_max_turns(tok_dir):
    call = format_tool_call("calc", {"expr": "1+1"}) + END
    sample, engine, _ = run_hook(tok_dir, [call] * 3, max_new_tokens=len(TOK(call)["input_ids"]) + 10)
    assert sample.status == Status.TRUNCATED and len(engine.requests) == 1  # no room for the tool turn and more
    assert sample.response_length <= len(TOK(call)["input_ids"]) + 10
    assert engine.requests[0]["sampling_params"]["max_new_tokens"] == len(TOK(call)["input_ids"]) + 10
    sample, engine, _ = run_hook(tok_dir, [call] * 5, max_new_tokens=2000)  # --max-turns 5
    assert len(engine.requests) == 5 and calc_task.reward(None, sample) == 0.0
    sample, _, _ = run_hook(tok_dir, ["12"], finish="length")
    assert sample.status == Status.TRUNCATED


def test_a_call_ended_at_eos_gets_the_end_of_turn_before_the_tool_turn(tok_dir):
    """The engine stops at EOS too (finish "stop"): the tool turn then closes the assistant turn first, as the chat
    template renders the conversation (the EOS the model wrote stays: it is what the engine generated)."""
    from slime_lite.tokenizer import EOS

    call = format_tool_call("calc", {"expr": "34*5"})
    sample, _, prompt_ids = run_hook(tok_dir, [call + EOS, "182" + END])
    tool = next(t for t in sample.metadata["turns"] if t["source"] == "tool")
    assert tool["text"].startswith(END + "\n<|im_start|>tool\n170")
    sample, _, _ = run_hook(tok_dir, [call + END, "182" + END])  # ended at the end of turn: not twice
    tool = next(t for t in sample.metadata["turns"] if t["source"] == "tool")
    assert tool["text"].startswith("\n<|im_start|>tool\n170")


def test_the_budget_counts_a_tool_turn_as_it_is_cut(tok_dir):
    """--max-inserted-tokens-per-turn cuts the tool turn: whether it fits the response budget is of the cut turn
    (23 tokens whole, 16 cut: the result cut, the template's 13 after it kept)."""
    call = format_tool_call("calc", {"expr": "34*5"}) + END
    n_call = len(TOK(call, add_special_tokens=False)["input_ids"])
    sample, engine, _ = run_hook(tok_dir, [call, "182" + END], max_new_tokens=n_call + 20, max_inserted=16)
    assert [t["source"] for t in sample.metadata["turns"]] == ["model", "tool", "model"]
    assert len(engine.requests) == 2 and sample.metadata["turns"][1]["length"] == 16


def test_inserted_text_refuses_a_template_that_rewrites_history():
    class Shifty:
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return ("[%d]" % len(messages)) + "".join(m["content"] or "" for m in messages)

    with pytest.raises(Exception, match="renders the conversation so far differently"):
        inserted_text(Shifty(), [{"role": "user", "content": "a"}], [{"role": "tool", "content": "b"}], END)


def test_make_tiny_model_warm_starts_on_tool_transcripts(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_model, "TOOL_WARM_START_ROWS", 100)  # tokenizing the full slice takes a while
    report = make_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, task="tool_math", warm_start_steps=3, warm_start_target=None)
    assert report["task"] == "tool_math" and report["steps"] == 3 and report["final_loss"] < report["first_loss"]
    assert 0.0 <= report["accuracy"] <= 1.0 and report["eval_prompts"] == 200


def test_a_cut_tool_turn_keeps_the_end_of_turn_and_the_next_generation_prompt(tok_dir):
    """--max-inserted-tokens-per-turn cuts the tool's result, never the chat template's text after it: the model's
    next turn still follows the tool turn's <|im_end|> and the assistant's generation prompt; the result's tokens
    cut are counted (the tiny tokenizer: a token per character, one per special token)."""
    name = "calc" + "x" * 100  # an unknown tool: its name comes back in the error text
    sample, engine, _ = run_hook(tok_dir, [format_tool_call(name, {"expr": "1+2"}) + END, "9" + END],
                                 max_new_tokens=1000, max_inserted=40)
    result = f"error: unknown tool {name!r}; the tool is calc"
    head, end = "\n<|im_start|>tool\n", END + "\n<|im_start|>assistant\n"  # 7 and 13 tokens
    tool = sample.metadata["turns"][1]
    assert tool["source"] == "tool" and tool["length"] == 40 and tool["text"] == head + result[:20] + end
    assert TOK.decode(engine.requests[1]["input_ids"]).endswith(result[:20] + end)
    assert sample.metadata["inserted_tokens_cut"] == len(result) - 20
    assert [t["source"] for t in sample.metadata["turns"]] == ["model", "tool", "model"]
