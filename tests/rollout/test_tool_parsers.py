"""Tool calls in the formats chat models write them (--tool-call-parser: qwen25, llama3, pythonic, qwen3_coder),
the format picked from the chat template, and the agent endpoint's ``tool_choice`` ("none" hides the tools and
parses nothing, a named function shows only that tool, bad choices are a 400 naming the field)."""

from __future__ import annotations

import json

import openai
import pytest

from slime_lite.args import build_parser
from slime_lite.rollout.tool_calls import (PARSER_CHOICES, REASONING_PARSERS, detect_parser, parse_tool_calls,
                                          split_reasoning)
from slime_lite.tokenizer import build_tokenizer
from tests import sglang_oracle as oracle
from tests.rollout.test_agent_endpoint import CALC, _client, run_agent


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
    for bad in ('<|python_tag|>{"name": "f", "parameters": {"a": }', '<|python_tag|>{"name": "f", "parameters": [1]}'):
        parsed = parse_tool_calls("x " + bad, parser="llama3")
        assert parsed.calls == [] and parsed.malformed == 1 and bad in parsed.content  # kept as written
    # untagged JSON that is no call of a known function is an answer: kept, not counted
    for answer, tools in (('{"name": "f", "parameters": [1]}', None), ('{"name": "Ada", "born": 1815}', [_tool("f")])):
        parsed = parse_tool_calls(answer, parser="llama3", tools=tools)
        assert parsed.calls == [] and parsed.malformed == 0 and parsed.content == answer
    unknown = parse_tool_calls('<|python_tag|>{"name": "g", "parameters": {}}', parser="llama3", tools=[_tool("f")])
    assert unknown.calls == [] and unknown.malformed == 1  # tagged, but no tool of the request: kept as text
    nan = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"x": NaN}}', parser="llama3")
    assert nan.calls == [] and nan.malformed == 1  # NaN is no JSON an agent's parser reads
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
    tools = [_tool("f")]
    code = parse_tool_calls("Use `[dict(a=1)]`, as [len(s) for s in xs] does; now [f(n=3)]", parser="pythonic",
                            tools=tools)  # lists that are no call of a tool are text, and the call after them read
    assert code.calls == [{"name": "f", "arguments": {"n": 3}}] and code.malformed == 0
    assert code.content == "Use `[dict(a=1)]`, as [len(s) for s in xs] does; now"
    for bad in ('[f(1)]', '[f(x=g())]', '[f(x={1, 2})]', '[f(**k)]', '[f(x=1)', '[f(x=1), 3]'):
        got = parse_tool_calls("try " + bad, parser="pythonic")
        assert got.calls == [] and got.malformed == 1 and got.content == "try " + bad, bad
    assert parse_tool_calls("a list [1, 2] and f(x)", parser="pythonic").malformed == 0


def test_qwen3_coder_xml_values_typed_by_the_tools_schema():
    tools = [_tool("w", city="string", days="integer", t="number", ok="boolean", opts="object", ids="array",
                   code="string", big="number", neg="integer"),
             {"type": "function", "function": {"name": "v", "parameters": {"properties": {
                 "maybe": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "n": {"type": ["integer", "null"]},
                 "pick": {"enum": ["1", "2"]}, "free": {"description": "no type"}}}}}]
    text = ("I will.\n<tool_call>\n<function=w>\n<parameter=city>\n123\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=t>\n2.5\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n<parameter=opts>\n"
            "{'a': 1}\n</parameter>\n<parameter=ids>\n[1, 2]\n</parameter>\n<parameter=code>\nx = 1\n\ny = 2\n"
            "</parameter>\n<parameter=big>\n9007199254740993\n</parameter>\n<parameter=neg>\n-4\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=v>\n<parameter=maybe>\n12\n<parameter=n>\nnull\n"
            "<parameter=pick>\n1\n</parameter>\n<parameter=free>\ntrue\n</parameter>\n</function>\n"
            "<function=w>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>")
    parsed = parse_tool_calls(text, parser="qwen3_coder", tools=tools)
    assert parsed.content == "I will." and parsed.malformed == 0
    assert parsed.calls[0] == {"name": "w", "arguments": {
        "city": "123", "days": 3, "t": 2.5, "ok": True, "opts": {"a": 1}, "ids": [1, 2], "code": "x = 1\n\ny = 2",
        "big": 9007199254740993, "neg": -4}}
    # a string in any branch stays a string; an unclosed parameter ends at the next one; no type: as written;
    # two functions in one block are two calls; a value that does not read as its type is kept as written
    assert parsed.calls[1:] == [{"name": "v", "arguments": {"maybe": "12", "n": None, "pick": "1", "free": "true"}},
                                {"name": "w", "arguments": {"days": "three"}}]
    for bad in ("<tool_call>\n<parameter=a>1</parameter>\n</tool_call>",  # no function
                "<tool_call>\n<function=w>\n",  # never closed
                "<tool_call>\n<function=other>\n</function>\n</tool_call>",  # no tool of the request
                "<tool_call>\nSure:\n<function=w>\n</function>\n</tool_call>",  # text outside the function
                "<tool_call><function=w><parameter=t>\nnan\n</parameter></function></tool_call>"):  # kept, no NaN
        got = parse_tool_calls("x " + bad, parser="qwen3_coder", tools=tools)
        if "nan" in bad:
            assert got.calls == [{"name": "w", "arguments": {"t": "nan"}}]
            continue
        assert got.calls == [] and got.malformed == 1 and got.content == ("x " + bad).strip(), bad


def test_a_mention_of_the_tag_before_a_call_is_text_and_adversarial_text_parses_fast():
    mention = parse_tool_calls('<think>use a <tool_call> block</think>\n<tool_call>{"name": "f", "arguments": {}}'
                               "</tool_call>", parser="qwen25")
    assert mention.calls == [{"name": "f", "arguments": {}}] and mention.malformed == 0
    assert mention.content == "<think>use a <tool_call> block</think>"
    import time
    for parser, text in (("qwen3_coder", "<tool_call><function=w>" + "<parameter=" * 20000),
                         ("qwen25", "<tool_call>" * 20000), ("pythonic", "[f(" * 20000),
                         ("llama3", "<|python_tag|>" + "[" * 20000), ("glm45", "<tool_call>w" + "<arg_key>" * 20000),
                         ("glm45", "<tool_call>w" + "<arg_key>a</arg_key><arg_value>" * 20000 + "</tool_call>")):
        t0 = time.perf_counter()
        got = parse_tool_calls(text, parser=parser, tools=[_tool("w"), _tool("f")])
        assert got.calls == [] and time.perf_counter() - t0 < 5, parser  # no exception, no quadratic blow-up


def _sglang_calls(parser, text, tools):
    """SGLang's own parser (FunctionCallParser.parse_non_stream) on ``text``: its calls as ours are written."""
    proto = oracle.openai_protocol()
    module = oracle.sglang_module("sglang.srt.function_call.function_call_parser")
    _, calls = module.FunctionCallParser([proto.Tool.model_validate(t) for t in tools], parser).parse_non_stream(text)
    return [{"name": c.name, "arguments": json.loads(c.parameters)} for c in calls]


def test_json_blocks_read_a_list_tags_inside_strings_parameters_first_and_hermes_open_tail_as_sglang():
    tools = [_tool("calc", expr="string"), _tool("search", q="string")]
    calc, search = {"name": "calc", "arguments": {"expr": "1"}}, {"name": "search", "arguments": {"q": "b"}}
    cases = [  # (parser, text, its calls, its content)
        ("qwen25", '<tool_call>\n[{"name": "calc", "arguments": {"expr": "1"}}, '
                   '{"name": "search", "arguments": {"q": "b"}}]\n</tool_call>', [calc, search], ""),
        ("hermes", 'ok<tool_call>[{"name": "calc", "arguments": {"expr": "1"}}, '
                   '{"name": "search", "arguments": {"q": "b"}}]</tool_call>', [calc, search], "ok"),
        ("qwen25", '<tool_call>\n{"name": "search", "arguments": {"q": "what <tool_call> means"}}\n</tool_call>',
         [{"name": "search", "arguments": {"q": "what <tool_call> means"}}], ""),
        ("qwen25", '<tool_call>\n{"name": "search", "arguments": {"q": "a </tool_call> b"}}\n</tool_call>',
         [{"name": "search", "arguments": {"q": "a </tool_call> b"}}], ""),
        ("qwen25", '<tool_call>\n{"name": "calc", "arguments": {"expr": "2"}, "parameters": {"expr": "1"}}\n'
                   "</tool_call>", [calc], ""),
        ("hermes", 'text<tool_call>{"name": "calc", "arguments": {"expr": "1"}}', [calc], "text"),
    ]
    for parser, text, calls, content in cases:
        got = parse_tool_calls(text, parser=parser, tools=tools)
        assert (got.calls, got.content, got.malformed) == (calls, content, 0), text
        assert _sglang_calls(parser, text, tools) == calls, text
    # kept as text and counted, as before: qwen25's call never closed, a list holding no call of a tool, a block
    # whose JSON goes on past the call; a mention of the tag before a call is text
    for text in ('text<tool_call>{"name": "calc", "arguments": {"expr": "1"}}',
                 '<tool_call>[{"name": "calc", "arguments": {}}, {"name": "nope", "arguments": {}}]</tool_call>',
                 '<tool_call>[]</tool_call>', '<tool_call>{"name": "calc", "arguments": {}} x</tool_call>'):
        got = parse_tool_calls(text, parser="qwen25", tools=tools)
        assert (got.calls, got.content, got.malformed) == ([], text, 1), text
    mention = parse_tool_calls('a <tool_call> "tag" <tool_call>{"name": "calc", "arguments": {"expr": "1"}}'
                               "</tool_call>", parser="hermes", tools=tools)
    assert (mention.calls, mention.content, mention.malformed) == ([calc], 'a <tool_call> "tag"', 0)
    unclosed = '<tool_call>{"name": "search", "arguments": {"q": "b"}}\n'  # a call whose closing tag never came
    got = parse_tool_calls(unclosed + '<tool_call>{"name": "calc", "arguments": {"expr": "1"}}</tool_call>',
                           parser="qwen25", tools=tools)
    assert (got.calls, got.content, got.malformed) == ([calc], unclosed.strip(), 1)
    import time
    # (the last: 20,000 whole calls none of them closed, each one cut short)
    for text, bad in (("<tool_call>[" + '"<tool_call>[", ' * 20000, 1),
                      ("<tool_call>" + "[" * 100000 + "</tool_call>", 1),
                      ('<tool_call>{"name": "calc", "arguments": {}} ' * 20000, 20000)):
        t0 = time.perf_counter()
        got = parse_tool_calls(text, parser="qwen25", tools=tools)
        assert got.calls == [] and got.malformed == bad and time.perf_counter() - t0 < 5  # no quadratic blow-up


def test_glm45_arg_key_value_pairs():
    tools = [_tool("w", city="string", days="integer")]
    parsed = parse_tool_calls("ok<tool_call>w\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
                              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>extra</arg_key>"
                              '<arg_value>{"a": [1]}</arg_value>\n</tool_call><tool_call>w</tool_call>',
                              parser="glm", tools=tools)
    assert parsed.calls == [{"name": "w", "arguments": {"city": "北京", "days": 3, "extra": {"a": [1]}}},
                            {"name": "w", "arguments": {}}]
    assert parsed.content == "ok" and parsed.malformed == 0
    bad = parse_tool_calls("<tool_call>w\n<arg_key>a</arg_key>stray</tool_call>", parser="glm45", tools=tools)
    assert bad.calls == [] and bad.malformed == 1


def test_calls_real_models_write_at_the_edges_of_each_format_parse_as_sglang_parses_them():
    """GLM-4.5 writing the two characters \\n between its parts and a value as escaped JSON; a Qwen3-Coder value
    holding CRLF line breaks or quoting the format's own tags (a coding agent's edit), or a call whose closing tag a
    stop string took; Llama 3's second call after another <|python_tag|> or a comma. Each is the call SGLang's own
    parser reads (content and the malformed count are ours)."""
    todo = {"type": "function", "function": {"name": "todo_write", "parameters": {"type": "object", "properties": {
        "todos": {"type": "array"}, "n": {"type": "integer"}}}}}
    tools = [_tool("w", city="string", days="integer"), todo]
    w = '{"name": "w", "parameters": {"city": "%s"}}'
    cases = [  # (parser, text, its calls)
        ("glm45", '<tool_call>todo_write\\n<arg_key>todos</arg_key>\\n<arg_value>[{\\"id\\": \\"1\\"}]</arg_value>'
                  "\n<arg_key>n</arg_key><arg_value>2</arg_value>\n</tool_call>",
         [{"name": "todo_write", "arguments": {"todos": [{"id": "1"}], "n": 2}}]),
        ("qwen3_coder", "<tool_call>\n<function=w>\n<parameter=city>\nline1\r\nline2\n</parameter>\n</function>\n"
                        "</tool_call>", [{"name": "w", "arguments": {"city": "line1\r\nline2"}}]),
        ("qwen3_coder", "<tool_call>\n<function=w>\n<parameter=city>\nthe <tool_call> tag, <function=x> too\n"
                        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
         [{"name": "w", "arguments": {"city": "the <tool_call> tag, <function=x> too", "days": 2}}]),
        ("qwen3_coder", "<tool_call>\n<function=w>\n<parameter=city>\nSF\n</parameter>\n</function>",
         [{"name": "w", "arguments": {"city": "SF"}}]),
        ("llama3", "<|python_tag|>" + w % "a" + "<|python_tag|>" + w % "b",
         [{"name": "w", "arguments": {"city": "a"}}, {"name": "w", "arguments": {"city": "b"}}]),
        ("llama3", "<|python_tag|>" + w % "a" + ", " + w % "b",
         [{"name": "w", "arguments": {"city": "a"}}, {"name": "w", "arguments": {"city": "b"}}]),
    ]
    for parser, text, calls in cases:
        got = parse_tool_calls(text, parser=parser, tools=tools)
        assert (got.calls, got.content, got.malformed) == (calls, "", 0), text
        assert _sglang_calls(parser, text, tools) == calls, text
    # a call never closed whose function is not closed either is still cut short; text after the tag stays text
    for text in ("<tool_call>\n<function=w>\n<parameter=city>\nSF", "<tool_call>\n<function=w>\n</function>\nmore"):
        got = parse_tool_calls(text, parser="qwen3_coder", tools=tools)
        assert (got.calls, got.content, got.malformed) == ([], text, 1), text


def test_the_format_is_picked_from_the_chat_template_and_the_flag_names_it():
    tok = build_tokenizer()
    assert detect_parser(tok) == "qwen25"  # the tiny model's template writes <tool_call>{json}</tool_call>
    for template, name in (("{{ '<tool_call>\\n<function=' + name + '>' }}", "qwen3_coder"),
                           ("{{ '<|python_tag|>' }}{{ tool_call | tojson }}", "llama3"),
                           ('{{ \'{"name": "\' + name + \'", "parameters": \' }}', "llama3"),  # Llama 3.2
                           ("{{ '<tool_call>' + name }}<arg_key>{{ k }}</arg_key>", "glm45"),
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
        seen.append((await client.chat.completions.create(model="m", messages=messages,  # the same tools: extends
                                                          tools=[_tool("calc", expr="string")])).choices[0])

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


def test_reasoning_is_split_from_the_content_as_sglangs_reasoning_parsers_split_it():
    reader = oracle.sglang_module("sglang.srt.parser.reasoning_parser").ReasoningParser
    for parser in REASONING_PARSERS:
        for text in ("<think>a</think>b", "plain", "x<think>a</think>b", "<think>a <tool_call>{}</tool_call>",
                     "a</think>b", "<think><think>a</think>\n\nb", "<think>cut short", "<think></think>b"):
            reasoning, content = split_reasoning(text, parser)
            assert (reasoning or "", content) == reader(parser, stream_reasoning=False).parse_non_stream(text), text
    assert split_reasoning("<think>a</think>b", None) == (None, "<think>a</think>b")  # no parser: all content


def test_a_thinking_models_reply_has_its_reasoning_apart_and_calls_only_from_its_content():
    """--reasoning-parser qwen3: the think block is the reply's reasoning_content (a tool call it drafts there is no
    call), the rest its content; the agent sending the reply back with or without reasoning_content continues the
    same sample, trained on the engine's tokens, think block included."""
    think = '<think>\nMaybe <tool_call>{"name": "calc", "arguments": {"expr": "0"}}</tool_call>?\n</think>\n\n'
    answer = 'Computing.<tool_call>{"name": "calc", "arguments": {"expr": "1+2*3"}}</tool_call><|im_end|>'
    for keep in (True, False):
        seen = []

        async def agent(base_url, task):
            client = _client(base_url)
            messages = [{"role": "user", "content": task.prompt}]
            reply = (await client.chat.completions.create(model="m", messages=messages, tools=[CALC])).choices[0]
            seen.append(reply.message.model_dump(exclude_none=True))
            echo = {k: v for k, v in seen[0].items() if keep or k != "reasoning_content"}
            messages += [echo, {"role": "tool", "tool_call_id": "x", "content": "7"}]
            await client.chat.completions.create(model="m", messages=messages, tools=[CALC])

        sample = run_agent([think + answer, "7<|im_end|>"], agent, reasoning="qwen3")
        message = seen[0]
        assert message["reasoning_content"] == '\nMaybe <tool_call>{"name": "calc", "arguments": {"expr": "0"}}' \
                                               "</tool_call>?\n"
        assert message["content"] == "Computing." and len(message["tool_calls"]) == 1
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"expr": "1+2*3"}
        assert sample.metadata["agent_calls"] == 2 and sample.metadata["tool_calls"] == 1, keep  # one sample
        assert think + answer in build_tokenizer().decode(sample.tokens)

    streamed = []

    async def streaming(base_url, task):
        chunks = await _client(base_url).chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}],
                                                                  stream=True)
        streamed.extend([c.choices[0].delta.model_dump(exclude_none=True) async for c in chunks if c.choices])

    run_agent(["<think>hm</think>ok<|im_end|>"], streaming, reasoning="qwen3")
    assert streamed[0] == {"role": "assistant", "content": "ok", "reasoning_content": "hm"}
