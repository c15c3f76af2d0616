"""OpenAI-compatible routes of the embedded engine: /v1/models (and /v1/models/{id}), /v1/completions,
/v1/chat/completions, and SGLang's /tokenize and /detokenize (also under /v1).

They map onto the same requests as ``/generate``. ``finish_reason`` is ``stop``, ``length`` or ``abort``. Log-probs
follow SGLang's OpenAI server: completions take ``logprobs: k`` (``top_logprobs`` maps of the k best tokens) and
``echo`` (the prompt before the text; with ``logprobs`` > 0 also the prompt's log-probs, the first one null);
chat takes ``logprobs: true`` and ``top_logprobs: k`` (counts read as pydantic reads them: true is 1, 2.0 is 2).
Stream chunks carry the log-probs of the tokens they add; ``text_offset`` is where each token starts in the choice's
text (after the echoed prompt; in a stream after what earlier chunks sent). A chat stream names the role in each
choice's first chunk. ``stream_options``: ``include_usage`` (a last chunk with the usage) and
``continuous_usage_stats`` (each chunk with its choice's usage so far), as SGLang. An assistant message's
``tool_calls[].function.arguments`` string is parsed into its JSON object before the template renders (SGLang's).
Without ``max_tokens`` / ``max_completion_tokens`` a completion stops at 16 tokens and a chat reply runs up to the
context; null is up to the context (SGLang's defaults). A message's content may be OpenAI text parts (joined by a
space, as SGLang renders them for a template that takes a string). Chat takes SGLang's ``chat_template_kwargs``,
and the model's generation_config.json temperature / top_p / top_k / min_p for those a request leaves out (SGLang's
chat route does so by default; completions and ``/generate`` do not).
``rid``, ``extra_key`` and ``cache_salt`` act as on ``/generate``. A field the route does not implement is accepted
only at its default, unless it merely labels the request (``validate.openai_fields``); booleans are JSON booleans.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from typing import Any

from aiohttp import web

from slime_lite.engine import validate as check
from slime_lite.engine.http_json import BadRequest, dumps, json_response, read_body
from slime_lite.tokenizer import token_bytes

logger = logging.getLogger(__name__)


def add_openai_routes(app: Any, server: Any) -> None:
    """Add the /v1 routes to ``app``; ``server`` is the ``EngineServer`` (server.py imports this module) whose
    ``encode_prompts`` / ``new_requests`` / ``run_requests`` / ``iter_outputs`` they use."""
    api = _OpenAI(server)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model:.+}", api.retrieve_model)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    for prefix in ("", "/v1"):  # SGLang serves both spellings
        app.router.add_post(f"{prefix}/tokenize", api.tokenize)
        app.router.add_post(f"{prefix}/detokenize", api.detokenize)


def _given(body: dict[str, Any], key: str, default: Any) -> Any:
    return default if body.get(key) is None else body[key]


def _max_tokens(body: dict[str, Any], default: int | None) -> int | None:
    """``max_completion_tokens``, else ``max_tokens`` (a null one is not set); neither sent: ``default``. None: up
    to the context (SGLang's chat default; OpenAI's too)."""
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            return body[key]
    return None if "max_completion_tokens" in body or "max_tokens" in body else default


def chat_defaults(model_path: str) -> dict[str, Any]:
    """The sampling values the model's generation_config.json sets (temperature, top_p, top_k, min_p): SGLang's chat
    route takes them for the fields a request leaves out (its server's sampling defaults "model", the default). Its
    repetition_penalty is left out (the embedded engine runs none but 1.0), said once."""
    try:
        with open(os.path.join(model_path, "generation_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    out = {k: config[k] for k in ("temperature", "top_p", "top_k", "min_p") if config.get(k) is not None}
    if out:
        logger.info("chat completions: sampling values the request leaves out are the model's %s", out)
    if config.get("repetition_penalty") not in (None, 1, 1.0):
        logger.warning("generation_config.json's repetition_penalty %s is not applied to chat completions (the "
                       "embedded engine runs none): SGLang would", config["repetition_penalty"])
    return out


def _sampling(body: dict[str, Any], default_max_tokens: int | None,
              defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """A body's SGLang sampling params; a field left out (or null) takes ``defaults`` (the chat route's
    ``chat_defaults``), else OpenAI's."""
    defaults = defaults or {}
    sp: dict[str, Any] = {
        "temperature": _given(body, "temperature", defaults.get("temperature", 1.0)),
        "top_p": _given(body, "top_p", defaults.get("top_p", 1.0)),
        "stop": body.get("stop"), "sampling_seed": body.get("seed"), "n": body.get("n", 1),
        "max_new_tokens": _max_tokens(body, default_max_tokens),  # None: up to the context
    }
    sp.update({k: v for k in ("top_k", "min_p") if (v := _given(body, k, defaults.get(k))) is not None})
    for key in ("ignore_eos", "stop_token_ids", "skip_special_tokens", "no_stop_trim",
                "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias"):
        if body.get(key) is not None:
            sp[key] = body[key]
    if body.get("min_tokens") is not None:
        sp["min_new_tokens"] = body["min_tokens"]
    return sp


def _field_names(body: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The engine's field names in an error -> the OpenAI field the caller sent (``max_completion_tokens`` when it
    gave the limit, as ``_max_tokens`` reads it)."""
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return (("sampling_params.max_new_tokens", limit), ("sampling_params.min_new_tokens", "min_tokens"),
            ("sampling_params.sampling_seed", "seed"), ("sampling_params.", ""))


def _check_fields(body: dict[str, Any], route: str) -> None:
    """Before any work: every field of ``body`` is one ``route`` (completions, chat, tokenize) implements, a label,
    or at its default (``validate.openai_fields``); ``model`` is a string."""
    try:
        check.openai_fields(body, route)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if body.get("best_of") not in (None, 1) and body.get("best_of") != body.get("n", 1):
        raise BadRequest("best_of: only best_of == n is supported by the embedded engine")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise BadRequest(f"model={body['model']!r:.80} must be a string (the served model's name)")
    _usage_options(body)


def _flag(value: Any, name: str, default: bool) -> bool:
    """A boolean field: JSON true/false (or 0/1), null or absent is ``default``; a string such as "false" is a
    400, not read as true."""
    try:
        return default if value is None else check.boolean(value, name)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def _usage_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream_options``' ``(include_usage, continuous_usage_stats)`` (``stream_options`` must be an object):
    a final chunk with the usage of all choices; the usage of its choice so far on every chunk (SGLang's)."""
    options = body.get("stream_options")
    if not isinstance(options or {}, dict):
        raise BadRequest("stream_options must be an object")
    options = options or {}
    return (_flag(options.get("include_usage"), "stream_options.include_usage", False),
            _flag(options.get("continuous_usage_stats"), "stream_options.continuous_usage_stats", False))


def _stream_delta(sent: str, text: str, final: bool, stops: list[str] = ()) -> tuple[str, str]:
    """``(delta, sent)``: what a stream chunk adds to ``sent`` (the text streamed so far) for the request's text
    now. Until the request finishes, a trailing U+FFFD is held back: it is the start of a character whose other
    bytes come with later tokens; so is an end of the text that begins one of the request's ``stops`` (the stop
    string may complete with the next token, and the text before it is all the client may see, as SGLang holds
    it back). A text that does not continue ``sent`` (a stop string cut at the finish) is sent from where the two
    part."""
    if not final:
        text = text.rstrip("\ufffd")
        held = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        text = text[:len(text) - held]
    if text.startswith(sent):
        return text[len(sent):], text
    return text[len(os.path.commonprefix([sent, text])):], text


def _text_parts(message: Any, i: int) -> Any:
    """A message whose content is OpenAI content parts, with the text parts joined by a space (SGLang's rendering
    for templates that take a string); a part that is not text is refused (the engine serves text models)."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for j, part in enumerate(message["content"]):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"messages[{i}].content[{j}]: a {kind!r:.40} part; the embedded engine takes text parts "
                             "only ({\"type\": \"text\", \"text\": ...})")
        texts.append(part["text"])
    return {**message, "content": " ".join(texts)}


def _tool_arguments(message: Any, i: int) -> Any:
    """An assistant message whose ``tool_calls[].function.arguments`` are JSON strings (as OpenAI clients send
    them), with each parsed to its object: SGLang does so before the template renders (``| tojson`` writes the
    object, not a quoted string). Arguments that are not a JSON object are a 400 naming them."""
    if not isinstance(message, dict) or message.get("role") != "assistant" or \
            not isinstance(message.get("tool_calls"), list):
        return message
    calls = []
    for j, call in enumerate(message["tool_calls"]):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                args = json.loads(function["arguments"])
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise BadRequest(f"messages[{i}].tool_calls[{j}].function.arguments={function['arguments']!r:.80} "
                                 "must be a JSON object (as a string)")
            call = {**call, "function": {**function, "arguments": args}}
        calls.append(call)
    return {**message, "tool_calls": calls}


def _offsets(texts: list[str], at: int) -> list[int]:
    """Where each of ``texts`` starts when they are written one after the other from position ``at``."""
    out = []
    for t in texts:
        out.append(at)
        at += len(t)
    return out


def _finish(out: Any) -> str | None:
    return None if out.finish_reason is None else out.finish_reason["type"]


class _OpenAI:
    def __init__(self, server: Any) -> None:
        self.server = server
        self.chat_defaults = chat_defaults(server.scheduler.model_path)

    def _card(self) -> dict[str, Any]:
        return {"id": self.server.served_model_name, "object": "model", "created": 0, "owned_by": "slime_lite",
                "root": self.server.scheduler.model_path, "max_model_len": self.server.scheduler.slot_len}

    async def models(self, request):
        return json_response({"object": "list", "data": [self._card()]})

    async def retrieve_model(self, request):
        model = request.match_info["model"]
        if model != self.server.served_model_name:
            return json_response({"error": {"message": f"The model '{model}' does not exist",
                                            "type": "invalid_request_error", "param": "model",
                                            "code": "model_not_found"}}, 404)
        return json_response(self._card())

    @staticmethod
    def _usage(prompts: list[list[int]], outs: list[Any]) -> dict[str, int]:
        prompt = sum(len(p) for p in prompts)
        completion = sum(len(o.output_ids) for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _requests(self, prompts: list[list[int]], body: dict[str, Any], default_max_tokens: int | None,
                  want_lp: bool, top: int = 0, logprob_start_len: int = -1, chat: bool = False) -> list[Any]:
        """``new_requests`` for an OpenAI body; an error names the OpenAI field (``max_tokens`` or
        ``max_completion_tokens``, not ``sampling_params.max_new_tokens``)."""
        try:
            sp = _sampling(body, default_max_tokens, self.chat_defaults if chat else None)
            return self.server.new_requests(prompts, sp, rid=body.get("rid"),
                                            return_logprob=want_lp, top_logprobs_num=top,
                                            logprob_start_len=logprob_start_len,
                                            stream=False if body.get("stream") is None else body["stream"],
                                            extra_key=body.get("extra_key"), cache_salt=body.get("cache_salt"))
        except BadRequest as exc:
            message = str(exc)
            for ours, theirs in _field_names(body):
                message = message.replace(ours, theirs)
            raise BadRequest(message) from None

    def _text(self, token: int) -> str:
        return self.server.scheduler.decode([token], False)

    @staticmethod
    def _count(body: dict[str, Any], key: str, hi: int) -> int:
        """A log-prob count in [0, hi], read as pydantic reads it (SGLang's): true is 1, false 0, 2.0 is 2."""
        value = body.get(key)
        if value is None or isinstance(value, bool):
            return int(bool(value))
        try:
            return check.integer(value, key, 0, hi)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    async def completions(self, request):
        body = await read_body(request)
        _check_fields(body, "completions")
        want_lp = body.get("logprobs") is not None and body.get("logprobs") is not False
        top = self._count(body, "logprobs", check.MAX_TOP_LOGPROBS)
        echo = _flag(body.get("echo"), "echo", False)
        prompt = body.get("prompt")
        if prompt is None:
            raise BadRequest("'prompt' is required")
        texts = [prompt] if isinstance(prompt, str) else None
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            texts = prompt
        if texts is None and not isinstance(prompt, list):
            raise BadRequest(f"prompt={prompt!r:.80} must be a string, a list of strings, a list of token ids or a "
                             "list of such lists")
        try:
            prompts, _ = await self.server.encode_prompts(**({"text": prompt} if texts is not None
                                                             else {"input_ids": prompt}))
        except BadRequest as exc:  # the error names OpenAI's field
            raise BadRequest(str(exc).replace("'input_ids'", "'prompt'").replace("input_ids", "prompt")) from None
        reqs = self._requests(prompts, body, 16, want_lp, top, 0 if echo and top else -1)
        n = len(reqs) // len(prompts)
        sch = self.server.scheduler
        echo_texts = [texts[i] if texts is not None else sch.decode(p) for i, p in enumerate(prompts)]

        def choice(i: int, out: Any, text: str, lo: int = 0, first: bool = True, at: int = 0,
                   stream: bool = False) -> dict[str, Any]:
            """``at``: the characters of generated text a stream sent before this chunk. ``text_offset`` is where
            each token starts in the choice's text: the echoed prompt's tokens from 0, the generated ones after the
            prompt (with echo) and the characters sent before."""
            with_prompt = echo and first
            if with_prompt:
                text = echo_texts[i // n] + text
            lp = None
            if want_lp:
                pairs = list(zip(out.output_logprobs[lo:], out.output_ids[lo:]))
                tops = (out.output_top or [])[lo:]
                prompt: list[Any] = []  # the echoed prompt's log-probs come first
                if with_prompt and top:
                    prompt = list(zip(out.input_logprobs or [], out.input_ids_for_logprobs or []))
                    tops = list(out.input_top or []) + tops
                pairs = prompt + pairs
                toks = [self._text(t) for _, t in pairs]
                start = (len(echo_texts[i // n]) if echo else 0) + at
                offsets = _offsets(toks[:len(prompt)], 0) + _offsets(toks[len(prompt):], start)
                lp = {"tokens": toks, "token_logprobs": [v for v, _ in pairs],
                      "top_logprobs": [({self._text(t): v for v, t in row} if row else None) for row in tops]
                      if top else [None] * len(toks),
                      "text_offset": offsets}
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": _finish(out)}

        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.server.served_model_name}
        return await self._respond(request, body, prompts, reqs, head, choice)

    async def _render_chat(self, messages: Any, add_generation_prompt: bool, template_kwargs: Any = None) -> str:
        """The chat template's text of ``messages``; ``template_kwargs`` is SGLang's ``chat_template_kwargs`` (extra
        template variables, e.g. Qwen3's enable_thinking). Rendered in a worker thread, without the tokenizer's lock
        (a template renders text, it runs no tokenizer): a long conversation holds neither the event loop nor the
        other requests' tokenizing."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise BadRequest(f"chat_template_kwargs={template_kwargs!r:.80} must be an object")
        if "chat_template" in (template_kwargs or {}):  # SGLang's rule: a client's Jinja would run in the server
            raise BadRequest("chat_template_kwargs.chat_template: a request-supplied chat template is not allowed; "
                             "the model's own template renders the messages")
        tok = self.server.scheduler.tokenizer
        if not getattr(tok, "chat_template", None):
            raise BadRequest("the model's tokenizer has no chat template; use /v1/completions")
        messages = [_tool_arguments(_text_parts(m, i), i) for i, m in enumerate(messages)]
        try:
            return await asyncio.get_running_loop().run_in_executor(None, lambda: tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})))
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
            raise BadRequest(f"cannot apply the chat template: {exc}") from None

    async def tokenize(self, request):
        """SGLang's ``/tokenize`` (``/v1/tokenize``): ``prompt`` (a string or a list of strings) or ``messages``
        (rendered with the chat template, ``add_generation_prompt`` default true) -> ``{tokens, count,
        max_model_len}``. ``add_special_tokens`` (default true) is passed to the tokenizer for a ``prompt``."""
        body = await read_body(request)
        _check_fields(body, "tokenize")
        prompt, messages = body.get("prompt"), body.get("messages")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise BadRequest(f"add_special_tokens={special!r} must be true or false")
        sch = self.server.scheduler
        if (prompt is None) == (messages is None):
            raise BadRequest("send exactly one of 'prompt' and 'messages'")
        if messages is not None:
            gen = _flag(body.get("add_generation_prompt"), "add_generation_prompt", True)
            texts, special = [await self._render_chat(messages, gen, body.get("chat_template_kwargs"))], False
        elif isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)):
            texts = [prompt] if isinstance(prompt, str) else prompt
        else:
            raise BadRequest("'prompt' must be a string or a list of strings")
        one = not isinstance(prompt, list)
        if len(texts) > check.MAX_SEQUENCES:
            raise BadRequest(f"'prompt': {len(texts)} texts; at most {check.MAX_SEQUENCES} per request")
        # a text at a time under the tokenizer's lock, and a text far past the slot refused as /generate refuses it
        ids = await asyncio.get_running_loop().run_in_executor(None, lambda: [
            self.server.encode_text(t, "prompt" if one else f"prompt[{i}]", special) for i, t in enumerate(texts)])
        return json_response({"tokens": ids[0] if one else ids, "count": len(ids[0]) if one else [len(x) for x in ids],
                              "max_model_len": sch.slot_len})

    async def detokenize(self, request):
        """SGLang's ``/detokenize`` (``/v1/detokenize``): ``tokens`` (a list of ids or a list of such lists) ->
        ``{text}`` (a string or a list); ``skip_special_tokens`` default true."""
        body = await read_body(request)
        tokens, skip = body.get("tokens"), body.get("skip_special_tokens", True)
        if not isinstance(skip, bool):
            raise BadRequest(f"skip_special_tokens={skip!r} must be true or false")
        if not isinstance(tokens, list):
            raise BadRequest("'tokens' must be a list of token ids or a list of such lists")
        if not tokens:
            return json_response({"text": ""})
        many = isinstance(tokens[0], list)
        if many and len(tokens) > check.MAX_SEQUENCES:
            raise BadRequest(f"'tokens': {len(tokens)} lists; at most {check.MAX_SEQUENCES} per request")
        sch = self.server.scheduler

        def decode(i: int, ids: Any) -> str:  # in a worker thread, a list at a time under the tokenizer's lock
            try:
                check.token_ids(ids, f"tokens[{i}]" if many else "tokens", sch.lm.vocab_size)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            return sch.decode(ids, skip)

        texts = await asyncio.get_running_loop().run_in_executor(
            None, lambda: [decode(i, ids) for i, ids in enumerate(tokens if many else [tokens])])
        return json_response({"text": texts if many else texts[0]})

    async def chat_completions(self, request):
        body = await read_body(request)
        _check_fields(body, "chat")
        want_lp = _flag(body.get("logprobs"), "logprobs", False)
        top = self._count(body, "top_logprobs", check.MAX_TOP_LOGPROBS)
        if top and not want_lp:
            raise BadRequest("top_logprobs needs logprobs: true")
        text = await self._render_chat(body.get("messages"), True, body.get("chat_template_kwargs"))
        # the template's text holds its special tokens already (a BOS too, where the template writes one)
        prompts, _ = await self.server.encode_prompts(text=text, add_special_tokens=False)
        reqs = self._requests(prompts, body, None, want_lp, top, chat=True)

        def entry(v: float, t: int) -> dict[str, Any]:
            s = self._text(t)
            with self.server.scheduler.tokenizer_lock:
                raw = token_bytes(self.server.scheduler.tokenizer, t, s)
            return {"token": s, "logprob": v, "bytes": raw}

        def choice(i: int, out: Any, text: str, lo: int = 0, first: bool = True, at: int = 0, stream: bool = False):
            lp = None
            if want_lp:
                tops = (out.output_top or [])[lo:] if top else [None] * (len(out.output_ids) - lo)
                lp = {"content": [{**entry(v, t), "top_logprobs": [entry(*x) for x in (row or [])]}
                                  for v, t, row in zip(out.output_logprobs[lo:], out.output_ids[lo:], tops)]}
            # a stream names the role in each choice's first chunk only (clients concatenate a delta's strings)
            msg = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": i, ("delta" if stream else "message"): msg, "logprobs": lp, "finish_reason": _finish(out)}

        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.server.served_model_name}
        return await self._respond(request, body, prompts, reqs, head, choice)

    async def _respond(self, request, body: dict[str, Any], prompts: list[list[int]], reqs: list[Any],
                       head: dict[str, Any], choice):
        with self.server.claim_rids(reqs):  # an abort of a rid reaches these requests and no one else's
            return await self._answer(request, body, prompts, reqs, head, choice)

    async def _answer(self, request, body: dict[str, Any], prompts: list[list[int]], reqs: list[Any],
                      head: dict[str, Any], choice):
        sch = self.server.scheduler
        if not reqs[0].stream:
            outs = await self.server.run_requests(reqs)
            choices = [choice(i, o, sch.output_text(o)) for i, o in enumerate(outs)]
            return json_response({**head, "choices": choices, "usage": self._usage(prompts, outs)})
        chat = head["object"] == "chat.completion"
        chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        include_usage, continuous_usage = _usage_options(body)
        n = len(reqs) // len(prompts)
        sent = [""] * len(reqs)
        sent_tokens: list[int | None] = [None] * len(reqs)  # None: the choice has had no chunk yet
        outs: list[Any] = [None] * len(reqs)
        try:
            async with contextlib.aclosing(self.server.iter_outputs(reqs)) as stream:
                async for i, out in stream:
                    at = len(sent[i])
                    delta, sent[i] = _stream_delta(sent[i], sch.output_text(out), out.finish_reason is not None,
                                                   out.params.stop)
                    lo, first = sent_tokens[i] or 0, sent_tokens[i] is None
                    sent_tokens[i] = len(out.output_ids)
                    chunk = {**chunk_head, "choices": [choice(i, out, delta, lo, first, at, stream=True)]}
                    if continuous_usage:  # SGLang's: this choice's prompt and its tokens so far
                        chunk["usage"] = self._usage([prompts[i // n]], [out])
                    await resp.write(b"data: " + dumps(chunk).encode() + b"\n\n")
                    if out.finish_reason is not None:
                        outs[i] = out
            if include_usage:
                usage = {**chunk_head, "choices": [], "usage": self._usage(prompts, outs)}
                await resp.write(b"data: " + dumps(usage).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; iter_outputs aborted its requests
        return resp
