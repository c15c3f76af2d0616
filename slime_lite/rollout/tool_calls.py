"""Tool calls in a model turn's text, in the formats chat models write them (SGLang's ``--tool-call-parser`` names):

- ``qwen25`` (alias ``qwen``; Qwen2.5, Qwen3, QwQ): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, a block's JSON a call or a list of calls; ``hermes`` the same, and a last call never closed is read too;
- ``llama3`` (Llama 3.1-3.3): ``{"name": ..., "parameters": {...}}`` objects after an optional ``<|python_tag|>``,
  several separated by ``;``;
- ``pythonic`` (Llama 3.2 / 4 pythonic templates): one Python list of calls, ``[f(a=1), g(b="x")]``, with literal
  keyword arguments;
- ``qwen3_coder`` (Qwen3-Coder): ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>``, each value typed by the tool's JSON schema (a string kept as written);
- ``glm45`` (alias ``glm``; GLM-4.5 and later): ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...
  </tool_call>``, values typed by the schema, JSON where it gives no type.

In every JSON format the key ``arguments`` or ``parameters`` holds the arguments (a JSON string of them is read too;
``parameters`` where a call has both, unless it is empty, as SGLang reads them).
``detect_parser`` picks the format from the model's chat template. A call must name one of the request's tools (as
most of SGLang's parsers ask); what names another stays text, with the calls of its block or list (SGLang drops just
that call and keeps the others: here the turn the model wrote stays whole, and counted). A call whose block is not
closed (bar hermes' last one, and Qwen3-Coder's whose function is), does not parse, or lacks a name or an object of
arguments is malformed: it stays in the turn's text (the model wrote it) and is counted, never dropped. Also here:
the chat template's text between a model turn and the next one (tool results, the next generation prompt), the
text it closes an assistant turn with, and a turn's reasoning split from its content (``--reasoning-parser``).
"""

from __future__ import annotations

import ast
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from slime_lite.errors import SlimeLiteError

log = logging.getLogger(__name__)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_PY_LIST_START = re.compile(r"\[\s*([A-Za-z_][\w.]*)\s*\(")
_FUNCTION = re.compile(r"<function=([^<>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_CODER_CALL = re.compile(r"\s*<function=")
_PARAMETER = re.compile(r"<parameter=([^<>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
PY_CANDIDATES = 16  # lists tried per turn: each is scanned to its closing bracket (a long turn stays linear)
# GLM writes a newline between its parts, or (seen in GLM-4.5's output) the two characters \\n
_GLM_GAP = r"(?:\\n|\s)*"
_ARG = re.compile(rf"<arg_key>((?:(?!<arg_).)*?)</arg_key>{_GLM_GAP}<arg_value>((?:(?!<arg_).)*?)</arg_value>", re.S)
_INT = re.compile(r"[-+]?\d+")


@dataclass
class ParsedTurn:
    """One model turn's text split into what it says and the calls it makes."""

    content: str  # the text without its well-formed calls (malformed ones stay)
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name": str, "arguments": dict}
    malformed: int = 0


class _Tools:
    """A request's ``tools``: the functions a call may name (None: any, for callers without a tool list) and the
    JSON schema of each one's parameters."""

    def __init__(self, tools: Any) -> None:
        self.names: set[str] | None = None if tools is None else set()
        self.params: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                continue
            self.names.add(fn["name"])
            schema = fn.get("parameters")
            props = schema.get("properties") if isinstance(schema, dict) else None
            self.params[fn["name"]] = props if isinstance(props, dict) else {}

    def known(self, name: str) -> bool:
        return self.names is None or name in self.names


def _json_safe(arguments: Any) -> bool:
    try:
        json.dumps(arguments, allow_nan=False)  # NaN / Infinity are no JSON an agent's parser takes
    except (ValueError, TypeError):
        return False
    return True


def _json_call(call: Any, tools: _Tools) -> dict[str, Any] | None:
    """``{"name": str, "arguments" or "parameters": object or a JSON string of one}`` naming a known function as
    a call, else None."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not tools.known(call["name"]):
        return None
    arguments = call.get("parameters") or call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict) or not _json_safe(arguments):
        return None
    return {"name": call["name"], "arguments": arguments}


def _blocks(text: str, read: Callable[[str], list[dict[str, Any]] | None], call_start: re.Pattern | None = None,
            open_tail: Callable[[str], bool] | None = None) -> ParsedTurn:
    """``<tool_call>...</tool_call>`` blocks, each body read by ``read`` into its calls (None: malformed). An
    opening tag followed by another before any closing one is a mention, kept as text; one never closed is a call
    cut short (malformed). ``call_start``: what the body of a call begins with (Qwen3-Coder's ``<function=``): such
    a block runs to its closing tag whatever its values quote (a coding agent's value may hold the tags).
    ``open_tail``: a last block never closed whose body passes it is read as a call (a stop string took the closing
    tag)."""
    calls, kept, malformed, pos = [], [], 0, 0
    close = nxt = -1  # the next closing / opening tag after a block's start: looked for again only once passed
    while (start := text.find(OPEN, pos)) >= 0:
        kept.append(text[pos:start])
        body = start + len(OPEN)
        if 0 <= close < body or close == -1:
            close = text.find(CLOSE, body)
            close = len(text) + 1 if close < 0 else close  # (none: past the end, never looked for again)
        if 0 <= nxt < body or nxt == -1:
            nxt = text.find(OPEN, body)
            nxt = len(text) + 1 if nxt < 0 else nxt
        if nxt < close and not (call_start and call_start.match(text, body)):
            kept.append(text[start:nxt])  # a mention of the tag
            pos = nxt
            continue
        closed = close <= len(text)
        end = close if closed else len(text)
        got = read(text[body:end].strip()) if closed or (open_tail and open_tail(text[body:end])) else None
        pos = end + len(CLOSE) if closed else end
        if got is None:
            malformed += 1
            kept.append(text[start:pos])
        else:
            calls.extend(got)
    kept.append(text[pos:])
    return ParsedTurn("".join(kept).strip(), calls, malformed)


def _json_calls(value: Any, tools: _Tools) -> list[dict[str, Any]] | None:
    """A block's JSON: one call, or a non-empty list of calls (None unless each is one)."""
    calls = [_json_call(v, tools) for v in (value if isinstance(value, list) else [value])]
    return calls if calls and None not in calls else None


_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


def _json_at(text: str, at: int) -> tuple[Any, int]:
    """The JSON value at ``at`` and the index after it (ValueError or RecursionError where none is), decoded in a
    window of the text that grows while the value may go on past it: a decoding error counts the lines before it,
    which from the text's start would make a turn of many tags quadratic."""
    size = 1024
    while True:
        part, whole = text[at:at + size], at + size >= len(text)
        try:
            value, end = _DECODER.raw_decode(part)
        except json.JSONDecodeError as exc:  # an error in the window's last characters, or a string it cut: retry
            if whole or (exc.pos < len(part) - 16 and not exc.msg.startswith("Unterminated string")):
                raise
        else:
            if whole or end < len(part):  # (a number at the window's end may go on)
                return value, at + end
        size *= 4


def _json_blocks(text: str, tools: _Tools, open_tail: bool = False) -> ParsedTurn:
    """``<tool_call>`` JSON ``</tool_call>`` blocks. The JSON after the opening tag is decoded first, so a tag inside
    one of its strings ends nothing; a block that holds no call then ends at the next closing tag (malformed), at
    the next opening one (the first was a mention: text) or at the end (a call cut short). ``open_tail``: a last
    call whose closing tag never came is read as a call (SGLang's hermes parser does)."""
    calls, kept, malformed, pos = [], [], 0, 0
    close = text.find(CLOSE)  # the next closing tag (-1: none); looked for again only once passed (linear)
    while (start := text.find(OPEN, pos)) >= 0:
        kept.append(text[pos:start])
        end = _SPACE.match(text, start + len(OPEN)).end()
        try:
            value, end = _json_at(text, end)
            got = _json_calls(value, tools)
        except (ValueError, RecursionError):  # no JSON (or nested deeper than Python reads)
            got = None
        after = _SPACE.match(text, end).end()
        if got is not None and (text.startswith(CLOSE, after) or (open_tail and after == len(text))):
            calls.extend(got)
            pos = after + len(CLOSE) if text.startswith(CLOSE, after) else after
            continue
        if 0 <= close < end:
            close = text.find(CLOSE, end)
        mention = text.find(OPEN, end)
        if mention >= 0 and (close < 0 or mention < close):
            kept.append(text[start:mention])
            pos = mention
            malformed += got is not None  # a whole call never closed is a call cut short, not a mention of the tag
            continue
        pos = len(text) if close < 0 else close + len(CLOSE)
        malformed += 1
        kept.append(text[start:pos])
    kept.append(text[pos:])
    return ParsedTurn("".join(kept).strip(), calls, malformed)


def _hermes(text: str, tools: _Tools) -> ParsedTurn:
    return _json_blocks(text, tools, open_tail=True)


def _llama3(text: str, tools: _Tools) -> ParsedTurn:
    tag = text.find(PYTHON_TAG)
    head, body = (text[:tag], text[tag + len(PYTHON_TAG):]) if tag >= 0 else ("", text)
    if tag < 0 and not body.lstrip().startswith("{"):
        return ParsedTurn(text.strip())
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while True:
        while pos < len(body) and (body[pos].isspace() or body[pos] in ";," or body.startswith(PYTHON_TAG, pos)):
            pos += len(PYTHON_TAG) if body.startswith(PYTHON_TAG, pos) else 1  # (a tag again before each call)
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            break
        call = _json_call(obj, tools)
        if call is None:
            break
        calls.append(call)
        pos = end
    rest = body[pos:]
    if not calls:  # untagged JSON that is no call of a known function is an answer; a tagged one a bad call
        return ParsedTurn(text.strip(), [], int(tag >= 0))
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


def _python_calls(source: str, tools: _Tools) -> list[dict[str, Any]] | None:
    """``[f(a=1), g(b="x")]``: calls of known names with literal keyword arguments only, else None."""
    tree = ast.parse(source, mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if (not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute))
                or any(kw.arg is None for kw in node.keywords)):
            return None
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        name = ast.unparse(node.func)
        if not tools.known(name) or not _json_safe(arguments):  # a set or bytes is no JSON argument either
            return None
        calls.append({"name": name, "arguments": arguments})
    return calls


def _pythonic(text: str, tools: _Tools) -> ParsedTurn:
    text = text.replace("<|python_start|>", "").replace("<|python_end|>", "")
    pos, attempted = 0, False
    for _ in range(PY_CANDIDATES):
        start = _PY_LIST_START.search(text, pos)
        if start is None:
            break
        end = _closing_bracket(text, start.start())
        try:
            calls = _python_calls(text[start.start():end + 1], tools) if end is not None else None
        except (SyntaxError, ValueError, TypeError):  # not Python, or an argument that is no literal
            calls = None
        if calls:
            return ParsedTurn((text[:start.start()] + text[end + 1:]).strip(), calls)
        attempted = attempted or tools.known(start.group(1))  # a list that begins with a call of a tool
        pos = start.start() + 1
    return ParsedTurn(text.strip(), [], int(attempted))


def _kinds(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (``type``, a list of them, ``anyOf`` / ``oneOf`` branches, the
    types of an ``enum``'s values)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()
    for branch in (schema.get("anyOf") or []) + (schema.get("oneOf") or []):
        kinds |= _kinds(branch)
    names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
    kinds |= {names.get(type(v), "object") for v in schema.get("enum") or []}
    return {k for k in kinds if isinstance(k, str)}


def _unescaped_json(text: str) -> Any:
    """JSON written escaped, as inside a JSON string (GLM-4.5 may write ``[{\\"id\\": 1}]``)."""
    return json.loads(json.loads(f'"{text}"'))


def _typed(value: str, schema: Any, untyped_json: bool) -> Any:
    """A parameter written as text, read as its schema's type. Kept as written (the tool sees the model's mistake)
    where the schema allows a string, gives no type (``untyped_json`` False: Qwen3-Coder writes strings bare, so
    an untyped "123" stays a string) or the text does not read as the type; "null" is None unless a string."""
    kinds, text = _kinds(schema), value.strip()
    if text.lower() == "null" and "string" not in kinds and (kinds or untyped_json):
        return None
    if "string" in kinds or (not kinds and not untyped_json):
        return value
    if "integer" in kinds and _INT.fullmatch(text):
        return int(text)
    if "number" in kinds:
        try:
            number = int(text) if _INT.fullmatch(text) else float(text)  # an int keeps every digit
        except ValueError:
            number = None
        if number is not None and _json_safe(number):
            return number
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kinds & {"object", "array"} or (not kinds and untyped_json):
        for parse in (json.loads, ast.literal_eval, _unescaped_json):
            try:
                out = parse(text)
            except (ValueError, SyntaxError, TypeError):
                continue
            if (not kinds or isinstance(out, (dict, list))) and _json_safe(out):
                return out
    return value


def _qwen3_coder(text: str, tools: _Tools) -> ParsedTurn:
    def read(body: str) -> list[dict[str, Any]] | None:
        calls, last = [], 0
        for m in _FUNCTION.finditer(body):
            name = m.group(1).strip()
            if body[last:m.start()].strip() or not tools.known(name):  # text outside a function: not a call
                return None
            schema = tools.params.get(name, {})
            arguments = {}
            for p in _PARAMETER.finditer(m.group(2)):
                value = re.sub(r"\A\r?\n|\r?\n\Z", "", p.group(2))  # the line breaks around it, not in it
                arguments[p.group(1).strip()] = _typed(value, schema.get(p.group(1).strip()), untyped_json=False)
            calls.append({"name": name, "arguments": arguments})
            last = m.end()
        return calls if calls and not body[last:].strip() else None
    return _blocks(text, read, _CODER_CALL, lambda body: body.rstrip().endswith("</function>"))


def _glm45(text: str, tools: _Tools) -> ParsedTurn:
    def read(body: str) -> list[dict[str, Any]] | None:
        name, _, rest = body.partition("<arg_key>")
        name, rest = re.sub(rf"{_GLM_GAP}\Z", "", name).strip(), "<arg_key>" + rest if rest else ""
        if not name or "\n" in name or not tools.known(name) or re.fullmatch(_GLM_GAP, _ARG.sub("", rest)) is None:
            return None
        schema = tools.params.get(name, {})
        return [{"name": name, "arguments": {k.strip(): _typed(v, schema.get(k.strip()), untyped_json=True)
                                             for k, v in _ARG.findall(rest)}}]
    return _blocks(text, read)


PARSERS: dict[str, Callable[[str, _Tools], ParsedTurn]] = {
    "qwen25": _json_blocks, "hermes": _hermes, "llama3": _llama3, "pythonic": _pythonic, "qwen3_coder": _qwen3_coder,
    "glm45": _glm45}
ALIASES = {"qwen": "qwen25", "glm": "glm45"}
PARSER_CHOICES = ("auto", *PARSERS, *ALIASES)  # --tool-call-parser
REASONING_PARSERS = ("qwen3", "deepseek-r1", "glm45")  # --reasoning-parser: <think> blocks, SGLang's names
THINK, END_THINK = "<think>", "</think>"
# what a chat template writes a call with, in the order tried: the first found names the format
_TEMPLATE_MARKS = (("<function=", "qwen3_coder"), ("<arg_key>", "glm45"), (OPEN, "qwen25"), (PYTHON_TAG, "llama3"),
                   ('"parameters"', "llama3"), ("<|python_start|>", "pythonic"))


def detect_parser(tokenizer: Any) -> str:
    """The format the model's chat template writes tool calls in (``qwen25``, with a warning, when it shows
    none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = " ".join(template.values()) if isinstance(template, dict) else str(template)
    for mark, name in _TEMPLATE_MARKS:
        if mark in template:
            return name
    log.warning("the chat template writes no tool call this tool-call parser knows: reading them as qwen25 "
                "(<tool_call>{json}</tool_call>); set --tool-call-parser if the model writes another format")
    return "qwen25"


def parse_tool_calls(text: str, strip: tuple[str, ...] = (), parser: str | None = "qwen25",
                     tools: Any = None) -> ParsedTurn:
    """Split a model turn's ``text`` (after removing trailing end-of-turn markers ``strip``) into content and calls,
    in the format ``parser`` (a name of ``PARSERS`` or ``ALIASES``; None: no calls, all content). ``tools``, the
    request's: a call must name one of them (a call of another is kept as text, as SGLang does), and they type
    the values of formats that write them as text; None: any name."""
    changed = True
    while changed:
        changed = False
        for marker in strip:
            if marker and text.endswith(marker):
                text, changed = text[: -len(marker)], True
    if parser is None:
        return ParsedTurn(text.strip())
    try:
        return PARSERS[ALIASES.get(parser, parser)](text, _Tools(tools))
    except Exception as exc:  # noqa: BLE001 - the model's text, whatever it holds (nesting deeper than the parsers
        # go, an integer of more digits than Python reads), is kept as text and counted malformed
        log.debug("tool-call parsing gave up (%s: %.200s): the turn is kept as text", type(exc).__name__, exc)
        return ParsedTurn(text.strip(), [], 1)


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
    tokens, also where the template renders them otherwise once more messages follow (Qwen3 leaves out an earlier
    turn's think block): the new text begins after the history's last end of turn, counted in the full rendering.
    A template that closes no turn and re-renders the history is refused. ``template_kwargs``
    (--apply-chat-template-kwargs) go to the template as they went when the prompt was rendered."""
    kw = template_kwargs or {}
    before = tokenizer.apply_chat_template(history, tokenize=False, **kw)
    after = tokenizer.apply_chat_template(history + new_messages, tokenize=False, add_generation_prompt=True, **kw)
    turns = before.count(end_of_turn) if end_of_turn else 0
    if turns and after.startswith(before):
        at = before.rindex(end_of_turn)  # the model's turn's end
    elif turns and after.count(end_of_turn) >= turns and end_of_turn not in json.dumps(history, ensure_ascii=False,
                                                                                        default=str):
        at = -1  # the history's last end of turn, counted in the full rendering (no message holds the marker
        for _ in range(turns):  # as text, which a dropped think block would take with it)
            at = after.index(end_of_turn, at + 1)
    elif after.startswith(before):
        return after[len(before):]
    else:
        raise SlimeLiteError(
            "the chat template renders the conversation so far differently once new messages follow it, and where "
            "the new messages begin cannot be told (the template closes no turn with an end-of-turn text, or a "
            "message holds that text); a turn's inserted tokens cannot be rendered on their own with this "
            "tokenizer's chat_template.")
    return ("" if closed else end_of_turn) + after[at + len(end_of_turn):]


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


def split_reasoning(text: str, parser: str | None) -> tuple[str | None, str]:
    """A model turn's ``(reasoning, content)`` as SGLang's ``--reasoning-parser`` splits it: the text before
    ``</think>`` is the reasoning (leading ``<think>`` tags dropped), the rest the content. The turn is reasoning
    where it holds ``<think>`` (``qwen3``, ``glm45``: a turn with thinking switched off has none) or always
    (``deepseek-r1``, whose template opens the block in the prompt). A block never closed is all reasoning (cut at
    its token limit), bar a tool call opened inside it (``qwen3``, ``glm45``: Qwen3.5 does), which begins the content.
    None: no reasoning, ``text`` the content."""
    if parser is None or (parser != "deepseek-r1" and THINK not in text):
        return None, text
    while text.startswith(THINK):
        text = text[len(THINK):]
    reasoning, closed, content = text.partition(END_THINK)
    if closed:
        return reasoning, content
    call = text.find(OPEN) if parser != "deepseek-r1" else -1
    return (text[:call], text[call:]) if call >= 0 else (text, "")
