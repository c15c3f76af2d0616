"""OpenAI-compatible routes and the ``slime-lite serve`` command line of the embedded engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from engine_helpers import generate, http, in_thread, one_chunk_per_token, start_engine

from slime_lite.engine.serve_cli import main
from slime_lite.errors import SlimeLiteError


def test_v1_models_lists_the_model(engine):
    status, out = http(engine.url, "/v1/models")
    assert status == 200 and out["data"][0]["id"] == engine.served_model_name


def test_v1_completions_with_usage_logprobs_and_stop(engine):
    body = {"model": "x", "prompt": "1+1=", "max_tokens": 5, "temperature": 0, "logprobs": 1, "n": 2}
    status, out = http(engine.url, "/v1/completions", body)
    assert status == 200 and out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == [0, 1]
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["token_logprobs"]) == 5
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 10, "total_tokens": 14}
    native = http(engine.url, "/generate", {"text": "1+1=", "sampling_params": {"max_new_tokens": 5,
                                                                                "temperature": 0}})[1]
    assert choice["text"] == native["text"]
    text = native["text"]
    stop = text[2:4]
    out = http(engine.url, "/v1/completions", {**body, "n": 1, "stop": [stop]})[1]
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == text[: text.index(stop)]


def test_v1_chat_completions_uses_chat_template(engine):
    messages = [{"role": "user", "content": "2+2?"}]
    body = {"model": "x", "messages": messages, "max_tokens": 4, "temperature": 0, "logprobs": True}
    status, out = http(engine.url, "/v1/chat/completions", body)
    assert status == 200 and out["object"] == "chat.completion"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["logprobs"]["content"]) == 4
    prompt = engine.scheduler.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    native = http(engine.url, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 4,
                                                                                "temperature": 0}})[1]
    assert choice["message"]["content"] == native["text"]
    assert out["usage"]["prompt_tokens"] == native["meta_info"]["prompt_tokens"]


def test_v1_chat_completions_content_parts_null_max_tokens_and_the_default_length(engine):
    """Content as OpenAI text parts renders as its text (not the list's repr), on /tokenize too; a part that is not
    text is a 400 naming it. ``max_completion_tokens: null`` leaves ``max_tokens`` in force, and a chat call
    without either runs up to the context (SGLang's and OpenAI's default), not 128 tokens."""
    def chat(content, **extra):
        body = {"messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
        return http(engine.url, "/v1/chat/completions", body)

    plain, parts = chat("hi there", max_tokens=2)[1], chat([{"type": "text", "text": "hi"},
                                                          {"type": "text", "text": "there"}], max_tokens=2)[1]
    assert parts["usage"] == plain["usage"] and parts["choices"] == plain["choices"]
    tokens = [http(engine.url, "/tokenize", {"messages": [{"role": "user", "content": c}]})[1]["tokens"]
              for c in ("hi", [{"type": "text", "text": "hi"}])]
    assert tokens[0] == tokens[1]
    status, out = chat([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], max_tokens=2)
    assert status == 400 and "messages[0].content[0]" in out["error"]["message"]
    out = chat("hi", max_completion_tokens=None, max_tokens=3, ignore_eos=True)[1]
    assert out["usage"]["completion_tokens"] == 3
    out = chat("hi", ignore_eos=True)[1]
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] > 128  # up to the context: 512 tokens of the tiny model


def test_v1_chat_completions_chat_template_kwargs_and_the_max_completion_tokens_field(engine):
    """``chat_template_kwargs`` (SGLang's field: Qwen3's enable_thinking) reach the chat template; one that is not
    an object is a 400 naming it. A bad ``max_completion_tokens`` is a 400 naming that field, not max_tokens."""
    tok = engine.scheduler.tokenizer
    template = tok.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined "
                         "and not enable_thinking %}<think></think>{% endif %}{% endif %}")
    try:
        plain, off = (http(engine.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, **extra})[1]
                      for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}))
        status, bad = http(engine.url, "/v1/chat/completions", {"messages": msgs, "chat_template_kwargs": [1]})
    finally:
        tok.chat_template = template
    think = len(tok.encode("<think></think>", add_special_tokens=False))
    assert off["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + think
    assert status == 400 and "chat_template_kwargs" in bad["error"]["message"]
    for value in (-1, 100000):
        status, out = http(engine.url, "/v1/chat/completions", {"messages": msgs, "max_completion_tokens": value})
        assert status == 400 and "max_completion_tokens" in out["error"]["message"], out
    status, out = http(engine.url, "/v1/completions", {"prompt": "ab", "max_tokens": -1})
    assert status == 400 and out["error"]["message"].startswith("max_tokens"), out


def test_v1_chat_completions_stream(engine):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "stream": True}
    req = urllib.request.Request(engine.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        lines = [ln.decode().strip() for ln in resp if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    full = http(engine.url, "/v1/chat/completions", {**body, "stream": False})[1]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == full["choices"][0]["message"]["content"]


def _streamed(url: str, route: str, body: dict) -> tuple[str, list[dict]]:
    """The text a stream's chunks add up to, and the chunks."""
    req = urllib.request.Request(url + route, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        chunks = [json.loads(ln[len(b"data: "):]) for ln in resp if ln.startswith(b"data: {")]
    parts = [c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content")) for c in chunks
             if c["choices"]]
    return "".join(parts), chunks


def test_openai_stream_holds_back_a_character_split_across_tokens(engine, monkeypatch):
    """A byte-level tokenizer decodes a token holding part of a UTF-8 character as U+FFFD until the rest arrives.
    Here the in-process engine's decode is replaced so that the first two generated tokens carry the three bytes of
    one character (the tiny tokenizer is character-level): the stream holds the partial character back, so its
    chunks add up to the non-streamed text instead of stopping at the split. Each token is emitted 20 ms after the
    one before, so the stream has a chunk per token (a stream read slower than its tokens gets fewer)."""
    sch = engine.scheduler
    orig = sch.decode
    one_chunk_per_token(monkeypatch, engine)
    messages = [{"role": "user", "content": "hello world"}]
    chat_text = sch.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    cases = [("/v1/completions", {"prompt": "hello world"}, sch.encode("hello world")),
             ("/v1/chat/completions", {"messages": messages}, sch.encode(chat_text, False))]
    for route, body, prompt_ids in cases:
        body = {**body, "max_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}
        first, second = generate(engine.url, input_ids=prompt_ids, sampling_params={
            "max_new_tokens": 2, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True})["output_ids"]
        assert first != second
        split = {first: "\u4f60".encode()[:2], second: "\u4f60".encode()[2:]}

        def decode(token_ids, skip_special_tokens=True):
            return b"".join(split.get(t, orig([t], skip_special_tokens).encode())
                            for t in token_ids).decode("utf-8", "replace")

        monkeypatch.setattr(sch, "decode", decode)
        full = http(engine.url, route, body)[1]["choices"][0]
        full = full.get("text", full.get("message", {}).get("content"))
        streamed, chunks = _streamed(engine.url, route, body)
        monkeypatch.setattr(sch, "decode", orig)
        assert full.startswith("\u4f60") and len(full) > 1 and streamed == full, (route, full, streamed)
        assert len(chunks) >= 12


def test_openai_routes_accept_what_clients_send_by_default(engine):
    """Fields a client or framework sends at their defaults (or that only label the request) are accepted; the same
    fields away from their defaults are 400s naming them (test_validate)."""
    defaults = {"user": "u", "n": 1, "seed": None, "stream": False, "stream_options": None, "parallel_tool_calls": True,
                "tool_choice": "none", "tools": [], "response_format": {"type": "text"}, "metadata": {"k": "v"},
                "store": False, "service_tier": "auto", "logit_bias": None, "frequency_penalty": 0,
                "presence_penalty": 0.0, "top_logprobs": None, "logprobs": False, "functions": None,
                "prompt_cache_key": "k", "separate_reasoning": True, "add_generation_prompt": True,
                "spaces_between_special_tokens": True, "include_stop_str_in_output": False, "echo": False,
                "rid": None, "extra_key": None, "cache_salt": "", "priority": 1, "return_hidden_states": False}
    status, out = http(engine.url, "/v1/chat/completions",
                       {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **defaults})
    assert status == 200, out
    completion = {k: v for k, v in defaults.items() if k not in ("top_logprobs", "add_generation_prompt")}
    status, out = http(engine.url, "/v1/completions", {"prompt": "ab", "max_tokens": 1, "best_of": 1, "suffix": None,
                                                       "logprobs": None, **completion})
    assert status == 200, out


def test_openai_rid_names_the_request_as_on_generate(engine):
    """SGLang's rid on the OpenAI routes: /abort_request by it ends that request, and a rid in flight is a 400."""
    body = {"prompt": "ab", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "rid": "oa-long"}
    t, box = in_thread(http, engine.url, "/v1/completions", body)
    deadline = time.monotonic() + 10
    while not http(engine.url, "/get_server_info")[1]["num_running_reqs"]:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.01)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "rid": "oa-long"}
    status, out = http(engine.url, "/v1/chat/completions", chat)
    assert status == 400 and "oa-long" in out["error"]["message"], out
    http(engine.url, "/abort_request", {"rid": "oa-long"})
    t.join(30)
    assert box["result"][1]["choices"][0]["finish_reason"] == "abort"
    assert http(engine.url, "/v1/chat/completions", chat)[0] == 200  # free again


def test_text_prompts_get_the_tokenizers_special_tokens_chat_prompts_do_not(engine, monkeypatch):
    """A text prompt (/generate text, /v1/completions prompt) is tokenized with the tokenizer's special tokens, as
    SGLang and /tokenize do (here a tokenizer that adds a BOS, made from the tiny one); a chat prompt is not: its
    template wrote what it needs."""
    from tokenizers import processors

    from slime_lite.tokenizer import load_tokenizer

    tok = load_tokenizer(engine.scheduler.tokenizer_path)
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                                         special_tokens=[("<|im_start|>", bos)])
    monkeypatch.setattr(engine.scheduler, "tokenizer", tok)
    expected = [bos] + tok.encode("ab", add_special_tokens=False)
    assert http(engine.url, "/tokenize", {"prompt": "ab"})[1]["tokens"] == expected
    out = generate(engine.url, text="ab", return_logprob=True, logprob_start_len=0, sampling_params={"max_new_tokens": 1})
    assert [t[1] for t in out["meta_info"]["input_token_logprobs"]] == expected
    out = http(engine.url, "/v1/completions", {"prompt": ["ab", "ab"], "max_tokens": 1})[1]
    assert out["usage"]["prompt_tokens"] == 2 * len(expected)
    messages = [{"role": "user", "content": "ab"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = http(engine.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})[1]
    assert out["usage"]["prompt_tokens"] == len(tok.encode(rendered, add_special_tokens=False))
    assert out["usage"]["prompt_tokens"] == http(engine.url, "/tokenize", {"messages": messages})[1]["count"]


def _sglang_protocol():
    """SGLang's OpenAI protocol models (tests/sglang_oracle.py), or None where the pinned sglang is not installed."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from sglang_oracle import openai_protocol, sglang_available

    return openai_protocol() if sglang_available() else None


def test_official_openai_client_models_logprobs_echo_and_streams(engine):
    """The official ``openai`` client against the engine: models.retrieve (and its 404), completions with top
    log-probs and echo, chat with top_logprobs, log-probs in stream chunks; each response is also one SGLang's own
    protocol models accept."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    name = engine.served_model_name
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")

    native = http(engine.url, "/generate", {"text": "1+1=", "return_logprob": True, "top_logprobs_num": 2,
                                            "sampling_params": {"max_new_tokens": 4, "temperature": 0}})[1]
    meta = native["meta_info"]
    done = client.completions.create(model=name, prompt="1+1=", max_tokens=4, temperature=0, logprobs=2, echo=True)
    lp = done.choices[0].logprobs
    assert done.choices[0].text == "1+1=" + native["text"]
    assert len(lp.tokens) == 4 + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # prompt first
    # equal to float32 rounding: a prompt found in the prefix cache (as the native call's may be, by the tests run
    # before in this engine) is prefilled in other shapes
    assert lp.token_logprobs[4:] == pytest.approx([t[0] for t in meta["output_token_logprobs"]], abs=1e-5)
    text = engine.scheduler.decode
    tops = [{text([t[1]], False): t[0] for t in row} for row in meta["output_top_logprobs"]]
    assert [list(d) for d in lp.top_logprobs[4:]] == [list(d) for d in tops]
    assert lp.top_logprobs[4:] == [pytest.approx(d, abs=1e-5) for d in tops]

    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=name, messages=messages, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)
    assert all(bytes(t.bytes) == t.token.encode() for c in content for t in (c, *c.top_logprobs))  # whole chars
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=3, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for ch in chunks for c in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else [])]
    assert [c.token for c in streamed] == [c.token for c in content]
    # the second request's prompt is in the prefix cache (prefilled in other shapes): equal to float32 rounding
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    text_chunks = list(client.completions.create(model=name, prompt="ab", max_tokens=3, temperature=0, logprobs=1,
                                                 stream=True))
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in text_chunks) == 3

    proto = _sglang_protocol()
    if proto is not None:
        proto.ModelCard.model_validate(client.models.retrieve(name).model_dump())
        proto.CompletionResponse.model_validate(done.model_dump())
        proto.ChatCompletionResponse.model_validate(chat.model_dump())
        for ch in chunks:
            proto.ChatCompletionStreamResponse.model_validate(ch.model_dump())
        for ch in text_chunks:
            proto.CompletionStreamResponse.model_validate(ch.model_dump())


def _sglang_chat_module():
    """SGLang's serving_chat module (tests/sglang_oracle.py), or None where the pinned sglang is not installed."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from sglang_oracle import sglang_available, sglang_module

    return sglang_module("sglang.srt.entrypoints.openai.serving_chat") if sglang_available() else None


def test_chat_stream_names_the_role_in_each_choices_first_chunk_only(engine, monkeypatch):
    """OpenAI's stream helper concatenates a delta's strings: a role in every chunk made it
    "assistantassistant..."."""
    openai = pytest.importorskip("openai")
    from openai.lib.streaming.chat import ChatCompletionStreamState

    one_chunk_per_token(monkeypatch, engine)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True, "n": 2}
    _, chunks = _streamed(engine.url, "/v1/chat/completions", body)
    for i in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == i]
        assert len(deltas) >= 2 and deltas[0]["role"] == "assistant"
        assert all("role" not in d for d in deltas[1:]), deltas
    state = ChatCompletionStreamState()
    for c in chunks:
        if c["choices"][0]["index"] == 0 and c["choices"][0]["finish_reason"] is None:
            state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(c))
    assert state.current_completion_snapshot.choices[0].message.role == "assistant"


TOOL_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
                 "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
                 "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_assistant_tool_call_arguments_are_parsed_before_the_template_renders(engine):
    """Clients send an assistant's ``tool_calls[].function.arguments`` as a JSON string; SGLang parses it into an
    object before the template renders, so ``| tojson`` writes the object (not a quoted string): the same prompt
    here on /tokenize and the chat route. Arguments that are not a JSON object are a 400 naming them."""
    tok = engine.scheduler.tokenizer
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    msgs = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    expected = json.loads(json.dumps(msgs))
    chat = _sglang_chat_module()
    for m in expected:  # SGLang's own normalization where it is installed
        if chat is not None:
            chat.normalize_assistant_tool_call_arguments(m)
        elif m.get("tool_calls"):
            m["tool_calls"][0]["function"]["arguments"] = {"a": 1, "b": 2}
    assert expected[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    template = tok.chat_template
    tok.chat_template = TOOL_TEMPLATE
    try:
        rendered = tok.apply_chat_template(expected, tokenize=False, add_generation_prompt=True)
        ours = http(engine.url, "/tokenize", {"messages": msgs})[1]
        out = http(engine.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})[1]
        bad = [http(engine.url, "/v1/chat/completions", {"messages": [msgs[0], {**msgs[1], "tool_calls": [
            {**call, "function": {"name": "add", "arguments": args}}]}], "max_tokens": 1}) for args in ("{a", "[1]")]
    finally:
        tok.chat_template = template
    assert '"arguments": {"a": 1, "b": 2}' in rendered
    assert ours["tokens"] == tok.encode(rendered, add_special_tokens=False)
    assert out["usage"]["prompt_tokens"] == ours["count"]
    for status, err in bad:
        assert status == 400 and "messages[1].tool_calls[0].function.arguments" in err["error"]["message"], err


def test_logprob_counts_are_read_as_sglang_reads_them(engine):
    """``top_logprobs: true`` is 1 and ``top_logprobs`` / completions ``logprobs`` take an integral float, as the
    other integer fields do (SGLang's pydantic models read them so); 2.5 is a 400 naming the field."""
    proto = _sglang_protocol()
    msgs = [{"role": "user", "content": "hi"}]
    for value, k in ((True, 1), (2.0, 2)):
        body = {"messages": msgs, "max_tokens": 2, "logprobs": True, "top_logprobs": value}
        status, out = http(engine.url, "/v1/chat/completions", body)
        assert status == 200 and [len(t["top_logprobs"]) for t in out["choices"][0]["logprobs"]["content"]] == [k, k]
        if proto is not None:
            assert proto.ChatCompletionRequest.model_validate({"model": "m", **body}).top_logprobs == k
    body = {"prompt": "ab", "max_tokens": 2, "logprobs": 2.0}
    status, out = http(engine.url, "/v1/completions", body)
    assert status == 200 and [len(t) for t in out["choices"][0]["logprobs"]["top_logprobs"]] == [2, 2]
    if proto is not None:
        assert proto.CompletionRequest.model_validate({"model": "m", **body}).logprobs == 2
    for route, extra in (("/v1/completions", {"prompt": "ab", "logprobs": 2.5}),
                         ("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 2.5})):
        status, out = http(engine.url, route, {**extra, "max_tokens": 2})
        field = "logprobs" if "prompt" in extra else "top_logprobs"
        assert status == 400 and out["error"]["message"].startswith(f"{field}=2.5"), out


def test_completion_text_offsets_are_positions_in_the_choice_text(engine, monkeypatch):
    """``text_offset[k]`` is where ``tokens[k]`` starts in the choice's text: after the echoed prompt (whose own
    tokens, with ``logprobs`` > 0, start at 0), and in a stream after the characters earlier chunks sent."""
    def at_offsets(text, lp):
        return [text[o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])]

    body = {"prompt": "abcdef", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for extra in ({"echo": True, "logprobs": 0}, {"echo": True, "logprobs": 1}, {"logprobs": 0}):
        choice = http(engine.url, "/v1/completions", {**body, **extra})[1]["choices"][0]
        assert at_offsets(choice["text"], choice["logprobs"]) == choice["logprobs"]["tokens"], (extra, choice)
        assert choice["logprobs"]["text_offset"][-4] == (6 if extra.get("echo") else 0)
    one_chunk_per_token(monkeypatch, engine)
    for extra in ({"logprobs": 0}, {"echo": True, "logprobs": 1}):
        text, chunks = _streamed(engine.url, "/v1/completions", {**body, **extra})
        lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]["tokens"]]
        assert len(lps) >= 2
        for lp in lps:
            assert at_offsets(text, lp) == lp["tokens"], (extra, text, lps)
        assert lps[-1]["text_offset"][-1] == len(text) - 1


@pytest.mark.parametrize("route,prompt", [("/v1/completions", {"prompt": "ab"}),
                                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_stream_options_continuous_usage_stats_puts_usage_on_every_chunk(engine, monkeypatch, route, prompt):
    """SGLang's ``stream_options.continuous_usage_stats``: each chunk carries its choice's usage so far (its prompt,
    its tokens until then); ``include_usage`` still ends the stream with the usage of all choices."""
    one_chunk_per_token(monkeypatch, engine)
    body = {**prompt, "max_tokens": 3, "ignore_eos": True, "n": 2, "logprobs": True if "messages" in prompt else 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    _, chunks = _streamed(engine.url, route, body)
    final = http(engine.url, route, {**body, "stream_options": None})[1]["usage"]
    seen = [0, 0]
    for c in chunks[:-1]:
        lp = c["choices"][0]["logprobs"]
        i, new = c["choices"][0]["index"], len(lp["content"] if "content" in lp else lp["tokens"])
        seen[i] += new
        assert c["usage"] == {"prompt_tokens": final["prompt_tokens"], "completion_tokens": seen[i],
                              "total_tokens": final["prompt_tokens"] + seen[i]}, c  # n samples of one prompt
    assert seen == [3, 3] and len(chunks) > 3 and chunks[-1]["choices"] == [] and chunks[-1]["usage"] == final
    proto = _sglang_protocol()
    if proto is not None:
        model = proto.ChatCompletionStreamResponse if "messages" in prompt else proto.CompletionStreamResponse
        for c in chunks[:-1]:
            assert model.model_validate(c).usage.total_tokens == c["usage"]["total_tokens"]
    status, out = http(engine.url, route, {**body, "stream_options": {"continuous_usage_stats": "yes"}})
    assert status == 400 and "stream_options.continuous_usage_stats" in out["error"]["message"], out


@pytest.mark.parametrize("route,extra,field", [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
])
def test_openai_fields_the_engine_does_not_implement_are_a_400(engine, route, extra, field):
    prompt = {"prompt": "ab"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}
    body = {**prompt, "max_tokens": 2, **extra}  # the other route's input field would be refused too
    status, out = http(engine.url, route, body)
    assert status == 400 and field in out["error"]["message"], out


def test_serve_rejects_unknown_flags_and_tp_size(tiny_model_dir):
    with pytest.raises(SlimeLiteError, match="--enable-foo"):
        main(["--model-path", str(tiny_model_dir), "--enable-foo", "1"])
    with pytest.raises(SlimeLiteError, match="--tp-size 2"):
        main(["--model-path", str(tiny_model_dir), "--tp-size", "2"])
    assert main(["--help"]) == 0
    with pytest.raises(SlimeLiteError, match="--cuda-graph-max-bs 0"):
        main(["--model-path", str(tiny_model_dir), "--cuda-graph-max-bs", "0", "--port", "0"])
    with pytest.raises(SlimeLiteError, match="--enable-torch-compile .*this engine runs on CPU"):
        main(["--model-path", str(tiny_model_dir), "--device", "cpu", "--enable-torch-compile", "--port", "0"])
    with pytest.raises(SlimeLiteError, match="--max-request-bytes 0"):
        main(["--model-path", str(tiny_model_dir), "--max-request-bytes", "0", "--port", "0"])


def test_serve_refuses_a_log_level_it_does_not_know(capsys):
    """It served at INFO before; `slime-lite train` refused the same value."""
    assert main(["--model-path", "m", "--log-level", "verbose", "--port", "0"]) == 2
    assert "--log-level: invalid choice: 'VERBOSE'" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_command_starts_answers_and_stops_on_sigterm(tiny_model_dir):
    cmd = [sys.executable, "-m", "slime_lite.cli", "serve", "--model-path", str(tiny_model_dir), "--port", "0",
           "--device", "cpu", "--mem-fraction-static", "0.5", "--random-seed", "3", "--disable-radix-cache",
           "--enable-memory-saver"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = None
        for line in proc.stdout:
            if "engine ready at " in line:
                url = line.strip().rsplit(" ", 1)[1]
                break
        assert url, "server never said it was ready"
        assert http(url, "/health")[0] == 200
        for _ in range(2):  # --disable-radix-cache: the repeat reuses nothing
            out = http(url, "/generate", {"text": "ab", "sampling_params": {"max_new_tokens": 3}})[1]
            assert out["meta_info"]["completion_tokens"] == 3 and out["meta_info"]["cached_tokens"] == 0
        info = http(url, "/get_server_info")[1]
        assert info["random_seed"] == 3 and info["disable_radix_cache"] is True and info["enable_memory_saver"] is True
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_chat_takes_the_models_generation_config_for_the_sampling_fields_it_leaves_out(tiny_model_dir, tmp_path,
                                                                                       caplog):
    """As SGLang's chat route (its sampling defaults "model"): generation_config.json's top_k 1 makes a chat request
    without sampling fields greedy; a field the request gives wins; completions keep OpenAI's defaults."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 1, "top_p": 0.95,
                                                               "repetition_penalty": 1.05}))
    with caplog.at_level("INFO", logger="slime_lite.engine.openai_api"):
        server = start_engine(model)
    try:
        assert "repetition_penalty 1.05 is not applied to chat completions" in caplog.text
        body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 8, "n": 4}
        texts = {c["message"]["content"] for c in http(server.url, "/v1/chat/completions", body)[1]["choices"]}
        assert len(texts) == 1  # greedy: top_k 1
        texts = {c["message"]["content"] for c in http(server.url, "/v1/chat/completions",
                                                        dict(body, top_k=-1, temperature=1.0))[1]["choices"]}
        assert len(texts) > 1  # the request's values win
        out = http(server.url, "/v1/completions", {"prompt": "2+2?", "max_tokens": 8, "n": 4})[1]
        assert len({c["text"] for c in out["choices"]}) > 1  # completions: OpenAI's defaults
    finally:
        server.stop()
