"""What an agent trajectory trains on: one sample where a Qwen3-style template re-renders earlier turns, each token's
weight version, the routed experts of routing replay, the prompt the drift check reads, a response budget shared by
calls in flight, and a turn no parser can read kept as text. The engine is ``ScriptedEngine``, a fake of /generate
(the tiny random model writes no tool calls)."""

from __future__ import annotations

import asyncio
import functools

import pytest

from slime_lite.rollout.drift import token_drift
from slime_lite.rollout.tool_calls import inserted_text
from slime_lite.tokenizer import build_tokenizer
from slime_lite.types import TOKEN_VERSIONS, Sample, Status
from tests.rollout.test_agent_endpoint import _client, run_agent

# Qwen3's way, cut down: the last assistant turn keeps its (empty) think block, earlier ones lose it; with
# enable_thinking false the generation prompt holds an empty one
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
NO_THINK = {"enable_thinking": False}


def test_a_tool_turn_after_a_qwen3_style_turn_is_rendered_on_its_own():
    tok = build_tokenizer()
    tok.chat_template = QWEN3_LIKE
    history = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "calc"}]
    tool = [{"role": "tool", "content": "2"}]
    assert inserted_text(tok, history, tool, "<|im_end|>", template_kwargs=NO_THINK) == (
        "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert inserted_text(tok, history, tool, "<|im_end|>", closed=False, template_kwargs=NO_THINK).startswith(
        "<|im_end|>\n<|im_start|>tool\n")


async def _tool_loop(base_url, task, calls=3):
    client = _client(base_url)
    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": task.prompt}]
    for _ in range(calls):
        reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
        messages += [reply, {"role": "tool", "content": "6"}]


def test_a_qwen3_style_tool_loop_is_one_sample_with_the_engines_tokens():
    """Every call of a Qwen3 tool loop (thinking off) would re-render the last turn without its empty think block:
    the trajectory stays one sample (a GRPO group keeps its size), each call's prompt extends the previous one's
    tokens, and the tool turns are rendered as the template renders them."""
    box = {}
    sample = run_agent(["a<|im_end|>", "b<|im_end|>", "c<|im_end|>"], _tool_loop, chat_template=QWEN3_LIKE,
                       engine_box=box, apply_chat_template_kwargs=NO_THINK)
    assert isinstance(sample, Sample) and sample.status == Status.COMPLETED and sample.metadata["agent_calls"] == 3
    seen = [b["input_ids"] for b in box["engine"].seen]
    assert all(later[:len(earlier)] == earlier for earlier, later in zip(seen, seen[1:]))
    tok = build_tokenizer()
    assert tok.decode(sample.tokens[sample.prompt_length:]) == (
        "a<|im_end|>\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "b<|im_end|>\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nc<|im_end|>")
    assert [t["source"] for t in sample.metadata["turns"]] == ["model", "tool", "model", "tool", "model"]


def test_each_token_keeps_the_weight_version_that_wrote_it_and_the_drift_check_reads_the_agents_prompt():
    """A call in flight across a weight push reports a version per token: the sample keeps them (the staleness
    mask reads them), not the call's last version for all. The prompt is the agent's own rendering (a system
    turn the data set did not have): the token drift check compares against that, not the data set's prompt."""
    versions = [[1, 1, 2, 2, 2, 2], [2, 3, 3, 3, 3, 3]]
    sample = run_agent(["ab<|im_end|>", "cd<|im_end|>"], functools.partial(_tool_loop, calls=2), version="3",
                       token_versions=versions)
    tok = build_tokenizer()
    n1 = len(tok("ab<|im_end|>", add_special_tokens=False)["input_ids"])
    n2 = len(tok("cd<|im_end|>", add_special_tokens=False)["input_ids"])
    got = sample.metadata[TOKEN_VERSIONS]
    model = [i for t in sample.metadata["turns"] if t["source"] == "model"
             for i in range(t["start"], t["start"] + t["length"])]
    assert [got[i] for i in model] == versions[0][:n1] + versions[1][:n2]
    assert sample.metadata["prompt_text"].startswith("<|im_start|>system\nYou add.")
    assert token_drift(sample, tok) is None


def test_routing_replay_keeps_the_last_calls_table_which_covers_every_token():
    """--use-rollout-routing-replay: each call asks for its routed experts; the sample's table is the last call's,
    one row per token but the last, which the trainer takes as it takes a single-turn sample's."""
    from slime_lite.backends.megatron.routing import _sample_table

    box = {}
    sample = run_agent(["a<|im_end|>", "b<|im_end|>"], functools.partial(_tool_loop, calls=2), engine_box=box,
                       use_rollout_routing_replay=True)
    assert all(b["return_routed_experts"] is True for b in box["engine"].seen)
    table = _sample_table(sample, layers=1, top_k=1)
    assert table.flatten().tolist() == list(range(len(sample.tokens) - 1))


def test_a_multi_turn_table_may_stop_before_untrained_tokens_only():
    """A multi-turn sample that ends in a tool turn after its last model call: the table covers the tokens up to
    that call; the rows after it are of tokens never trained. A table that stops before a trained token is
    refused."""
    import torch

    from slime_lite.backends.megatron.routing import _sample_table
    from slime_lite.rollout.turns import append_turn

    sample = Sample(index=0, prompt="p", tokens=[1, 2, 3])
    append_turn(sample, [4, 5], [-0.1, -0.1], source="model")
    sample.rollout_routed_experts = torch.arange(4, dtype=torch.int32)  # the model call: 3 + 2 tokens - 1
    append_turn(sample, [6, 7], source="tool")
    assert _sample_table(sample, 1, 1).flatten().tolist() == [0, 1, 2, 3]
    append_turn(sample, [8], [-0.1], source="model")  # a trained token the table does not reach
    with pytest.raises(ValueError, match="rollout_routed_experts has 4 rows, expected 7"):
        _sample_table(sample, 1, 1)


def test_calls_in_flight_at_once_share_the_response_budget():
    """Four calls sent at once with a budget of 20 response tokens: the first reserves all 20, the others wait for
    it and get what it left (15 written: 5), then nothing (refused), instead of 20 each."""
    errors = []

    async def four_at_once(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": task.prompt}]
        out = await asyncio.gather(*(client.chat.completions.create(model="m", messages=messages) for _ in range(4)),
                                   return_exceptions=True)
        errors.extend(str(e) for e in out if isinstance(e, Exception))

    box = {}
    run_agent(["x" * 14 + "<|im_end|>"] * 4, four_at_once, sampling_params={"temperature": 1.0, "max_new_tokens": 20},
              delay=0.2, engine_box=box)
    assert [b["sampling_params"]["max_new_tokens"] for b in box["engine"].seen] == [20, 5]
    assert len(errors) == 2 and all("used its 20 response tokens" in e for e in errors)


def test_a_tool_call_no_parser_can_read_is_kept_as_text_and_recorded():
    """An integer argument of more digits than Python reads (qwen3_coder's typed values): the turn is content,
    counted malformed, and trained; the agent gets its answer, not a server error."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}
    text = "<tool_call>\n<function=f>\n<parameter=n>\n" + "9" * 5000 + "\n</parameter>\n</function>\n</tool_call>"
    got = []

    async def agent(base_url, task):
        reply = await _client(base_url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}], tools=[tool])
        got.append(reply.choices[0])

    sample = run_agent([text + "<|im_end|>"], agent, parser="qwen3_coder")
    assert got[0].finish_reason == "stop" and got[0].message.content.startswith("<tool_call>")
    assert sample.metadata["malformed_tool_calls"] == 1 and sample.metadata["agent_calls"] == 1
    assert sample.status == Status.COMPLETED and sample.response_length > 0


def test_a_multi_turn_hook_asks_each_model_turn_for_its_routed_experts():
    """multi_turn.model_turn under --use-rollout-routing-replay: the request asks for the table and the sample keeps
    the latest turn's, which the trainer takes though a tool turn follows it."""
    from types import SimpleNamespace

    from slime_lite.backends.megatron.routing import _sample_table
    from slime_lite.rollout import multi_turn as mt
    from tests.rollout.test_agent_endpoint import ScriptedEngine

    engine = ScriptedEngine(["ab", "cd"])
    args = SimpleNamespace(engine_client=engine, use_rollout_routing_replay=True)
    limits = mt.TurnLimits(max_turns=4, max_context_len=None, max_inserted_tokens=64, tool_timeout=1.0)
    sample = Sample(index=0, prompt="p", tokens=[5, 6, 7])
    tok = build_tokenizer()

    async def main():
        await mt.model_turn(args, sample, {"max_new_tokens": 4}, limits)
        mt.insert_turn(sample, tok, "tool says 6", limits)
        await mt.model_turn(args, sample, {"max_new_tokens": 4}, limits)
        mt.insert_turn(sample, tok, "tool says 7", limits)

    asyncio.run(main())
    assert [b["return_routed_experts"] for b in engine.seen] == [True, True]
    covered = len(engine.seen[1]["input_ids"]) + sample.metadata["turns"][2]["length"] - 1
    assert _sample_table(sample, 1, 1).flatten().tolist() == list(range(covered)) and covered < len(sample.tokens) - 1


def test_a_history_holding_the_end_of_turn_text_is_not_counted_through():
    """An earlier turn whose dropped think block holds the end-of-turn text: counting markers would cut inside the
    new messages, so the template's re-rendering is refused as before (the endpoint then starts a new segment)."""
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}"
                         "{{ m.reasoning_content }}{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": "A", "reasoning_content": "it ends with <|im_end|>"}]
    with pytest.raises(Exception, match="where the new messages begin cannot be told"):
        inserted_text(tok, history, [{"role": "user", "content": "NEW"}], "<|im_end|>")


def test_a_call_waiting_for_the_budget_ends_when_the_call_before_it_is_aborted():
    """Two calls at once: the second waits for the budget the first holds; the engine aborts the first (over-sampling
    has its groups), so the second is answered 400 without reaching the engine, and the sample ends ABORTED."""
    answers = []

    async def two_at_once(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": task.prompt}]
        answers.extend(await asyncio.gather(*(client.chat.completions.create(model="m", messages=messages)
                                              for _ in range(2)), return_exceptions=True))

    box = {}
    sample = run_agent([("xx", {"type": "abort", "message": "over-sampling"}), "yy<|im_end|>"], two_at_once,
                       sampling_params={"temperature": 1.0, "max_new_tokens": 20}, delay=0.3, engine_box=box)
    assert len(box["engine"].seen) == 1 and sample.status == Status.ABORTED
    assert len(answers) == 2 and all(isinstance(a, Exception) for a in answers)


def test_a_call_in_flight_reserves_its_inserted_tokens_too():
    """Budget 60: the first call writes 3 tokens; then a call adding a 30-token tool turn (27 left to write) and a
    rewritten history are sent at once. The first holds all 60 (3 + 30 inserted + 27), so the second gets nothing."""
    async def agent(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "q"}]
        reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
        tool_turn = messages + [reply, {"role": "tool", "content": "9" * 10}]
        first = asyncio.ensure_future(client.chat.completions.create(model="m", messages=tool_turn))
        while len(box["engine"].seen) < 2 and not first.done():  # the tool turn reaches the engine first (the
            await asyncio.sleep(0.01)  # two raced: the rewritten history went first at times, getting 57)
        second = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "zz"}])
        await asyncio.gather(first, second, return_exceptions=True)

    box = {}
    out = run_agent(["ab<|im_end|>", "y" * 26 + "<|im_end|>", "z" * 29 + "<|im_end|>"], agent,
                    sampling_params={"temperature": 1.0, "max_new_tokens": 60}, delay=0.3, engine_box=box)
    out = out if isinstance(out, list) else [out]
    assert [b["sampling_params"]["max_new_tokens"] for b in box["engine"].seen] == [60, 27]
    assert sum(s.response_length for s in out) <= 60


def test_the_replay_preflight_takes_the_tables_the_trainer_takes(tmp_path):
    """A multi-turn sample's table stops before its trailing tool turn: the replay preflight accepts it as the trainer
    does, and still refuses a table that stops before a trained token."""
    import json
    from types import SimpleNamespace

    import torch

    from slime_lite.errors import SlimeLiteError
    from slime_lite.preflight import check_routed_experts
    from slime_lite.rollout.turns import append_turn

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "num_experts_per_tok": 1,
                                                      "num_experts": 8, "model_type": "qwen2_moe"}))
    sample = Sample(index=0, prompt="p", tokens=[1, 2, 3])
    append_turn(sample, [4, 5], [-0.1, -0.1], source="model")
    sample.rollout_routed_experts = torch.arange(4, dtype=torch.int32)
    append_turn(sample, [6, 7], source="tool")
    args = SimpleNamespace(hf_checkpoint=str(tmp_path))
    check_routed_experts(args, [sample], "dump.pt")
    append_turn(sample, [8], [-0.1], source="model")
    with pytest.raises(SlimeLiteError, match="has 4 expert ids, expected 7"):
        check_routed_experts(args, [sample], "dump.pt")


def test_a_history_holding_the_marker_text_keeps_the_closing_of_the_model_turn():
    """A tool result that holds the end-of-turn text (a tool reading docs): the template renders the history the same
    way, so the inserted text starts right after the model's end of turn (its newline, or the end of turn itself
    for a cut turn), as before the marker counting."""
    tok = build_tokenizer()
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "calc"},
               {"role": "tool", "content": "docs say <|im_end|> ends a turn"}, {"role": "assistant", "content": "ok"}]
    new = [{"role": "tool", "content": "42"}]
    assert inserted_text(tok, history, new, "<|im_end|>") == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert inserted_text(tok, history, new, "<|im_end|>", closed=False).startswith("<|im_end|>\n<|im_start|>tool")
