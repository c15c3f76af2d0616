"""The OpenAI-compatible agent endpoint: the official ``openai`` client against a per-trajectory base URL, in front
of the embedded engine (tiny model); the records are the engine's tokens and log-probs, the sample is built from
them, tool calls come back as OpenAI ``tool_calls``, malformed ones as text (counted)."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import openai
import pytest

from slime_lite.engine_client import AsyncEngineClient
from slime_lite.hooks import HookArgs
from slime_lite.rollout.agent_endpoint import AgentEndpoint, openai_agent
from slime_lite.tokenizer import build_tokenizer, load_tokenizer
from slime_lite.types import TRAJECTORY_END, Sample, Status, trajectory_ends

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
        second = await client.chat.completions.create(model="m", messages=messages, tools=[CALC], max_tokens=8,
                                                      logprobs=True, top_logprobs=2)
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
    assert first.choices[0].logprobs is None  # not asked for
    lps = second.choices[0].logprobs.content  # the engine's, as OpenAI shapes them
    assert [t.logprob for t in lps] == c2.log_probs and [t.token for t in lps] == [tok.decode([i]) for i in
                                                                                 c2.completion_ids]
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in lps)
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
    """A fake of the engine's /generate answering from a script (the tiny random model writes no tool calls). An
    entry is the text, (text, finish_reason) or an exception to raise; ``delay`` seconds per call let calls
    overlap; ``seen`` holds the bodies."""

    def __init__(self, texts, delay=0.0):
        self.texts, self.tok, self.delay, self.seen = list(texts), build_tokenizer(), delay, []

    async def generate(self, body):
        self.seen.append(body)
        text, finish = self.texts.pop(0), {"type": "stop"}
        if isinstance(text, Exception):
            raise text
        if isinstance(text, tuple):
            text, finish = text
        if self.delay:
            await asyncio.sleep(self.delay)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        meta = {"output_token_logprobs": [[-0.1, t, None] for t in ids], "finish_reason": finish}
        if getattr(self, "version", None) is not None:
            meta["weight_version"] = self.version
        if getattr(self, "token_versions", None):  # a push in the middle of the call: versions per token
            meta["output_token_weight_versions"] = self.token_versions.pop(0)[:len(ids)]
        if body.get("return_routed_experts"):  # one expert per position (its position), as SGLang's int32 table
            rows = len(body["input_ids"]) + len(ids) - 1
            meta["routed_experts"] = base64.b64encode(np.arange(rows, dtype=np.int32).tobytes()).decode()
        return {"text": text, "output_ids": ids, "meta_info": meta}


def run_agent(texts, agent, sampling_params=None, max_turns=8, delay=0.0, engine_box=None, chat_template=None,
              sample=None, version=None, timeout=None, context=4096, token_versions=None, parser="auto",
              tokenizer=None, reasoning=None, **flags):
    """Run ``agent(base_url, sample)`` through the openai_agent hook over a scripted engine (kept in
    ``engine_box["engine"]`` when given; reporting weight ``version`` when given, and per call its tokens'
    ``token_versions``); ``parser`` is --tool-call-parser, ``reasoning`` --reasoning-parser, ``tokenizer`` the
    endpoint's (the tiny one by default), ``flags`` are more of the run's flags."""
    tok = tokenizer or build_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template

    async def main():
        engine = ScriptedEngine(texts, delay)
        engine.tok = tok  # its answers' ids in the endpoint's tokenizer
        engine.version, engine.token_versions = version, [list(v) for v in token_versions or []]
        if engine_box is not None:
            engine_box["engine"] = engine
        ep = await AgentEndpoint(engine, tok, tool_call_parser=parser, reasoning_parser=reasoning).start()
        import slime_lite.rollout.agent_endpoint as mod

        mod._ENDPOINTS[id(asyncio.get_running_loop())] = ep
        args = HookArgs(SimpleNamespace(hf_checkpoint="unused", max_turns=max_turns,
                                        rollout_max_context_len=context, **{"apply_chat_template_kwargs": {},
                                                                            "use_rollout_routing_replay": False,
                                                                            **flags}), engine)
        given = sample or Sample(index=4, prompt="1+2*3=", label="7", tokens=[5])
        try:
            return await openai_agent(agent, timeout)(args, given, sampling_params or {"temperature": 1.0,
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
    assert TRAJECTORY_END not in first.metadata and second.metadata[TRAJECTORY_END]  # the last call is the end

    async def side_call(base_url, task):  # a summary from a fresh history mid-way; the conversation ends it
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "a"}]
        reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0]
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "sum up"}])
        messages += [reply.message, {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="m", messages=messages)

    main, summary = run_agent(["x<|im_end|>", "s<|im_end|>", "y<|im_end|>"], side_call)
    assert main.metadata["agent_calls"] == 2 and summary.metadata["agent_calls"] == 1
    assert main.metadata[TRAJECTORY_END] and TRAJECTORY_END not in summary.metadata
    assert trajectory_ends([main, summary]) == [0]  # its reward is the conversation's, not the summary's

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


def test_an_agent_on_the_synchronous_client_runs_in_a_thread_and_gets_its_answers():
    """A plain ``def`` agent with ``openai.OpenAI`` (blocking calls): it runs in a thread while the rollout's event
    loop serves its calls (on the loop it would block it, and its first call would never be answered)."""
    threads = []

    def sync_agent(base_url, task):
        threads.append(threading.current_thread().name)
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=20)
        messages = [{"role": "user", "content": task.prompt}]
        for _ in range(2):
            reply = client.chat.completions.create(model="m", messages=messages).choices[0]
            messages += [reply.message, {"role": "user", "content": "again"}]
        task.metadata["answer"] = reply.message.content

    sample = run_agent(["x<|im_end|>", "y<|im_end|>"], sync_agent)
    assert sample.status == Status.COMPLETED and sample.metadata["agent_calls"] == 2
    assert sample.metadata["answer"] == "y" and threads[0].startswith("slime-lite-agent")

    def sync_broken(base_url, task):
        openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a"}])
        raise RuntimeError("tool server down")

    sample = run_agent(["x<|im_end|>"], sync_broken)
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


def _client(base_url):
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_calls_sent_at_once_keep_each_sample_the_tokens_the_engine_was_sent():
    """Two calls at once from the same history (two branches): each model turn of each sample follows exactly the
    tokens the engine was sent for it (never one branch's completion after the other's), each call has its own
    sampling seed, and --max-turns counts the calls in flight."""
    async def branching(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "a"}]
        reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
        messages.append(reply)
        answers = await asyncio.gather(*(client.chat.completions.create(
            model="m", messages=messages + [{"role": "user", "content": q}]) for q in ("b", "c")),
            return_exceptions=True)
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer

    box = {}
    out = run_agent(["x<|im_end|>", "y<|im_end|>", "z<|im_end|>"], branching, delay=0.05, engine_box=box,
                    sampling_params={"temperature": 1.0, "max_new_tokens": 500, "sampling_seed": 3})
    samples = out if isinstance(out, list) else [out]
    sent = [b["input_ids"] for b in box["engine"].seen]
    assert len({b["sampling_params"]["sampling_seed"] for b in box["engine"].seen}) == 3  # each call its own seed
    assert sum(s.metadata["agent_calls"] for s in samples) == 3
    for s in samples:
        prompt_len = len(s.tokens) - s.response_length
        for t in s.metadata["turns"]:
            if t["source"] == "model":
                assert s.tokens[:prompt_len + t["start"]] in sent  # what the engine generated this turn after
    tok = build_tokenizer()
    texts = sorted(tok.decode(s.tokens) for s in samples)
    assert any(t.endswith("<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\ny<|im_end|>") for t in texts)
    assert any(t.endswith("<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\nz<|im_end|>") for t in texts)

    out = run_agent(["x<|im_end|>", "y<|im_end|>", "z<|im_end|>"], branching, delay=0.05, max_turns=2,
                    engine_box=box)
    samples = out if isinstance(out, list) else [out]
    assert len(box["engine"].seen) == 2 and sum(s.metadata["agent_calls"] for s in samples) == 2
    assert all(s.status == Status.TRUNCATED for s in samples)


def test_a_turn_cut_by_its_length_or_a_stop_string_is_closed_before_the_next_messages():
    """A turn the engine ended without <|im_end|> (max_tokens, the agent's stop string) gets it from the inserted
    text of the next call, as the chat template renders that turn; ``stop`` reaches the engine and, as OpenAI's,
    is not in the content."""
    seen = []

    async def agent(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "a"}]
        for kwargs, then in (({"max_tokens": 3}, "go on"), ({"stop": "Obs:"}, "Obs: 6"), ({}, None)):
            choice = (await client.chat.completions.create(model="m", messages=messages, **kwargs)).choices[0]
            seen.append(choice)
            messages.append(choice.message)
            if then:
                messages.append({"role": "user", "content": then})

    box = {}
    sample = run_agent([("xyz", {"type": "length", "length": 3}), ("w Obs:", {"type": "stop", "matched": "Obs:"}),
                        "done<|im_end|>"], agent, engine_box=box)
    first, second, _ = box["engine"].seen
    assert first["sampling_params"]["max_new_tokens"] == 3 and "Obs:" in second["sampling_params"]["stop"]
    assert [c.finish_reason for c in seen] == ["length", "stop", "stop"]
    assert seen[0].message.content == "xyz" and seen[1].message.content == "w"
    tok = build_tokenizer()
    assert tok.decode(sample.tokens) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nxyz<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n"
        "<|im_start|>assistant\nw Obs:<|im_end|>\n<|im_start|>user\nObs: 6<|im_end|>\n<|im_start|>assistant\n"
        "done<|im_end|>")
    assert sample.status == Status.COMPLETED
    model = [t for t in sample.metadata["turns"] if t["source"] == "model"]
    assert [t["text"] for t in model] == ["xyz", "w Obs:", "done<|im_end|>"]  # the engine's, mask 1
    assert all(all(sample.loss_mask[t["start"]:t["start"] + t["length"]]) for t in model)


def test_bad_requests_are_400s_naming_the_field_and_leave_the_trajectory_going():
    """Bad input answers 400 with OpenAI's error shape and a message naming the field; the engine refusing a call
    answers 400 with its reason, an engine failure 502; none of them is recorded or ends the trajectory."""
    from slime_lite.errors import EngineError

    answers = []
    user = [{"role": "user", "content": "a"}]

    async def agent(base_url, task):
        import aiohttp

        async with aiohttp.ClientSession() as http:
            for body in ({"messages": ["hi"]}, {"messages": [{"content": "a"}]},
                         {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                         {"messages": [{"role": "assistant", "tool_calls": [{"function": "calc"}]}]},
                         {"messages": user, "stop": [""]}, {"messages": user, "top_logprobs": 2},
                         {"messages": user, "n": 2},
                         {"messages": [{"role": "user", "content": "a \ud800"}]},  # sent as JSON's \ud800 escape
                         b'{"messages": [{"role": "user", "content": "a \xed\xa0\x80"}]}',  # not UTF-8
                         {"messages": user}, {"messages": user}):
                raw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
                    else {"json": body}
                async with http.post(base_url + "/chat/completions", **raw) as resp:
                    answers.append((resp.status, await resp.json()))
        client = _client(base_url)
        reply = await client.chat.completions.create(model="m", messages=user, n=None, logprobs=True,
                                                     top_logprobs=0)
        answers.append(reply)

    refused = EngineError("engine http://e/generate answered HTTP 400: {\"error\": {\"message\": \"too long\"}}")
    sample = run_agent([refused, EngineError("engine http://e/generate failed (ConnectionResetError)"),
                        "xy<|im_end|>"], agent)
    *errors, reply = answers
    assert [status for status, _ in errors] == [400] * 10 + [502]
    fields = ["messages[0]", "messages[0].role", "messages[0].content[0]", "messages[0].tool_calls[0]", "stop",
              "top_logprobs", "n", "messages[0].content: text is not valid Unicode", "not UTF-8", "too long",
              "ConnectionResetError"]
    for (_, body), field in zip(errors, fields):
        assert set(body["error"]) >= {"message", "type", "code"} and field in body["error"]["message"], body
    assert reply.choices[0].message.content == "xy"
    lps = reply.choices[0].logprobs.content
    assert [t.logprob for t in lps] == [-0.1] * 3 and "".join(t.token for t in lps) == "xy<|im_end|>"
    assert sample.status == Status.COMPLETED and sample.metadata["agent_calls"] == 1
    assert sample.tokens[-sample.response_length:] == build_tokenizer()("xy<|im_end|>")["input_ids"]


def test_a_call_the_rollout_aborts_ends_the_sample_aborted():
    """The engine aborting a call (over-sampling has its groups) is not a reply the agent goes on from: that call and
    every later one answer an error, the agent stops, and the sample is ABORTED (not FAILED, not trained)."""
    errors = []

    async def agent(base_url, task):
        client = _client(base_url)
        for _ in range(3):
            try:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
            except openai.APIStatusError as exc:
                errors.append(exc)
        raise RuntimeError("the agent gives up")

    box = {}
    sample = run_agent([("xy", {"type": "abort"}), "z<|im_end|>", "z<|im_end|>"], agent, engine_box=box)
    assert len(box["engine"].seen) == 1 and len(errors) == 3 and "abort" in str(errors[0])
    assert sample.status == Status.ABORTED and "agent_error" not in sample.metadata


def test_a_template_that_renders_earlier_turns_otherwise_goes_on_from_the_engines_tokens():
    """A chat template that renders earlier assistant turns differently once more messages follow (as Qwen3 drops
    their think block): the call goes on from the tokens the engine wrote (one sample, its prefix cached), and only
    the new messages are rendered, as the template renders them after that history."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not loop.last %}"
                "[earlier]{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    async def agent(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "a"}]
        for _ in range(2):
            messages += [(await client.chat.completions.create(model="m", messages=messages)).choices[0].message,
                         {"role": "user", "content": "b"}]

    box = {}
    sample = run_agent(["x<|im_end|>", "y<|im_end|>"], agent, chat_template=template, engine_box=box)
    tok = build_tokenizer()
    assert sample.status == Status.COMPLETED and sample.metadata["agent_calls"] == 2
    assert tok.decode(sample.tokens) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nx<|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
        "<|im_start|>assistant\ny<|im_end|>")
    first, second = box["engine"].seen
    assert second["input_ids"][:len(first["input_ids"])] == first["input_ids"]
    assert [t["source"] for t in sample.metadata["turns"]] == ["model", "user", "model"]


def test_a_sample_carried_aborted_is_run_again_from_its_prompt_with_each_tokens_version():
    """--partial-rollout hands the hook a sample aborted mid-trajectory (its tokens so far, older versions): the
    agent runs again from the start, the old tokens are dropped and counted, and each model token has the version
    of the call that generated it; an agent that then makes no call leaves the prompt alone."""
    from slime_lite.types import TOKEN_VERSIONS

    def carried():
        s = Sample(index=4, prompt="1+2*3=", label="7", tokens=[5, 9, 9, 9], response="xxx", response_length=3,
                   loss_mask=[1, 1, 1], rollout_log_probs=[-0.1] * 3, weight_versions=["0"], status=Status.ABORTED)
        s.metadata[TOKEN_VERSIONS] = [0, 0, 0]
        return s

    async def one_call(base_url, task):
        await _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])

    sample = run_agent(["x<|im_end|>"], one_call, sample=carried(), version="2")
    tok = build_tokenizer()
    assert tok.decode(sample.tokens).startswith("<|im_start|>user\na") and 9 not in sample.tokens
    assert sample.metadata["restarted_tokens"] == 3 and sample.status == Status.COMPLETED
    assert sample.metadata[TOKEN_VERSIONS] == [2] * sample.response_length and sample.weight_versions == ["2"]

    async def no_call(base_url, task):
        return None

    sample = run_agent([], no_call, sample=carried())
    assert sample.tokens == [5] and sample.response_length == 0 and TOKEN_VERSIONS not in sample.metadata


def test_an_agent_past_its_timeout_is_cancelled_and_its_sample_fails_keeping_what_it_recorded():
    async def stuck(base_url, task):
        await _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        await asyncio.sleep(30)  # its own I/O, never answering

    sample = run_agent(["x<|im_end|>"], stuck, timeout=0.5)
    assert sample.status == Status.FAILED and sample.metadata["agent_calls"] == 1 and sample.response_length > 0
    assert sample.metadata["agent_error"] == "the agent did not finish within its 0.5 s (openai_agent's timeout)"


def test_the_context_bound_caps_each_call_and_a_full_conversation_ends_truncated():
    """--rollout-max-context-len (at most the model's context - 1) bounds the conversation as multi_turn bounds a
    sample: each call may generate only up to it, and a call whose prompt fills it is a 400, the sample TRUNCATED."""
    answers = []

    async def chatty(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "a"}]
        for _ in range(3):
            try:
                reply = await client.chat.completions.create(model="m", messages=messages)
            except openai.BadRequestError as exc:
                answers.append(exc.message)
                return
            messages += [reply.choices[0].message, {"role": "user", "content": "more " * 10}]

    box = {}
    sample = run_agent(["x<|im_end|>", "y<|im_end|>"], chatty, engine_box=box, context=40)
    first = box["engine"].seen[0]
    assert first["sampling_params"]["max_new_tokens"] == 40 - len(first["input_ids"])
    assert len(box["engine"].seen) < 3 and sample.status == Status.TRUNCATED
    assert "fills its 40 tokens (--rollout-max-context-len)" in answers[0]
