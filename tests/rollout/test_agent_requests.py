"""The agent endpoint reads a chat call as SGLang's server does: roles outside the chat roles, tools without a
function name, an assistant turn's tool-call arguments that are no JSON object are 400s naming the field (SGLang
refuses them too, checked on its own objects); text parts are joined by a space; ``continue_final_message`` is
refused (the trajectory trains the engine's own tokens); a reply with tool calls whose turn was cut by its length
finishes "length", streamed or not."""

from __future__ import annotations

import aiohttp
import pytest

from slime_lite.engine.openai_api import _text_parts
from slime_lite.tokenizer import build_tokenizer
from slime_lite.types import Status
from tests import sglang_oracle as oracle
from tests.rollout.test_agent_endpoint import CALC, _client, run_agent

USER = {"role": "user", "content": "hi"}


def _assistant_call(arguments):
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": arguments}}]}


# (body, the field its 400 names); each is refused by SGLang too (test_sglang_refuses_what_the_endpoint_refuses)
REFUSED = [
    ({"messages": [{"role": "system", "content": "s"}, {"role": "banana", "content": "x"}, USER]}, "messages[1].role"),
    ({"messages": [USER], "tools": [{"type": "function"}]}, "tools[0].function.name"),
    ({"messages": [USER], "tools": [CALC, {"type": "function", "function": {"name": 5}}]}, "tools[1].function.name"),
    ({"messages": [USER, _assistant_call("{bad json"), USER]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [USER, _assistant_call("[1, 2]"), USER]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [USER, _assistant_call(5), USER]}, "messages[1].tool_calls[0].function.arguments"),
]


def test_calls_sglang_refuses_are_400s_naming_the_field_and_the_trajectory_goes_on():
    answers, box = [], {}
    continued = [USER, {"role": "assistant", "content": "1, 2,"}]

    async def agent(base_url, task):
        async with aiohttp.ClientSession() as http:
            for body in [b for b, _ in REFUSED] + [{"messages": continued, "continue_final_message": True}]:
                async with http.post(base_url + "/chat/completions", json={"model": "m", **body}) as resp:
                    answers.append((resp.status, (await resp.json())["error"]["message"]))
        reply = await _client(base_url).chat.completions.create(model="m", messages=[
            {"role": "developer", "content": "be brief"}, USER, _assistant_call('{"expr": "1"}'),
            {"role": "tool", "tool_call_id": "c1", "content": "1"}], tools=[CALC])
        answers.append(reply.choices[0].message.content)

    sample = run_agent(["ok<|im_end|>"], agent, engine_box=box)
    *errors, content = answers
    fields = [f for _, f in REFUSED] + ["continue_final_message"]
    assert [status for status, _ in errors] == [400] * len(fields)
    for (_, message), field in zip(errors, fields):
        assert message.startswith(field), message
    assert "not supported by the agent endpoint" in errors[-1][1]
    assert "banana" in errors[0][1] and "developer" in errors[0][1]  # names the role and the roles it may be
    # none of them reached the engine or was recorded; the developer turn and object arguments are rendered
    assert content == "ok" and len(box["engine"].seen) == 1 and sample.metadata["agent_calls"] == 1
    prompt = build_tokenizer().decode(box["engine"].seen[0]["input_ids"])
    assert "<|im_start|>developer\nbe brief" in prompt and '"arguments": {"expr": "1"}' in prompt
    assert sample.status == Status.COMPLETED


def test_sglang_refuses_what_the_endpoint_refuses():
    proto = oracle.openai_protocol()
    chat = oracle.sglang_module("sglang.srt.entrypoints.openai.serving_chat")
    for body, field in REFUSED:
        if field.endswith(".function.arguments"):  # SGLang checks these as it renders the messages
            arguments = body["messages"][1]["tool_calls"][0]["function"]["arguments"]
            with pytest.raises(Exception):
                proto.ChatCompletionRequest.model_validate({"model": "m", **body})
                chat.parse_tool_call_arguments(arguments)
        else:
            with pytest.raises(Exception):
                proto.ChatCompletionRequest.model_validate({"model": "m", **body})
    proto.ChatCompletionRequest.model_validate({"model": "m", "messages": [  # and takes the developer role
        {"role": "developer", "content": "be brief"}, USER]})


def test_text_parts_are_joined_by_a_space_as_the_engines_chat_api_joins_them():
    box = {}
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]

    async def agent(base_url, task):
        await _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": parts}])

    run_agent(["4<|im_end|>"], agent, engine_box=box)
    prompt = build_tokenizer().decode(box["engine"].seen[0]["input_ids"])
    joined = _text_parts({"role": "user", "content": parts}, 0)["content"]  # engine/openai_api.py's (SGLang's)
    assert joined == "What is 2+2?" and f"<|im_start|>user\n{joined}<|im_end|>" in prompt


def test_a_reply_with_tool_calls_cut_by_its_length_finishes_length_streamed_or_not():
    """SGLang reports "tool_calls" only where the engine stopped by itself; a turn cut by max_tokens stays
    "length" (its calls are still returned)."""
    got = []
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "1"}}</tool_call>'

    async def agent(base_url, task):
        client = _client(base_url)
        for _ in range(2):
            reply = (await client.chat.completions.create(model="m", messages=[USER], tools=[CALC])).choices[0]
            got.append((reply.finish_reason, len(reply.message.tool_calls or [])))
        chunks = [c async for c in await client.chat.completions.create(model="m", messages=[USER], tools=[CALC],
                                                                         stream=True)]
        got.append(([c.choices[0].finish_reason for c in chunks],
                    sum(len(c.choices[0].delta.tool_calls or []) for c in chunks)))

    length = {"type": "length", "length": 20}
    run_agent([(call + '<tool_call>{"name": "ca', length), call + "<|im_end|>", (call, length)], agent)
    assert got == [("length", 1), ("tool_calls", 1), ([None, "length"], 1)]
