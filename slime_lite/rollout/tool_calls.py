"""Tool calls in a model turn's text, in the formats chat models write them (SGLang's ``--tool-call-parser`` names):

- ``qwen25`` (aliases ``qwen``, ``hermes``; Qwen2.5, Qwen3, QwQ): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks;
- ``llama3`` (Llama 3.1-3.3): ``{"name": ..., "parameters": {...}}`` objects after an optional ``<|python_tag|>``,
  several separated by ``;``;
- ``pythonic`` (Llama 3.2 / 4 pythonic templates): one Python list of calls, ``[f(a=1), g(b="x")]``, with literal
  keyword arguments;
- ``qwen3_coder`` (Qwen3-Coder): ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>``, each value typed by the tool's JSON schema (a string kept as written).

In every format the JSON key ``arguments`` or ``parameters`` holds the arguments (a JSON string of them is read too).
``detect_parser`` picks the format from the model's chat template. A call whose block is not closed, does not parse,
or lacks a name or an object of arguments is malformed: it stays in the turn's text (the model wrote it) and is
counted, never dropped. Also here: the chat template's text between a model turn and the next one (tool results,
the next generation prompt) and the text it closes an assistant turn with.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from slime_lite.errors import SlimeLiteError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.S)
PYTHON_TAG = "<|python_tag|>"
_LOOKS_LIKE_JSON_CALL = re.compile(r'\s*\{\s*"name"\s*:')
_PY_LIST_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?=</parameter>|<parameter=|</function>|$)(?:</parameter>)?", re.S)


@dataclass
class ParsedTurn:
    """One model turn's text split into what it says and the calls it makes."""

    content: str  # the text without its well-formed calls (malformed ones stay)
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name": str, "arguments": dict}
    malformed: int = 0


def _json_call(call: Any) -> dict[str, Any] | None:
    """``{"name": str, "arguments" or "parameters": object or a JSON string of one}`` as a call, else None."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": call["name"], "arguments": arguments}


def _blocks(text: str, read: Callable[[str], dict[str, Any] | None]) -> ParsedTurn:
    """``<tool_call>...</tool_call>`` blocks, each body read by ``read``; an unclosed block runs to the end."""
    calls, kept, malformed, last = [], [], 0, 0
    for m in _BLOCK.finditer(text):
        call = read(m.group(1).strip()) if m.group(0).endswith(CLOSE) else None
        kept.append(text[last:m.start()])
        if call is None:
            malformed += 1
            kept.append(m.group(0))
        else:
            calls.append(call)
        last = m.end()
    kept.append(text[last:])
    return ParsedTurn("".join(kept).strip(), calls, malformed)


def _hermes(text: str, tools: Any) -> ParsedTurn:
    def read(body: str) -> dict[str, Any] | None:
        try:
            return _json_call(json.loads(body))
        except ValueError:
            return None
    return _blocks(text, read)


def _llama3(text: str, tools: Any) -> ParsedTurn:
    tag = text.find(PYTHON_TAG)
    if tag >= 0:
        head, body = text[:tag], text[tag + len(PYTHON_TAG):]
    elif text.lstrip().startswith("{"):
        head, body = "", text.lstrip()
    else:
        return ParsedTurn(text.strip())
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while True:
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            break
        call = _json_call(obj)
        if call is None:
            break
        calls.append(call)
        pos = end
    rest = body[pos:]
    if not calls:  # a JSON answer that is no call is content; a tagged or call-shaped one is a malformed call
        return ParsedTurn(text.strip(), [], int(tag >= 0 or bool(_LOOKS_LIKE_JSON_CALL.match(body))))
    return ParsedTurn((head + rest).strip(), calls, int(rest.lstrip().startswith("{")))  # a call cut short


def _closing_bracket(text: str, start: int) -> int | None:
    """The index of the bracket closing the one at ``start`` (brackets inside string literals skipped)."""
    depth, quote, i = 0, "", start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _python_calls(source: str) -> list[dict[str, Any]] | None:
    """``[f(a=1), g(b="x")]``: calls of names with literal keyword arguments only, else None."""
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if (not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute))
                or any(kw.arg is None for kw in node.keywords)):
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            json.dumps(arguments)  # a set or bytes is no JSON argument
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append({"name": ast.unparse(node.func), "arguments": arguments})
    return calls


def _pythonic(text: str, tools: Any) -> ParsedTurn:
    text = text.replace("<|python_start|>", "").replace("<|python_end|>", "")
    start = _PY_LIST_START.search(text)
    if start is None:
        return ParsedTurn(text.strip())
    end = _closing_bracket(text, start.start())
    calls = _python_calls(text[start.start():end + 1]) if end is not None else None
    if calls is None:
        return ParsedTurn(text.strip(), [], 1)
    return ParsedTurn((text[:start.start()] + text[end + 1:]).strip(), calls)


def _schema_types(tools: Any) -> dict[str, dict[str, Any]]:
    """{function name: {parameter: its JSON-schema type}} of a request's ``tools`` (what is not a schema skipped)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools if isinstance(tools, list) else []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        props = fn.get("parameters", {}).get("properties") if isinstance(fn, dict) and isinstance(
            fn.get("parameters"), dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


def _typed(value: str, kind: Any) -> Any:
    """A ``<parameter=...>`` value read as its schema type says (``kind``: a type name, a list of them, None)."""
    kinds = [k for k in (kind if isinstance(kind, list) else [kind]) if k != "null"]
    kind = kinds[0] if kinds else None
    if value.strip().lower() == "null" and kind != "string":
        return None
    try:
        if kind == "string":
            return value
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            return int(number) if number.is_integer() and not any(c in value for c in ".eE") else number
        if kind == "boolean":
            return {"true": True, "false": False}[value.strip().lower()]
        try:
            return json.loads(value)
        except ValueError:
            if kind in ("object", "array"):
                return ast.literal_eval(value.strip())
    except (ValueError, KeyError, SyntaxError, RecursionError):
        pass
    return value  # as the model wrote it: the tool sees its mistake


def _qwen3_coder(text: str, tools: Any) -> ParsedTurn:
    types = _schema_types(tools)

    def read(body: str) -> dict[str, Any] | None:
        m = _FUNCTION.match(body)
        if m is None:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        schema = types.get(name, {})
        arguments = {}
        for p in _PARAMETER.finditer(inner):
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            arguments[p.group(1).strip()] = _typed(value, schema.get(p.group(1).strip()))
        return {"name": name, "arguments": arguments}
    return _blocks(text, read)


PARSERS: dict[str, Callable[[str, Any], ParsedTurn]] = {
    "qwen25": _hermes, "llama3": _llama3, "pythonic": _pythonic, "qwen3_coder": _qwen3_coder}
ALIASES = {"qwen": "qwen25", "hermes": "qwen25"}
PARSER_CHOICES = ("auto", *PARSERS, *ALIASES)  # --tool-call-parser


def detect_parser(tokenizer: Any) -> str:
    """The format the model's chat template writes tool calls in (``qwen25`` when it shows none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = " ".join(template.values()) if isinstance(template, dict) else str(template)
    for mark, name in (("<function=", "qwen3_coder"), (OPEN, "qwen25"), ("<|python_start|>", "pythonic"),
                       (PYTHON_TAG, "llama3")):
        if mark in template:
            return name
    return "qwen25"


def parse_tool_calls(text: str, strip: tuple[str, ...] = (), parser: str | None = "qwen25",
                     tools: Any = None) -> ParsedTurn:
    """Split a model turn's ``text`` (after removing trailing end-of-turn markers ``strip``) into content and calls,
    in the format ``parser`` (a name of ``PARSERS`` or ``ALIASES``; None: no calls, all content); ``tools``, the
    request's, type the values of formats that write them as text."""
    changed = True
    while changed:
        changed = False
        for marker in strip:
            if marker and text.endswith(marker):
                text, changed = text[: -len(marker)], True
    if parser is None:
        return ParsedTurn(text.strip())
    return PARSERS[ALIASES.get(parser, parser)](text, tools)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call as the tiny model's chat template writes it (``qwen25``, json.dumps spacing)."""
    return f'{OPEN}{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}{CLOSE}'


def inserted_text(tokenizer: Any, history: list[dict[str, Any]], new_messages: list[dict[str, Any]],
                  end_of_turn: str, closed: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
    """The text the chat template puts after the model's last turn (which ended with ``end_of_turn``, the stop
    token the engine returned) up to the next generation prompt: the rest of that turn's closing, then
    ``new_messages`` (tool results, user or environment turns), then the assistant's generation prompt. A turn
    that did not end with it (``closed`` False: cut by its length or a stop string) gets ``end_of_turn`` too.

    ``history`` ends with that assistant turn. Only the new text is rendered, so earlier turns keep the engine's
    tokens; a template that renders history differently once more messages follow is refused. ``template_kwargs``
    (--apply-chat-template-kwargs) go to the template as they went when the prompt was rendered."""
    kw = template_kwargs or {}
    before = tokenizer.apply_chat_template(history, tokenize=False, **kw)
    after = tokenizer.apply_chat_template(history + new_messages, tokenize=False, add_generation_prompt=True, **kw)
    if not after.startswith(before):
        raise SlimeLiteError(
            "the chat template renders the conversation so far differently once new messages follow it; a turn's "
            "inserted tokens cannot be rendered on their own with this tokenizer's chat_template.")
    end = before.rfind(end_of_turn) if end_of_turn else -1
    closing = before[end + (len(end_of_turn) if closed else 0):] if end >= 0 else ""
    return closing + after[len(before):]


def end_of_turn(tokenizer: Any) -> str:
    """The text the chat template closes an assistant turn with (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for
    Llama 3): what it renders right after an assistant message's content, trailing whitespace left out. "" for a
    template that closes no turn (the next role's tag starts the next one) or that cannot render such a turn."""
    mark = "\u2063slime-lite-end-of-turn\u2063"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "u"}, {"role": "assistant", "content": mark}],
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that needs more than this (tools, a system turn) closes with ""
        return ""
    return text[text.rindex(mark) + len(mark):].rstrip() if mark in text else ""
