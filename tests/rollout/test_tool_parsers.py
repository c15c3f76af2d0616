"""Tool calls in the formats chat models write them (--tool-call-parser: qwen25, llama3, pythonic, qwen3_coder),
the format picked from the chat template, and the agent endpoint's ``tool_choice`` ("none" hides the tools and
parses nothing, a named function shows only that tool, bad choices are a 400 naming the field)."""

from __future__ import annotations

import json

import openai
import pytest

from slime_lite.args import build_parser
from slime_lite.rollout.tool_calls import PARSER_CHOICES, detect_parser, parse_tool_calls
from slime_lite.tokenizer import build_tokenizer
from tests.rollout.test_agent_endpoint import _client, run_agent


def _tool(name, **props):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in props.items()}}}}


def test_llama3_json_calls_after_the_python_tag_or_alone():
    two = parse_tool_calls('Let me. <|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
                           '{"name": "g", "arguments": "{\\"b\\": [2]}"}', parser="llama3")
    assert two.content == "Let me." and two.malformed == 0
    assert two.calls == [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": [2]}}]
    alone = parse_tool_calls('{"name": "f", "parameters": {}}<|eot_id|>', strip=("<|eot_id|>",), parser="llama3")
    assert alone.calls == [{"name": "f", "arguments": {}}] and alone.content == ""
    answer = parse_tool_calls('{"answer": 3}', parser="llama3")  # JSON, but no call: content, not malformed
    assert answer.calls == [] and answer.content == '{"answer": 3}' and answer.malformed == 0
    for bad in ('<|python_tag|>{"name": "f", "parameters": {"a": }', '{"name": "f", "parameters": [1]}'):
        parsed = parse_tool_calls("x " + bad if bad.startswith("<") else bad, parser="llama3")
        assert parsed.calls == [] and parsed.malformed == 1 and bad in parsed.content  # kept as written
    cut = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "para', parser="llama3")
    assert len(cut.calls) == 1 and cut.malformed == 1 and cut.content == '{"name": "g", "para'
    plain = parse_tool_calls("no call here", parser="llama3")
    assert plain.calls == [] and plain.malformed == 0 and plain.content == "no call here"


def test_pythonic_calls_with_literal_keyword_arguments_only():
    parsed = parse_tool_calls('Sure. <|python_start|>[get(city="S]F(", n=3), a.b(x={"k": [1, None]})]'
                              '<|python_end|> done', parser="pythonic")
    assert parsed.calls == [{"name": "get", "arguments": {"city": "S]F(", "n": 3}},
                            {"name": "a.b", "arguments": {"x": {"k": [1, None]}}}]
    assert parsed.content == "Sure.  done" and parsed.malformed == 0
    for bad in ('[f(1)]', '[f(x=g())]', '[f(x={1, 2})]', '[f(**k)]', '[f(x=1)', '[f(x=1), 3]'):
        got = parse_tool_calls("try " + bad, parser="pythonic")
        assert got.calls == [] and got.malformed == 1 and got.content == "try " + bad, bad
    assert parse_tool_calls("a list [1, 2] and f(x)", parser="pythonic").malformed == 0


def test_qwen3_coder_xml_values_typed_by_the_tools_schema():
    tools = [_tool("w", city="string", days="integer", t="number", ok="boolean", opts="object", ids="array",
                   code="string")]
    text = ("I will.\n<tool_call>\n<function=w>\n<parameter=city>\n123\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=t>\n2.5\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n<parameter=opts>\n"
            "{'a': 1}\n</parameter>\n<parameter=ids>\n[1, 2]\n</parameter>\n<parameter=code>\nx = 1\n\ny = 2\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=other>\n<parameter=n>\n7\n"
            "<parameter=s>\nnull\n</function>\n</tool_call>")
    parsed = parse_tool_calls(text, parser="qwen3_coder", tools=tools)
    assert parsed.content == "I will." and parsed.malformed == 0
    assert parsed.calls[0] == {"name": "w", "arguments": {"city": "123", "days": 3, "t": 2.5, "ok": True,
                                                          "opts": {"a": 1}, "ids": [1, 2], "code": "x = 1\n\ny = 2"}}
    # a function the tools do not describe: values read as JSON where they are JSON; an unclosed parameter ends at
    # the next one or at </function>
    assert parsed.calls[1] == {"name": "other", "arguments": {"n": 7, "s": None}}
    wrong = parse_tool_calls("<tool_call><function=w><parameter=days>three</parameter></function></tool_call>",
                             parser="qwen3_coder", tools=tools)
    assert wrong.calls == [{"name": "w", "arguments": {"days": "three"}}]  # as written: the tool sees the mistake
    for bad in ("<tool_call>\n<parameter=a>1</parameter>\n</tool_call>", "<tool_call>\n<function=w>\n"):
        got = parse_tool_calls("x " + bad, parser="qwen3_coder", tools=tools)
        assert got.calls == [] and got.malformed == 1 and got.content == ("x " + bad).strip()


def test_the_format_is_picked_from_the_chat_template_and_the_flag_names_it():
    tok = build_tokenizer()
    assert detect_parser(tok) == "qwen25"  # the tiny model's template writes <tool_call>{json}</tool_call>
    for template, name in (("{{ '<tool_call>\\n<function=' + name + '>' }}", "qwen3_coder"),
                           ("{{ '<|python_tag|>' }}{{ tool_call | tojson }}", "llama3"),
                           ("{{ '<|python_start|>' }}", "pythonic"), ("{{ messages }}", "qwen25")):
        tok.chat_template = template
        assert detect_parser(tok) == name
    tok.chat_template = {"default": "x", "tool_use": "{{ '<|python_tag|>' }}"}  # named templates
    assert detect_parser(tok) == "llama3"
    assert parse_tool_calls("<tool_call>{}</tool_call>", parser=None).calls == []  # None: no calls parsed
    parser = build_parser()
    assert parser.parse_args(["--tool-call-parser", "llama3"]).tool_call_parser == "llama3"
    assert parser.parse_args([]).tool_call_parser == "auto" and {"qwen", "hermes", "pythonic"} <= set(PARSER_CHOICES)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "mistral"])


# A Llama-3-like template on the tiny tokenizer: tools listed up front, a call written as JSON after the python tag
LLAMA_LIKE = ("{% if tools %}[tools:{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
              "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}<|python_tag|>"
              '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}'
              "<|im_end|>{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def test_the_endpoint_reads_calls_in_the_templates_format_and_strips_the_stop_token_it_matched():
    """Llama-3-like: the format comes from the chat template; the turn the engine stopped at a stop token other
    than the end of turn (Llama's <|eom_id|> after a call; <|im_start|> stands in for it on the tiny tokenizer)
    returns no trace of it in the reply."""
    seen = []

    async def agent(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "2*3="}]
        reply = (await client.chat.completions.create(model="m", messages=messages,
                                                      tools=[_tool("calc", expr="string")])).choices[0]
        seen.append(reply)
        messages += [reply.message, {"role": "tool", "tool_call_id": reply.message.tool_calls[0].id, "content": "6"}]
        seen.append((await client.chat.completions.create(model="m", messages=messages)).choices[0])

    box = {}
    eom = build_tokenizer().convert_tokens_to_ids("<|im_start|>")
    sample = run_agent([('<|python_tag|>{"name": "calc", "parameters": {"expr": "2*3"}}<|im_start|>',
                         {"type": "stop", "matched": eom}), "6<|im_end|>"], agent, chat_template=LLAMA_LIKE,
                       engine_box=box)
    first, second = seen
    call, = first.message.tool_calls
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expr": "2*3"}
    assert second.message.content == "6" and sample.metadata["tool_calls"] == 1
    assert sample.metadata["malformed_tool_calls"] == 0 and sample.metadata["agent_calls"] == 2
    prompt = build_tokenizer().decode(box["engine"].seen[0]["input_ids"])
    assert prompt == "[tools:calc;][user]2*3=<|im_end|>[assistant]"


def test_tool_choice_none_hides_the_tools_and_parses_nothing_a_named_one_shows_only_its_tool():
    replies, errors = [], []
    tools = [_tool("calc", expr="string"), _tool("search", q="string")]

    async def agent(base_url, task):
        client = _client(base_url)
        messages = [{"role": "user", "content": "q"}]
        for choice in ("none", {"type": "function", "function": {"name": "search"}}):
            replies.append((await client.chat.completions.create(model="m", messages=messages, tools=tools,
                                                                 tool_choice=choice)).choices[0])
        for tools_sent, choice in ((tools, {"type": "function", "function": {"name": "nope"}}), (None, "required"),
                                   (tools, "always"), ([1], "auto")):
            try:
                await client.chat.completions.create(model="m", messages=messages, tool_choice=choice,
                                                     **({"tools": tools_sent} if tools_sent else {}))
            except openai.BadRequestError as exc:
                errors.append(exc.message)

    call = '<|python_tag|>{"name": "search", "parameters": {"q": "x"}}'
    box = {}
    sample = run_agent([call + "<|im_end|>", call + "<|im_end|>"], agent, chat_template=LLAMA_LIKE, engine_box=box)
    unparsed, named = replies
    assert unparsed.finish_reason == "stop" and unparsed.message.tool_calls is None
    assert unparsed.message.content == call  # "none": the text as the model wrote it, no call
    assert named.finish_reason == "tool_calls" and named.message.tool_calls[0].function.name == "search"
    first, second = (build_tokenizer().decode(b["input_ids"]) for b in box["engine"].seen)
    assert first.startswith("[user]") and second.startswith("[tools:search;][user]")
    assert len(box["engine"].seen) == 2 and len(errors) == 4  # refused calls never reach the engine
    assert "'nope', which is not in tools" in errors[0] and 'tool_choice "required" needs tools' in errors[1]
    assert "tool_choice=" in errors[2] and "always" in errors[2] and "must be" in errors[2]
    assert "tools must be a list" in errors[3]
    assert [s.metadata["agent_calls"] for s in sample] == [1, 1]  # two calls from the same history: two segments


def test_qwen3_coder_calls_through_the_endpoint_are_typed_by_the_requests_tools():
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
                "<tool_call>\n<function={{ c.function.name }}>\n{% for k, v in c.function.arguments.items() %}"
                "<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    got = []

    async def agent(base_url, task):
        client = _client(base_url)
        got.append((await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "q"}],
            tools=[_tool("repeat", text="string", times="integer")])).choices[0])

    run_agent(["<tool_call>\n<function=repeat>\n<parameter=text>\n42\n</parameter>\n<parameter=times>\n3\n"
               "</parameter>\n</function>\n</tool_call><|im_end|>"], agent, chat_template=template)
    call, = got[0].message.tool_calls
    assert call.function.name == "repeat" and json.loads(call.function.arguments) == {"text": "42", "times": 3}
