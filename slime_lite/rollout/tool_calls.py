"""Tool calls in the Qwen/Hermes format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: parsed out of a
model turn's text, and the chat template's text between a model turn and the next one (tool results, the next
generation prompt).

A call whose block is not closed, whose JSON does not parse, or that lacks a string ``name`` or an object of
``arguments`` is malformed: it stays in the turn's text (the model wrote it) and is counted, never dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from slime_lite.errors import SlimeLiteError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.S)


@dataclass
class ParsedTurn:
    """One model turn's text split into what it says and the calls it makes."""

    content: str  # the text without its well-formed call blocks (malformed ones stay)
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name": str, "arguments": dict}
    malformed: int = 0


def _call(body: str) -> dict[str, Any] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": call["name"], "arguments": arguments}


def parse_tool_calls(text: str, strip: tuple[str, ...] = ()) -> ParsedTurn:
    """Split a model turn's ``text`` (after removing trailing end-of-turn markers ``strip``) into content and calls."""
    changed = True
    while changed:
        changed = False
        for marker in strip:
            if marker and text.endswith(marker):
                text, changed = text[: -len(marker)], True
    calls, kept, malformed, last = [], [], 0, 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1).strip()) if m.group(0).endswith(CLOSE) else None
        kept.append(text[last:m.start()])
        if call is None:
            malformed += 1
            kept.append(m.group(0))
        else:
            calls.append(call)
        last = m.end()
    kept.append(text[last:])
    return ParsedTurn("".join(kept).strip(), calls, malformed)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one call as the tiny model's chat template writes it (json.dumps spacing)."""
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
