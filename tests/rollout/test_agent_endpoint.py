"""The OpenAI-compatible agent endpoint: the official ``openai`` client against a per-trajectory base URL, in front
of the embedded engine (tiny model); the records are the engine's tokens and log-probs, the sample is built from
them, tool calls come back as OpenAI ``tool_calls``, malformed ones as text (counted)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from slime_lite.engine_client import AsyncEngineClient
from slime_lite.hooks import HookArgs
from slime_lite.rollout.agent_endpoint import AgentEndpoint, openai_agent
from slime_lite.tokenizer import build_tokenizer, load_tokenizer
from slime_lite.types import Sample, Status

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from engine_helpers import start_engine  # noqa: E402

CALC = {"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}}}}


class Recording:
    """The real engine client, recording each /generate body and answer (not a fake: requests go to the engine)."""

    def __init__(self, client):
        self.client, self.seen = client, []

    async def generate(self, body):
        out = await self.client.generate(body)
        self.seen.append((body, out))
        return out


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    server = start_engine(tiny_model_dir, max_running_requests=8)
    yield server
    server.stop()


def test_official_client_against_the_endpoint_records_the_engines_tokens(engine, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)

    async def main():
        rec = Recording(AsyncEngineClient([engine.url]))
        ep = await AgentEndpoint(rec, tok).start()
        traj = ep.open({"temperature": 1.0, "max_new_tokens": 64, "sampling_seed": 3})
        client = openai.AsyncOpenAI(base_url=traj.base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "12+34*5="}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=[CALC], max_tokens=8)
        messages += [first.choices[0].message, {"role": "tool", "tool_call_id": "x", "content": "170"}]
        second = await client.chat.completions.create(model="m", messages=messages, tools=[CALC], max_tokens=8)
        models = await client.models.list()
        await ep.stop()
        await rec.client.close()
        return rec, traj, first, second, models

    rec, traj, first, second, models = asyncio.run(main())
    assert [m.id for m in models.data] == ["slime-lite"]
    (body1, out1), (body2, out2) = rec.seen
    c1, c2 = traj.calls
    rendered = tok.apply_chat_template([{"role": "user", "content": "12+34*5="}], tokenize=False,
                                       add_generation_prompt=True)
    assert c1.prompt_ids == body1["input_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    for call, body, out in ((c1, body1, out1), (c2, body2, out2)):
        assert body["input_ids"] == call.prompt_ids  # token in: ids, never text
        assert call.completion_ids == out["output_ids"]
        assert call.log_probs == [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        assert body["sampling_params"]["temperature"] == 1.0 and body["sampling_params"]["max_new_tokens"] <= 8
    assert first.usage.prompt_tokens == len(c1.prompt_ids) and first.usage.completion_tokens == len(c1.completion_ids)
    # the second call extends the first: its prompt is the first prompt + the engine's completion + the tool turn
    assert c2.extends and c2.prompt_ids[:len(c1.prompt_ids) + len(c1.completion_ids)] == c1.prompt_ids + c1.completion_ids
    assert out2["meta_info"]["cached_tokens"] > 0  # the engine reused the conversation's KV
    inserted = tok.decode(c2.prompt_ids[len(c1.prompt_ids) + len(c1.completion_ids):])
    assert "<|im_start|>tool\n170<|im_end|>\n<|im_start|>assistant\n" in inserted

    sample, = traj.samples(Sample(index=0, prompt="12+34*5=", tokens=[1, 2, 3]))
    n1, n2 = len(c1.completion_ids), len(c2.completion_ids)
    assert sample.tokens == c2.prompt_ids + c2.completion_ids
    n_ins = len(c2.prompt_ids) - len(c1.prompt_ids) - n1
    assert sample.loss_mask == [1] * n1 + [0] * n_ins + [1] * n2
    assert sample.rollout_log_probs == c1.log_probs + [0.0] * n_ins + c2.log_probs
    assert [t["source"] for t in sample.metadata["turns"]] == ["model", "tool", "model"]
    assert sample.metadata["agent_calls"] == 2


class ScriptedEngine:
    """A fake of the engine's /generate answering from a script (the tiny random model writes no tool calls)."""

    def __init__(self, texts):
        self.texts, self.tok = list(texts), build_tokenizer()

    async def generate(self, body):
        text = self.texts.pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return {"text": text, "output_ids": ids, "meta_info": {
            "output_token_logprobs": [[-0.1, t, None] for t in ids], "finish_reason": {"type": "stop"}}}


def run_agent(texts, agent, sampling_params=None, max_turns=8):
    """Run ``agent(base_url, sample)`` through the openai_agent hook over a scripted engine."""
    tok = build_tokenizer()

    async def main():
        engine = ScriptedEngine(texts)
        ep = await AgentEndpoint(engine, tok).start()
        import slime_lite.rollout.agent_endpoint as mod

        mod._ENDPOINTS[id(asyncio.get_running_loop())] = ep
        args = HookArgs(SimpleNamespace(hf_checkpoint="unused", max_turns=max_turns), engine)
        sample = Sample(index=4, prompt="1+2*3=", label="7", tokens=[5])
        try:
            return await openai_agent(agent)(args, sample, sampling_params or {"temperature": 1.0,
                                                                                "max_new_tokens": 500})
        finally:
            await ep.stop()

    return asyncio.run(main())


def test_tool_calls_parsed_into_openai_tool_calls_and_malformed_ones_kept_as_text():
    seen = []

    async def agent(base_url, task):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": task.prompt}]
        for _ in range(3):
            reply = (await client.chat.completions.create(model="m", messages=messages, tools=[CALC])).choices[0]
            seen.append(reply)
            messages.append(reply.message)
            for call in reply.message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "6"})
            if not reply.message.tool_calls:
                messages.append({"role": "user", "content": "again"})

    sample = run_agent(['<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call><|im_end|>',
                        '<tool_call>{"name": "calc", "arguments": {"expr": </tool_call><|im_end|>',
                        "7<|im_end|>"], agent)
    call, = seen[0].message.tool_calls
    assert seen[0].finish_reason == "tool_calls" and seen[0].message.content is None
    assert call.type == "function" and call.function.name == "calc"
    assert json.loads(call.function.arguments) == {"expr": "2*3"}
    assert seen[1].message.tool_calls is None and seen[1].finish_reason == "stop"
    assert seen[1].message.content == '<tool_call>{"name": "calc", "arguments": {"expr": </tool_call>'
    assert seen[2].message.content == "7"
    assert sample.metadata["tool_calls"] == 1 and sample.metadata["malformed_tool_calls"] == 1
    assert sample.status == Status.COMPLETED and sample.metadata["agent_calls"] == 3
    assert [t["source"] for t in sample.metadata["turns"]] == ["model", "tool", "model", "user", "model"]
    texts = [t["text"] for t in sample.metadata["turns"] if t["source"] == "model"]
    assert texts[1].startswith('<tool_call>{"name": "calc", "arguments": {"expr": </tool_call>')  # kept


def test_rewritten_history_splits_the_trajectory_and_limits_end_it():
    async def rewriting(base_url, task):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])

    first, second = run_agent(["x<|im_end|>", "y<|im_end|>"], rewriting)
    assert first.rollout_id == second.rollout_id == 4 and first.metadata["agent_segment"] == 0
    assert first.tokens[-2:] != second.tokens[-2:] and second.metadata["agent_segment"] == 1

    async def chatty(base_url, task):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "a"}]
        while True:
            reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0]
            messages += [reply.message, {"role": "user", "content": "more"}]

    sample = run_agent(["x<|im_end|>"] * 3, chatty, max_turns=3)
    assert sample.status == Status.TRUNCATED and sample.metadata["agent_calls"] == 3
    sample = run_agent(["xxxxxxxxxx<|im_end|>"] * 3, chatty, {"temperature": 1.0, "max_new_tokens": 20})
    assert sample.status == Status.TRUNCATED and sample.response_length <= 20 + 11

    async def broken(base_url, task):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        raise RuntimeError("tool server down")

    sample = run_agent(["x<|im_end|>"], broken)
    assert sample.status == Status.FAILED and "tool server down" in sample.metadata["agent_error"]
    assert sample.response_length == 2  # what was generated is kept


def test_the_example_agent_solves_a_problem_through_the_endpoint():
    """examples/calc_agent.py over a scripted engine writing the right conversation: the sample is that
    conversation (the calculator's results inserted by the agent, at loss_mask 0) and scores 1."""
    from examples.calc_agent import run
    from slime_lite.rollout import calc_task

    tok = build_tokenizer()
    pieces = calc_task.transcript(tok, "1+2*3=")
    sample = run_agent([text for text, model in pieces if model], run)
    assert sample.status == Status.COMPLETED and sample.metadata["tool_calls"] == 2
    assert tok.decode(sample.tokens) == "".join(text for text, _ in pieces)  # the template's rendering, exactly
    assert calc_task.reward(None, sample) == 1.0
    inserted = [t for t in sample.metadata["turns"] if t["source"] == "tool"]
    assert len(inserted) == 2 and all(not any(sample.loss_mask[t["start"]:t["start"] + t["length"]])
                                      for t in inserted)
