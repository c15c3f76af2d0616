"""The agent endpoint's reading of OpenAI chat messages: text content, tool calls, stop strings; a message that is
not a chat message's is a ``BadRequest`` naming the field. ``render``: a call's text for the engine. The answer's
side: ``read_answer`` reads the engine's, ``reply_content`` and ``chat_completion`` write OpenAI's."""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from typing import Any

from slime_lite.errors import SlimeLiteError
from slime_lite.rollout.tool_calls import inserted_text
from slime_lite.tokenizer import token_bytes

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A call the endpoint refuses (HTTP 400, the message names the field); nothing is recorded."""


def _text_content(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or OpenAI content parts of type "text"."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string, null or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                             "supported by the agent endpoint")
        texts.append(part["text"])
    return " ".join(texts)  # as SGLang (and engine/openai_api.py) join the text parts for a string template


PASSED_FIELDS = ("name", "tool_call_id", "reasoning_content")  # kept for the chat templates that render them
ROLES = ("system", "user", "assistant", "tool", "developer", "function")  # a chat message's (as SGLang takes them)


def normalise(message: Any, where: str = "message") -> dict[str, Any]:
    """A message as compared between calls and given to the chat template: role, content ("" for none), tool calls
    (name, parsed arguments) and the ``PASSED_FIELDS`` it has (a tool result's ``tool_call_id`` and ``name``, an
    assistant turn's ``reasoning_content``). ``BadRequest`` names the field (``where``) that is not a chat
    message's."""
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object with a role and content")
    if not isinstance(message.get("role"), str):
        raise BadRequest(f"{where}.role: a string ({', '.join(ROLES)}) is required")
    if message["role"] not in ROLES:  # a chat template would drop a message of a role it does not render
        raise BadRequest(f"{where}.role={message['role']!r:.40} is no chat role: use one of {', '.join(ROLES)}")
    calls = []
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list")
    for j, call in enumerate(raw_calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}.tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"arguments\": ...}}")
        raw = fn.get("arguments", {})
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw  # OpenAI clients send a JSON string
        except ValueError:
            args = None
        if raw is not None and not isinstance(args, dict):  # (null is left for the template, as SGLang does)
            raise BadRequest(f"{where}.tool_calls[{j}].function.arguments={raw!r:.80} must be a JSON object, as a "
                             'string (\'{"a": 1}\') or an object')
        calls.append({"name": fn["name"], "arguments": args})
    out: dict[str, Any] = {"role": message["role"], "content": _text_content(message.get("content"), where)}
    if calls:
        out["tool_calls"] = [{"type": "function", "function": c} for c in calls]
    for key in PASSED_FIELDS:
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"{where}.{key} must be a string")
        if value:
            out[key] = value
    return out


def tool_choice(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, bool]:
    """The tools the chat template is given and whether the reply's tool calls are parsed, from the call's ``tools``
    and ``tool_choice`` (as SGLang reads them): "none", or no tools, parses no call ("none" hides the tools); a
    named function (``{"type": "function", "function": {"name": ...}}``) shows only that tool; "auto" (the
    default) and "required" show them all. Decoding is not constrained: under "required" or a named function the
    model may still answer in text, and that reply is returned (and trained) as it is."""
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRequest('tools must be a list of {"type": "function", "function": {"name": ..., "parameters": ...}}')
    for i, tool in enumerate(tools or []):
        if not isinstance(tool.get("function"), dict) or not isinstance(tool["function"].get("name"), str):
            raise BadRequest(f"tools[{i}].function.name: a string is required (each tool is "
                             '{"type": "function", "function": {"name": ..., "parameters": ...}})')
    tools = tools or None
    choice = body.get("tool_choice")
    if choice in (None, "auto"):
        return tools, tools is not None
    if choice == "none":
        return None, False
    if choice == "required":
        if tools is None:
            raise BadRequest('tool_choice "required" needs tools')
        return tools, True
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(
        choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise BadRequest(f'tool_choice={choice!r:.80} must be "none", "auto", "required" or {{"type": "function", '
                         '"function": {"name": ...}}')
    chosen = [t for t in tools or [] if isinstance(t.get("function"), dict) and t["function"].get("name") == name]
    if not chosen:
        raise BadRequest(f"tool_choice names the function {name!r:.60}, which is not in tools")
    return chosen, True


# the chat template's arguments its renderers pass themselves: refused in --apply-chat-template-kwargs (args.py) and in
# a call's chat_template_kwargs
TEMPLATE_OWN_ARGS = ("add_generation_prompt", "tokenize", "tools", "conversation")


def call_options(body: dict[str, Any]) -> tuple[Any, int | None, dict[str, Any], int | None]:
    """A call's ``logprobs``, ``top_logprobs``, ``chat_template_kwargs`` (an object, {} for none) and ``max_tokens``
    (or ``max_completion_tokens``), each checked: a BadRequest names the field."""
    want_lp, top = body.get("logprobs"), body.get("top_logprobs")
    if want_lp not in (None, True, False):
        raise BadRequest(f"logprobs={want_lp!r:.40} must be true or false")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise BadRequest(f"top_logprobs={top!r:.40} must be an integer in [0, 20]")
    if top and not want_lp:
        raise BadRequest("top_logprobs needs logprobs: true")
    if body.get("continue_final_message") not in (None, False):  # the prompt would end in the agent's text of a
        # model turn, which the trajectory trains as the engine's tokens
        raise BadRequest("continue_final_message: not supported by the agent endpoint (a trajectory's model turns "
                         "are the engine's own tokens); leave it out and send no unfinished assistant message")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:  # unconstrained output would fail the client's own parsing later
        raise BadRequest(f"response_format={fmt!r:.80}: constrained output (json_object, json_schema) is not "
                         "supported by the agent endpoint; leave it out (or {\"type\": \"text\"}) and ask for "
                         "the format in the prompt")
    legacy = next((k for k in ("functions", "function_call") if body.get(k) is not None), None)
    if legacy is not None:
        raise BadRequest(f"{legacy}: OpenAI's deprecated function-calling fields are not read; send tools (and "
                         "tool_choice) instead")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest(f"chat_template_kwargs={kwargs!r:.80} must be an object")
    if "chat_template" in (kwargs or {}):  # as SGLang: the trained tokens are the model's template's
        raise BadRequest("chat_template_kwargs.chat_template: a request-supplied chat template is not allowed")
    own = next((k for k in TEMPLATE_OWN_ARGS if k in (kwargs or {})), None)
    if own is not None:
        fix = "send the tools in the call's tools field" if own == "tools" else "leave it out"
        raise BadRequest(f"chat_template_kwargs.{own}: set by the endpoint for each rendering; {fix} (give only the "
                         "template's own arguments here)")
    asked_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(asked_field)
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
        raise BadRequest(f"{asked_field}={asked!r:.40} must be a positive integer (or null)")
    return want_lp, top, kwargs or {}, asked


def stop_strings(value: Any) -> list[str]:
    """The agent's ``stop``: a string or a list of strings, none empty."""
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        raise BadRequest(f"stop={value!r:.80} must be a string or a list of non-empty strings")
    return stops


def stream_options(body: dict[str, Any]) -> bool:
    """``stream_options`` of a streamed call: whether the last chunk carries the usage (``include_usage``)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest(f"stream_options={options!r:.80} must be an object with a boolean include_usage")
    return options.get("include_usage", False)


def stream_chunks(completion: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A finished chat completion as the ``chat.completion.chunk`` events OpenAI streams: the message (role, content,
    reasoning, tool calls with their index) and its log-probs in one delta, then the finish reason, then the usage
    when asked (``include_usage``; ``usage`` null in the others then)."""
    choice = completion["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("reasoning_content"):  # (--reasoning-parser)
        delta["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    head = {k: completion[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    usage = {"usage": None} if include_usage else {}
    chunks = [{**head, "choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"],
                                    "finish_reason": None}], **usage},
              {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                    "finish_reason": choice["finish_reason"]}], **usage}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": completion["usage"]})
    return chunks


def read_answer(out: Any) -> tuple[dict[str, Any], list[int], list[float]]:
    """The engine's /generate answer to a call: its ``meta_info``, output ids and their log-probs, one finite each.
    An answer that cannot be read is a ValueError saying why (a NaN log-prob arrives as JSON's null)."""
    try:
        meta = out["meta_info"]
        ids = [int(t) for t in out["output_ids"]]
        log_probs = [float(t[0]) for t in meta["output_token_logprobs"]]
        if not isinstance(out["text"], str) or len(log_probs) != len(ids) or not all(map(math.isfinite, log_probs)):
            raise ValueError(f"{len(ids)} tokens with the log-probs {log_probs[:8]!r:.120}, not one finite log-prob "
                             "each")
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"its answer could not be read ({type(exc).__name__}: {exc}); a null or NaN log-prob means "
                         "the engine computed NaN logits (check its weights: --check-weight-update-equal)") from None
    return meta, ids, log_probs


def reply_content(text: str, matched: Any, tokenizer: Any) -> str:
    """The reply's content from the engine's text (sent with ``no_stop_trim``), as OpenAI's: cut before the stop
    string that ended it; a stop token's text taken off once (an ordinary token such as "." may end the content
    before it too)."""
    if isinstance(matched, str) and matched in text:
        return text[:text.find(matched)]
    if isinstance(matched, int):
        mark = tokenizer.decode([matched])
        return text[:-len(mark)] if mark and text.endswith(mark) else text
    return text


def _lp_entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": token_bytes(tokenizer, token, text)}


def chat_completion(model: str, reply: dict[str, Any], finish: str, prompt_tokens: int, ids: list[int],
                    log_probs: list[float], tops: list[Any] | None, tokenizer: Any) -> dict[str, Any]:
    """OpenAI's ``chat.completion`` of one answer; ``tops``: None where log-probs were not asked for, else per
    token its top log-probs' ``(logprob, id, ...)`` rows (or None)."""
    logprobs = None
    if tops is not None:
        logprobs = {"content": [{**_lp_entry(tokenizer, t, v),
                                 "top_logprobs": [_lp_entry(tokenizer, x[1], x[0]) for x in (row or [])]}
                                for t, v, row in zip(ids, log_probs, tops)]}
    # a turn cut at its token limit is "length", even where it holds a tool call
    reason = "length" if finish == "length" else "tool_calls" if reply.get("tool_calls") else "stop"
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": reply, "logprobs": logprobs, "finish_reason": reason}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                      "total_tokens": prompt_tokens + len(ids)}}


def render(endpoint: Any, messages: list[dict[str, Any]], parent: Any, tools: Any,
           template_kwargs: dict[str, Any]) -> tuple[str, Any]:
    """The text to send after ``parent``'s tokens (the whole prompt without one), and the parent call kept: none
    where the new messages cannot be rendered on their own (other tools or template kwargs than the parent's, or a
    template that closes no turn and renders the history otherwise), which starts a new segment as a rewritten
    history does."""
    tok = endpoint.tokenizer
    try:
        if parent is not None and (parent.tools, parent.kwargs) != (tools, template_kwargs) and (
                tok.apply_chat_template(parent.messages, tools=parent.tools, tokenize=False, **parent.kwargs)
                != tok.apply_chat_template(parent.messages, tools=tools, tokenize=False, **template_kwargs)):
            parent = None  # other tools or kwargs render the conversation's start otherwise: a new segment
        if parent is not None:
            n = len(parent.messages) + 1
            closed = bool(parent.completion_ids) and parent.completion_ids[-1] in endpoint.closing_ids
            try:
                text = inserted_text(tok, messages[:n], messages[n:], endpoint.end_of_turn, closed=closed,
                                     template_kwargs={**template_kwargs, "tools": tools})
            except SlimeLiteError as exc:
                log.debug("a new segment (%s)", exc)
            else:  # a template that closes no turn (GLM) opens the next message with the role tag the model
                # stopped on (<|observation|>, <|user|>): that tag is the model's last token already, not again
                last = parent.completion_ids[-1] if parent.completion_ids else None
                mark = tok.decode([last]) if last in tok.all_special_ids and not endpoint.end_of_turn else ""
                return (text[len(mark):] if mark and text.startswith(mark) else text), parent
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                       **template_kwargs), None
    except Exception as exc:  # noqa: BLE001 - a template error is the agent's input
        raise BadRequest(f"messages: the chat template cannot render them ({type(exc).__name__}: {exc})") from None
