"""The agent endpoint's edges: one server per event loop however many hooks start at once, an agent that ends
cancelled, and the chat template's extra arguments (--apply-chat-template-kwargs, the agent's
``chat_template_kwargs``)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import openai
import pytest

import slime_lite.rollout.agent_endpoint as mod
from slime_lite.tokenizer import build_tokenizer
from slime_lite.types import Status
from tests.rollout.test_agent_endpoint import CALC, _client, run_agent


def test_hooks_starting_at_once_share_one_endpoint(monkeypatch):
    """A rollout starts every sample's hook at once: the first calls of endpoint_for all wait for one server
    (not one each, the others never stopped)."""
    monkeypatch.setattr(mod, "_tokenizer", lambda path: build_tokenizer())

    async def main():
        args = SimpleNamespace(engine_client=object(), hf_checkpoint="unused", tool_call_parser="auto",
                               reasoning_parser=None)
        eps = await asyncio.gather(*(mod.endpoint_for(args) for _ in range(8)))
        again = await mod.endpoint_for(args)
        for ep in {id(e): e for e in eps}.values():
            await ep.stop()
        mod._ENDPOINTS.pop(id(asyncio.get_running_loop()), None)
        return eps, again

    eps, again = asyncio.run(main())
    assert len({id(e) for e in eps}) == 1 and again is eps[0]


def test_an_agent_that_ends_cancelled_fails_its_sample_not_the_rollout():
    """An agent whose task ends cancelled (it raised CancelledError itself) is an agent that raised: its sample
    ends FAILED with what it recorded, and the hook returns (a CancelledError out of it would end the rollout)."""
    async def agent(base_url, task):
        await _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        raise asyncio.CancelledError()

    sample = run_agent(["x<|im_end|>"], agent)
    assert sample.status == Status.FAILED and "cancelled" in sample.metadata["agent_error"]
    assert sample.metadata["agent_calls"] == 1 and sample.response_length == 2


THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_chat_template_kwargs_render_every_call_of_the_trajectory():
    """--apply-chat-template-kwargs render the agent's calls as they render the prompts (Qwen3's enable_thinking
    false: an empty think block after each generation prompt), the first call's and the inserted turns of the
    next; the agent's own chat_template_kwargs (SGLang's field) override them; one that is not an object is a 400
    naming the field."""
    answers = []

    async def agent(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "a"}]
        try:
            await client.chat.completions.create(model="m", messages=messages,
                                                 extra_body={"chat_template_kwargs": ["enable_thinking"]})
        except openai.BadRequestError as exc:
            answers.append(exc.message)
        for _ in range(2):
            reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0]
            messages += [reply.message, {"role": "user", "content": "b"}]

    box = {}
    sample = run_agent(["x<|im_end|>", "y<|im_end|>"], agent, chat_template=THINKING, engine_box=box,
                       apply_chat_template_kwargs={"enable_thinking": False})
    tok = build_tokenizer()
    assert "chat_template_kwargs" in answers[0]
    first, second = (tok.decode(b["input_ids"]) for b in box["engine"].seen)
    assert first == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think></think>"
    assert second == first + "x<|im_end|>\n<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n<think></think>"
    assert sample.status == Status.COMPLETED and sample.metadata["agent_calls"] == 2

    async def thinking(base_url, task):
        await _client(base_url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a"}],
            extra_body={"chat_template_kwargs": {"enable_thinking": True}})

    run_agent(["x<|im_end|>"], thinking, chat_template=THINKING, engine_box=box,
              apply_chat_template_kwargs={"enable_thinking": False})
    assert tok.decode(box["engine"].seen[0]["input_ids"]).endswith("<|im_start|>assistant\n")


class SlowEngine:
    """A fake of the engine's /generate that takes 30 s unless cancelled, counting its calls."""

    def __init__(self):
        self.started = self.cancelled = self.finished = 0

    async def generate(self, body):
        self.started += 1
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1
        return {"text": "x", "output_ids": [7], "meta_info": {"output_token_logprobs": [[-0.1, 7, None]],
                                                              "finish_reason": {"type": "stop"}}}


def _run_past_timeout(agent, timeout, settle):
    """``agent`` through ``openai_agent(agent, timeout)`` over a SlowEngine, then ``await settle(engine)`` before the
    endpoint stops; returns the sample and the engine."""
    from slime_lite.hooks import HookArgs
    from slime_lite.types import Sample

    async def main():
        engine = SlowEngine()
        ep = await mod.AgentEndpoint(engine, build_tokenizer()).start()
        mod._ENDPOINTS[id(asyncio.get_running_loop())] = ep
        args = HookArgs(SimpleNamespace(hf_checkpoint="unused", max_turns=8, rollout_max_context_len=4096,
                                        apply_chat_template_kwargs={}, use_rollout_routing_replay=False), engine)
        try:
            sample = await mod.openai_agent(agent, timeout=timeout)(args, Sample(index=0, prompt="a", tokens=[5]),
                                                                    {"max_new_tokens": 50})
            await settle(engine)
            return sample, engine
        finally:
            await ep.stop()
            mod._ENDPOINTS.pop(id(asyncio.get_running_loop()), None)

    return asyncio.run(main())


def test_a_call_its_agent_left_is_cancelled_at_the_engine_and_not_recorded():
    """An agent cancelled (openai_agent's timeout) while its call generates: the call's engine request is
    cancelled (the engine aborts a request whose client left), not run to its end for nobody, and the reply the
    agent never got is not recorded."""
    async def stuck(base_url, task):
        await _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])

    async def cancelled(engine):
        for _ in range(40):
            if engine.cancelled:
                break
            await asyncio.sleep(0.05)

    sample, engine = _run_past_timeout(stuck, 0.3, cancelled)
    assert sample.status == Status.FAILED and "timeout" in sample.metadata["agent_error"]
    assert engine.cancelled == 1 and engine.finished == 0 and sample.response_length == 0


def test_the_managers_close_stops_the_endpoint_an_agent_hook_started(monkeypatch):
    """stop_endpoint (run by RolloutManager.close on its loop) stops the loop's endpoint: its port is closed and
    the next hook starts a new one."""
    import socket
    from urllib.parse import urlsplit

    monkeypatch.setattr(mod, "_tokenizer", lambda path: build_tokenizer())

    async def main():
        args = SimpleNamespace(engine_client=object(), hf_checkpoint="unused", tool_call_parser="auto",
                               reasoning_parser=None)
        ep = await mod.endpoint_for(args)
        port = urlsplit(ep.url).port
        await mod.stop_endpoint()
        again = await mod.endpoint_for(args)
        await mod.stop_endpoint()
        return ep, port, again

    ep, port, again = asyncio.run(main())
    assert again is not ep
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_the_runs_stop_token_ids_and_min_new_tokens_reach_every_call():
    """--rollout-stop-token-ids join the endpoint's own stop ids; an eval's min_new_tokens above a call's room is
    cut to it (the engine refuses a minimum above the maximum)."""
    async def agent(base_url, task):
        await _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}],
                                                        max_tokens=3)

    box = {}
    run_agent(["xy<|im_end|>"], agent, engine_box=box,
              sampling_params={"temperature": 1.0, "max_new_tokens": 500, "stop_token_ids": [7],
                               "min_new_tokens": 10})
    params = box["engine"].seen[0]["sampling_params"]
    assert 7 in params["stop_token_ids"] and len(params["stop_token_ids"]) > 1  # with <|im_end|> and eos
    assert params["max_new_tokens"] == 3 and params["min_new_tokens"] == 3


def test_tool_call_ids_names_and_reasoning_reach_the_chat_template():
    """A template that renders a tool result's tool_call_id and name and an assistant turn's reasoning_content (as
    Llama/Mistral and Qwen3 templates do) gets them from the agent's messages; a non-string one is a 400 naming it."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}{{ (':' + m.name) if m.name else '' }}"
                "{{ ('#' + m.tool_call_id) if m.tool_call_id else '' }}\n"
                "{{ ('<think>' + m.reasoning_content + '</think>') if m.reasoning_content else '' }}"
                "{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    answers = []

    async def agent(base_url, task):
        client = _client(base_url)
        try:
            await client.chat.completions.create(model="m", messages=[
                {"role": "tool", "content": "1", "tool_call_id": 7}])
        except openai.BadRequestError as exc:
            answers.append(exc.message)
        await client.chat.completions.create(model="m", messages=[
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "reasoning_content": "r"},
            {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "calc"}])

    box = {}
    run_agent(["x<|im_end|>"], agent, chat_template=template, engine_box=box)
    assert "messages[0].tool_call_id must be a string" in answers[0]
    assert build_tokenizer().decode(box["engine"].seen[0]["input_ids"]) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think>r</think>b<|im_end|>\n"
        "<|im_start|>tool:calc#c1\n3<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_closes_turns_with_another_token_gets_it_after_a_cut_turn():
    """A Llama-3-like template closing each turn with a token other than <|im_end|> (<|endoftext|> here, a single
    token of the tiny tokenizer): a turn cut by its length gets that token at the start of the next call's inserted
    text, as the template renders the turn, and the engine is told to stop at it."""
    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}<|endoftext|>{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")

    async def agent(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "a"}]
        reply = (await client.chat.completions.create(model="m", messages=messages, max_tokens=3)).choices[0]
        messages += [reply.message, {"role": "user", "content": "b"}]
        await client.chat.completions.create(model="m", messages=messages)

    box = {}
    sample = run_agent([("xyz", {"type": "length", "length": 3}), "w<|endoftext|>"], agent, chat_template=template,
                       engine_box=box)
    tok = build_tokenizer()
    assert mod.end_of_turn(tok) == "<|im_end|>"  # the tiny model's own template is ChatML
    assert tok.decode(sample.tokens) == "[user]a<|endoftext|>[assistant]xyz<|endoftext|>[user]b<|endoftext|>" \
                                        "[assistant]w<|endoftext|>"
    assert tok.convert_tokens_to_ids("<|endoftext|>") in box["engine"].seen[0]["sampling_params"]["stop_token_ids"]
    assert sample.status == Status.COMPLETED and sample.metadata["agent_calls"] == 2


def test_a_turn_that_ended_at_eos_gets_the_end_of_turn_before_the_next_messages():
    """ChatML: a turn the model ended with its EOS (<|endoftext|>), not <|im_end|>, keeps its EOS (the model
    sampled it) and gets <|im_end|> from the next call's inserted text, as the template closes the turn."""
    async def agent(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "a"}]
        reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0]
        messages += [reply.message, {"role": "user", "content": "b"}]
        await client.chat.completions.create(model="m", messages=messages)

    sample = run_agent(["x<|endoftext|>", "y<|im_end|>"], agent)
    assert build_tokenizer().decode(sample.tokens) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nx<|endoftext|><|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
        "<|im_start|>assistant\ny<|im_end|>")
    assert sample.status == Status.COMPLETED and sample.metadata["agent_calls"] == 2


def test_a_streamed_call_gets_openais_chunks_and_is_recorded_like_any_other():
    """``stream=True`` through the official client: the chunks rebuild the reply (content, tool calls, finish
    reason), the usage comes last with include_usage, and the call is recorded as an unstreamed one."""
    got = {}

    async def agent(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "1+2*3="}]
        chunks = [c async for c in await client.chat.completions.create(
            model="m", messages=messages, tools=[CALC], stream=True, stream_options={"include_usage": True})]
        got["content"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        got["calls"] = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        got["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices]
        got["usage"] = chunks[-1].usage
        call = got["calls"][0]
        messages += [{"role": "assistant", "content": got["content"], "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
                     {"role": "tool", "content": "7"}]
        streamed = await client.chat.completions.create(model="m", messages=messages, stream=True)
        got["answer"] = "".join([c.choices[0].delta.content or "" async for c in streamed])
        try:
            await client.chat.completions.create(model="m", messages=messages, stream=True,
                                                 stream_options={"include_usage": "yes"})
        except openai.BadRequestError as exc:
            got["error"] = exc.message

    call = '<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call><|im_end|>'
    sample = run_agent(["ok " + call, "7<|im_end|>"], agent)
    assert got["content"] == "ok" and [(c.index, c.function.name, c.function.arguments) for c in got["calls"]] == [
        (0, "calc", '{"expr": "2*3"}')]
    assert got["finish"] == [None, "tool_calls"] and got["usage"].completion_tokens > 0 and got["answer"] == "7"
    assert "stream_options" in got["error"]
    assert sample.status == Status.COMPLETED and sample.metadata["agent_calls"] == 2
    assert sample.metadata["tool_calls"] == 1  # the second call extended the first: one sample, as unstreamed


def test_wrapped_async_agents_and_thread_agents_past_their_timeout():
    """A lambda around an async agent (it returns the agent's coroutine) runs as the agent itself; a plain-def
    agent still running at the timeout works on its own copy of the sample: what it does later is not kept."""
    import threading
    import time

    async def agent(base_url, task, greeting):
        await _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": greeting}])
        task.metadata["said"] = greeting

    sample = run_agent(["x<|im_end|>"], lambda url, task: agent(url, task, "hi"))
    assert sample.status == Status.COMPLETED and sample.metadata["said"] == "hi" and sample.metadata["agent_calls"] == 1

    late = threading.Event()

    def slow(base_url, task):
        time.sleep(1.0)
        task.metadata["late"] = True  # after the hook returned: on the agent's copy only
        late.set()

    sample = run_agent([], slow, timeout=0.2)
    assert sample.status == Status.FAILED and "timeout" in sample.metadata["agent_error"]
    assert late.wait(5) and "late" not in sample.metadata


def test_a_reply_echoed_back_with_a_name_still_extends_its_call():
    """AutoGen echoes the assistant's reply with its own ``name``: the next call still extends the call that
    replied (one sample), not a rewritten history (a new segment)."""
    async def agent(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "a"}]
        reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
        messages += [{"role": "assistant", "content": reply.content, "name": "solver"},
                     {"role": "user", "content": "b"}]
        await client.chat.completions.create(model="m", messages=messages)

    sample = run_agent(["x<|im_end|>", "y<|im_end|>"], agent)
    assert not isinstance(sample, list) and sample.metadata["agent_calls"] == 2
    assert build_tokenizer().decode(sample.tokens).endswith("x<|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
                                                            "<|im_start|>assistant\ny<|im_end|>")


def test_the_response_budget_is_shared_by_a_trajectorys_segments():
    """An agent that rebuilds its history each call starts a segment each time: --rollout-max-response-len bounds
    the trajectory's response tokens in all, not each segment's (4 x 16 tokens had gone through a budget of 20)."""
    refused = []

    async def rewriting(base_url, task):
        client = _client(base_url)
        for i in range(4):
            try:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])
            except openai.BadRequestError as exc:
                refused.append(exc.message)
                return

    box = {}
    out = run_agent(["x" * 15 + "<|im_end|>"] * 4, rewriting, {"temperature": 1.0, "max_new_tokens": 20},
                    engine_box=box)
    assert [b["sampling_params"]["max_new_tokens"] for b in box["engine"].seen] == [20, 4]
    assert "used its 20 response tokens" in refused[0]
    assert [s.status for s in out] == [Status.COMPLETED, Status.TRUNCATED]  # the end is the last segment's


TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                  "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_call_with_other_tools_is_rendered_whole_not_appended():
    """Plan without tools, then act with them: the tools change the prompt's start, so the second call is rendered
    whole (a new segment), not appended to the first call's tokens where the model never sees its tools."""
    async def agent(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "a"}]
        r = await client.chat.completions.create(model="m", messages=messages)
        messages += [r.choices[0].message, {"role": "user", "content": "now use a tool"}]
        await client.chat.completions.create(model="m", messages=messages, tools=[CALC])
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="m", messages=messages, tools=[CALC])

    box = {}
    out = run_agent(["plan<|im_end|>", "ok<|im_end|>", "done<|im_end|>"], agent, engine_box=box,
                    chat_template=TOOLS_TEMPLATE)
    tok = build_tokenizer()
    sent = [tok.decode(b["input_ids"]) for b in box["engine"].seen]
    assert "Tools:" not in sent[0] and sent[1].startswith("<|im_start|>system\nTools: calc")
    assert box["engine"].seen[2]["input_ids"][:len(box["engine"].seen[1]["input_ids"])] == \
        box["engine"].seen[1]["input_ids"]  # the same tools again: extended
    assert len(out) == 2 and [s.metadata["agent_calls"] for s in out] == [1, 2]


def test_an_aborted_multi_segment_trajectory_is_one_aborted_sample():
    """--partial-rollout runs an aborted sample again from its prompt: an aborted trajectory of two segments is one
    ABORTED sample, so the agent runs again once (it ran once per segment)."""
    async def agent(base_url, task):
        client = _client(base_url)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])
        except openai.APIStatusError:
            pass

    out = run_agent(["x<|im_end|>", ("y", {"type": "abort", "message": "over-sampling"})], agent)
    assert not isinstance(out, list) and out.status is Status.ABORTED


def test_a_retried_call_gets_a_seed_of_its_own():
    """Three identical calls at once (n > 1 is refused), the first failing (502) and retried: the retry must not
    take the seed of a call still in flight (identical requests, identical completions)."""
    from slime_lite.errors import EngineError
    from tests.rollout.test_agent_endpoint import ScriptedEngine

    async def agent(base_url, task):
        client = _client(base_url)

        async def one():
            for _ in range(2):
                try:
                    return await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
                except openai.InternalServerError:
                    continue

        await asyncio.gather(one(), one(), one())

    class FailingFirst(ScriptedEngine):
        calls = 0

        async def generate(self, body):
            self.calls += 1
            n = self.calls
            if n == 1:
                self.seen.append(body)
                await asyncio.sleep(0.05)
                raise EngineError("engine http://e/generate failed (ConnectionResetError)")
            await asyncio.sleep(0.2)  # still in flight when the first call is retried
            return await super().generate(body)

    import tests.rollout.test_agent_endpoint as t

    box, real = {}, t.ScriptedEngine
    t.ScriptedEngine = FailingFirst
    try:
        run_agent(["x<|im_end|>"] * 3, agent, {"temperature": 1.0, "max_new_tokens": 50, "sampling_seed": 3},
                  engine_box=box)
    finally:
        t.ScriptedEngine = real
    seeds = [b["sampling_params"]["sampling_seed"] for b in box["engine"].seen]
    assert len(seeds) == 4 and len(set(seeds)) == 4


@pytest.mark.parametrize("in_thread", [False, True])
def test_an_agent_busy_with_its_own_tools_ends_aborted_when_over_sampling_aborts(in_thread):
    """Over-sampling has its groups while an agent waits on its own tool (no request on any engine, so the engines'
    abort does not reach it): its trajectory ends ABORTED at once with the call it made, the agent cancelled (an
    async one) or answered 404 from then on (one in a thread), instead of the rollout waiting for the tool."""
    from slime_lite.rollout import oversample

    release = threading.Event()

    def abort_all():  # what OverSampler._abort runs in the rollout's loop
        for fn in oversample.ON_ABORT:
            fn()

    async def agent(base_url, task):
        await _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        asyncio.get_running_loop().call_later(0.2, abort_all)
        await asyncio.sleep(60)  # the tool

    def thread_agent(base_url, task):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        loop = next(e.loop for e in mod._ENDPOINTS.values() if e.loop.is_running())  # the hook's
        loop.call_soon_threadsafe(abort_all)
        release.wait(60)  # the tool

    started = time.monotonic()
    try:
        sample = run_agent(["x<|im_end|>"], thread_agent if in_thread else agent, timeout=30)
    finally:
        release.set()
    assert time.monotonic() - started < 20, "the hook waited for the agent's tool"
    assert sample.status == Status.ABORTED and sample.metadata["agent_calls"] == 1
    assert "agent_error" not in sample.metadata


@pytest.mark.parametrize("in_thread", [False, True])
def test_an_agent_that_calls_sys_exit_fails_its_sample_not_the_rollout(in_thread):
    """sys.exit() in an agent (its argparse, say), async or in a thread, ends its sample FAILED keeping what it
    recorded: a SystemExit out of its task would stop the rollout's whole event loop."""
    import sys

    async def agent(base_url, task):
        await _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        sys.exit(2)

    def thread_agent(base_url, task):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        sys.exit(2)

    sample = run_agent(["x<|im_end|>"], thread_agent if in_thread else agent)
    assert sample.status == Status.FAILED and sample.metadata["agent_calls"] == 1 and sample.response_length == 2
    assert sample.metadata["agent_error"] == "ExitCalled: the agent called sys.exit(2)"


def test_template_arguments_the_endpoint_sets_are_refused_naming_the_key():
    """An agent's chat_template_kwargs holding an argument the endpoint passes the template itself is a 400 naming
    chat_template_kwargs.<key> and the fix (not a template error blaming messages), the keys the flag
    --apply-chat-template-kwargs refuses (one list); the trajectory goes on, nothing recorded."""
    from slime_lite import args
    from slime_lite.rollout import agent_messages

    answers = []

    async def agent(base_url, task):
        client = _client(base_url)
        for key in args.TEMPLATE_OWN_ARGS:
            try:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}],
                                                     extra_body={"chat_template_kwargs": {key: []}})
            except openai.BadRequestError as exc:
                answers.append((key, exc.body["message"]))
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])

    sample = run_agent(["x<|im_end|>"], agent)
    assert [k for k, _ in answers] == list(args.TEMPLATE_OWN_ARGS)
    for key, message in answers:
        assert message.startswith(f"chat_template_kwargs.{key}: set by the endpoint"), message
        assert ("send the tools in the call's tools field" if key == "tools" else "leave it out") in message
    assert sample.status == Status.COMPLETED and sample.metadata["agent_calls"] == 1
    assert args.TEMPLATE_OWN_ARGS is agent_messages.TEMPLATE_OWN_ARGS


def test_a_long_call_is_tokenized_off_the_loop_and_one_far_past_the_context_is_refused_untokenized():
    """Tokenizing megabytes takes seconds: it runs in a worker thread, so another trajectory's call is answered
    meanwhile; a call whose new text has far more characters than the context's room could hold as tokens is a 400
    naming messages and --rollout-max-context-len without being tokenized (the sample truncated, as a full one)."""
    import threading

    from tests.rollout.test_agent_endpoint import ScriptedEngine

    tok = build_tokenizer()
    other_answered = threading.Event()

    class SlowTokenizer:
        """The tiny tokenizer, holding a long text until another trajectory's call was answered (as megabytes hold
        a real one for seconds): on the event loop it would wait out its 30 s, the other call never answered;
        records each text's length."""

        def __init__(self):
            self.lengths, self.other_first = [], None

        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, text, **kwargs):
            self.lengths.append(len(text))
            if len(text) > 1000:
                self.other_first = other_answered.wait(30)
            return tok(text, **kwargs)

    async def main():
        slow = SlowTokenizer()
        ep = await mod.AgentEndpoint(ScriptedEngine(["x<|im_end|>"] * 2), slow).start()
        long_call, other, huge = (ep.open({"temperature": 1.0, "max_new_tokens": 8}, context=4096) for _ in range(3))

        async def call(traj, content, after=0.0):
            await asyncio.sleep(after)
            try:
                await _client(traj.base_url).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": content}])
                return "ok"
            except openai.BadRequestError as exc:
                return exc.body["message"]
            finally:
                if traj is other:
                    other_answered.set()

        out = await asyncio.gather(call(long_call, "x" * 2000), call(other, "hi", after=0.3),
                                   call(huge, "x" * 1_000_000, after=0.1))
        await ep.stop()
        return slow, out, huge

    slow, (long_answer, other_answer, huge_answer), huge = asyncio.run(main())
    assert long_answer == other_answer == "ok"
    assert slow.other_first, "another trajectory's call waited for a long one's tokenizing"
    assert huge_answer.startswith("messages: ") and "(--rollout-max-context-len)" in huge_answer, huge_answer
    assert max(slow.lengths) < 1_000_000 and huge.truncated  # never tokenized


def test_a_thread_agents_call_in_flight_at_its_timeout_is_cancelled_at_the_engine():
    """A plain-def agent (synchronous client, in a thread) still waiting on a call at openai_agent's timeout: the
    thread cannot be stopped and its client does not hang up, so the endpoint cancels that call's engine request
    itself when the trajectory closes (not run to its token limit for nobody), and the reply is not recorded."""
    errors, answered = [], threading.Event()

    def stuck(base_url, task):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=20)
        try:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        except openai.APIError as exc:  # what the abandoned thread gets once its call is cancelled
            errors.append(exc)
        answered.set()

    async def thread_answered(engine):
        await asyncio.to_thread(answered.wait, 10)

    # 2 s: the thread's call reaches the engine well before (its client's start included, on a loaded machine)
    sample, engine = _run_past_timeout(stuck, 2, thread_answered)
    assert sample.status == Status.FAILED and "timeout" in sample.metadata["agent_error"]
    assert engine.started == engine.cancelled == 1 and engine.finished == 0 and sample.response_length == 0
    assert len(errors) == 1 and errors[0].status_code == 404 and "was cancelled" in errors[0].message
