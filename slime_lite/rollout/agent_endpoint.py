"""Black-box agents: an OpenAI-compatible endpoint per trajectory, in front of the engine's ``/generate``.

An agent written against the official ``openai`` client (chat completions, with tools) runs unchanged against the
base URL it is given (``http://127.0.0.1:PORT/t/<trajectory>/v1``). Each chat call is rendered to token ids and sent
to the engine as ``input_ids``; the endpoint records the call's prompt ids, completion ids and log-probs as the
engine produced them, and the trajectory becomes a multi-turn sample from those records, never from the text the
agent got back. A call whose messages extend the previous call's (its messages, then the assistant reply it got,
then new tool or user messages) is sent as the previous prompt + completion ids + the chat template's text of the
new messages only, so earlier turns keep the engine's tokens and the engine reuses their KV (prefix cache); a call
that rewrites the history starts a new segment (one more sample of the same trajectory, sharing ``rollout_id``).

Tool calls in the model's text, Qwen/Hermes ``<tool_call>{json}</tool_call>`` blocks, become OpenAI ``tool_calls``
(``finish_reason`` "tool_calls"); a malformed block is returned as content text, stays in the trajectory and is
counted (``metadata["malformed_tool_calls"]``).

The rollout's sampling parameters apply, whatever the agent sends (the trainer scores tokens at
``--rollout-temperature``): the agent's temperature, top_p and seed are ignored, its ``max_tokens`` is honoured
below the trajectory's budget, ``--rollout-max-response-len`` tokens of response in all (model and inserted
tokens). A call past the budget is answered 400 and the sample ends TRUNCATED; an agent that raises ends it FAILED
(``metadata["agent_error"]``); what was recorded is kept either way. Assistant turns end at ``<|im_end|>``
(ChatML templates: Qwen and the tiny model) or the model's EOS. More than ``--max-turns`` calls is answered 400
too (TRUNCATED).

Use: ``generate = openai_agent(run)`` in the agent's module, where ``async def run(base_url, sample)`` is the agent
(``sample.prompt``, ``sample.label``, ``sample.metadata`` are the task), and pass
``--custom-generate-function-path module.generate``.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web

from slime_lite.rollout.tool_calls import inserted_text, parse_tool_calls
from slime_lite.rollout.turns import append_turn
from slime_lite.tokenizer import load_tokenizer
from slime_lite.types import Sample, Status

log = logging.getLogger(__name__)

END_OF_TURN = "<|im_end|>"


@dataclass
class Call:
    """One chat call as the engine served it."""

    messages: list[dict[str, Any]]  # as the agent sent them (normalised)
    reply: dict[str, Any]  # the assistant message returned
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str
    extends: bool  # prompt_ids = the previous call's prompt + completion + the new messages' tokens
    new_roles: list[str] = field(default_factory=list)  # roles of the messages added since the previous call
    weight_version: str | None = None
    cached_tokens: int = 0
    malformed: int = 0


class BudgetExhausted(Exception):
    """The trajectory has no response tokens left (``--rollout-max-response-len``)."""


def _normalise(message: Any) -> dict[str, Any]:
    """A message as compared between calls: role, content ("" for none), tool calls (name, parsed arguments)."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append({"name": fn.get("name"), "arguments": args})
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out: dict[str, Any] = {"role": message.get("role"), "content": content or ""}
    if calls:
        out["tool_calls"] = [{"type": "function", "function": c} for c in calls]
    return out


class Trajectory:
    """The calls of one agent run and the budget they share."""

    def __init__(self, endpoint: "AgentEndpoint", key: str, sampling_params: dict[str, Any],
                 max_turns: int | None = None) -> None:
        self.endpoint, self.key, self.max_turns = endpoint, key, max_turns
        self.sampling_params = dict(sampling_params)
        self.budget = int(sampling_params.get("max_new_tokens") or 0) or None
        self.calls: list[Call] = []
        self.truncated = False

    @property
    def base_url(self) -> str:
        return f"{self.endpoint.url}/t/{self.key}/v1"

    def _extends(self, messages: list[dict[str, Any]]) -> bool:
        if not self.calls:
            return False
        prev = self.calls[-1]
        n = len(prev.messages)
        return (len(messages) > n and messages[:n] == prev.messages and messages[n] == prev.reply
                and all(m["role"] != "assistant" for m in messages[n + 1:]))

    def _response_tokens(self, prompt_ids: list[int]) -> int:
        """Response tokens of the current segment if the next prompt is ``prompt_ids``."""
        first = next(c for c in reversed(self.calls) if not c.extends) if self.calls else None
        return len(prompt_ids) - len(first.prompt_ids) if first is not None else 0

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        ep = self.endpoint
        messages = [_normalise(m) for m in body["messages"]]
        tok = ep.tokenizer
        extends = self._extends(messages)
        if extends:
            prev = self.calls[-1]
            n = len(prev.messages) + 1
            text = inserted_text(tok, messages[:n], messages[n:], END_OF_TURN)
            prompt_ids = prev.prompt_ids + prev.completion_ids + tok(text, add_special_tokens=False)["input_ids"]
        else:
            text = tok.apply_chat_template(messages, tools=body.get("tools"), tokenize=False,
                                           add_generation_prompt=True)
            prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
        used = self._response_tokens(prompt_ids) if extends else 0
        if self.max_turns is not None and len(self.calls) >= self.max_turns:
            self.truncated = True
            raise BudgetExhausted(f"the trajectory made its {self.max_turns} calls (--max-turns)")
        params = dict(self.sampling_params, no_stop_trim=True, skip_special_tokens=False,
                      stop_token_ids=ep.stop_ids)
        if self.budget is not None:
            left = self.budget - used
            if left <= 0:
                self.truncated = True
                raise BudgetExhausted(f"the trajectory used its {self.budget} response tokens "
                                      "(--rollout-max-response-len)")
            params["max_new_tokens"] = left
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(asked, int) and asked > 0:
            params["max_new_tokens"] = min(asked, params.get("max_new_tokens", asked))
        if params.get("sampling_seed") is not None:
            params["sampling_seed"] = int(params["sampling_seed"]) + 7919 * len(self.calls)
        out = await ep.engine_client.generate({"input_ids": prompt_ids, "sampling_params": params,
                                               "return_logprob": True})
        meta = out["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type") or "stop"
        parsed = parse_tool_calls(out["text"], strip=ep.stop_texts)
        tool_calls = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                      for c in parsed.calls]
        reply: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        n_prev = len(self.calls[-1].messages) + 1 if extends else 0
        self.calls.append(Call(
            messages=messages, reply=_normalise(reply), prompt_ids=list(prompt_ids),
            completion_ids=list(out["output_ids"]), log_probs=[float(t[0]) for t in meta["output_token_logprobs"]],
            text=out["text"], finish_reason=finish, extends=extends,
            new_roles=[m["role"] for m in messages[n_prev:]] if extends else [],
            weight_version=None if meta.get("weight_version") is None else str(meta["weight_version"]),
            cached_tokens=int(meta.get("cached_tokens") or 0), malformed=parsed.malformed))
        reason = "tool_calls" if tool_calls else ("length" if finish == "length" else "stop")
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or ep.model_name,
                "choices": [{"index": 0, "message": reply, "logprobs": None, "finish_reason": reason}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out["output_ids"]),
                          "total_tokens": len(prompt_ids) + len(out["output_ids"])}}

    def samples(self, sample: Sample) -> list[Sample]:
        """The trajectory as samples built from the records: one per segment (usually one), sharing rollout_id.
        Each starts from its first call's prompt ids; each later call adds its new tokens (tool or user turns,
        loss_mask 0) and its completion (the engine's ids and log-probs)."""
        segments: list[list[Call]] = []
        for call in self.calls:
            if call.extends and segments:
                segments[-1].append(call)
            else:
                segments.append([call])
        out = []
        for k, segment in enumerate(segments or [[]]):
            s = sample if k == 0 else copy.deepcopy(sample)
            s.response, s.response_length, s.loss_mask, s.rollout_log_probs = "", 0, None, None
            s.metadata.pop("turns", None)
            s.weight_versions = []
            s.tokens = list(segment[0].prompt_ids) if segment else list(sample.tokens)
            for call in segment:
                new = call.prompt_ids[len(s.tokens):]
                if new:
                    source = "tool" if "tool" in call.new_roles else "user"
                    append_turn(s, new, source=source, text=self.endpoint.tokenizer.decode(new))
                append_turn(s, call.completion_ids, call.log_probs, source="model", text=call.text)
                if call.weight_version is not None:
                    s.weight_versions.append(call.weight_version)
            last = segment[-1] if segment else None
            s.status = Status.from_finish_reason(last.finish_reason) if last else Status.FAILED
            if self.truncated:
                s.status = Status.TRUNCATED
            s.prefix_cache_info.cached_tokens = sum(c.cached_tokens for c in segment)
            s.prefix_cache_info.total_prompt_tokens = sum(len(c.prompt_ids) for c in segment)
            s.metadata.update(agent_calls=len(segment), tool_calls=sum(len(c.reply.get("tool_calls", []))
                                                                       for c in segment),
                              malformed_tool_calls=sum(c.malformed for c in segment))
            if len(segments) > 1:
                s.rollout_id = sample.index if sample.rollout_id is None else sample.rollout_id
                s.metadata["agent_segment"] = k
            out.append(s)
        return out


class AgentEndpoint:
    """The HTTP server of the trajectories of one process (one event loop): ``/t/<key>/v1/chat/completions`` and
    ``/t/<key>/v1/models`` on 127.0.0.1, a free port."""

    def __init__(self, engine_client: Any, tokenizer: Any, model_name: str = "slime-lite") -> None:
        self.engine_client, self.tokenizer, self.model_name = engine_client, tokenizer, model_name
        self.trajectories: dict[str, Trajectory] = {}
        self.stop_texts = tuple(t for t in (END_OF_TURN, tokenizer.eos_token) if t)
        self.stop_ids = sorted({tokenizer.convert_tokens_to_ids(t) for t in self.stop_texts
                                if tokenizer.convert_tokens_to_ids(t) is not None})
        self._keys = itertools.count()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> "AgentEndpoint":
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/t/{key}/v1/chat/completions", self._chat)
        app.router.add_get("/t/{key}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # the port the OS picked
        self.url, self.loop = f"http://127.0.0.1:{port}", asyncio.get_running_loop()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, sampling_params: dict[str, Any], max_turns: int | None = None) -> Trajectory:
        key = f"{next(self._keys)}-{uuid.uuid4().hex[:8]}"
        traj = self.trajectories[key] = Trajectory(self, key, sampling_params, max_turns)
        return traj

    def close(self, traj: Trajectory) -> None:
        self.trajectories.pop(traj.key, None)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "slime-lite"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        traj = self.trajectories.get(request.match_info["key"])
        if traj is None:
            return _error(404, "no such trajectory (it has finished)")
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "messages: a non-empty list is required")
        if body.get("stream"):
            return _error(400, "stream: not supported by the agent endpoint; call without stream")
        if body.get("n", 1) != 1:
            return _error(400, "n: one choice per call")
        try:
            return web.json_response(await traj.chat(body))
        except BudgetExhausted as exc:
            return _error(400, f"{exc}; the sample ends truncated")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                             status=status)


_ENDPOINTS: dict[int, AgentEndpoint] = {}  # per event loop of this process (the rollout manager has one)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    return load_tokenizer(path)


async def endpoint_for(args: Any) -> AgentEndpoint:
    """This process's endpoint for the running loop, started on first use."""
    loop = asyncio.get_running_loop()
    ep = _ENDPOINTS.get(id(loop))
    if ep is None or ep.loop is not loop:
        ep = _ENDPOINTS[id(loop)] = await AgentEndpoint(args.engine_client, _tokenizer(args.hf_checkpoint),
                                                        str(args.hf_checkpoint)).start()
    ep.engine_client = args.engine_client
    return ep


Agent = Callable[[str, Sample], Awaitable[Any]]


def openai_agent(run: Agent) -> Callable[..., Awaitable[Sample | list[Sample]]]:
    """A ``--custom-generate-function-path`` hook that runs ``run(base_url, sample)`` against a fresh trajectory
    and returns the sample built from its records (a list when the agent rewrote its history)."""

    async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample | list[Sample]:
        ep = await endpoint_for(args)
        traj = ep.open(sampling_params, args.max_turns)
        error = None
        try:
            await run(traj.base_url, sample)
        except Exception as exc:  # the agent's failure ends this sample, not the rollout
            error = f"{type(exc).__name__}: {exc}"
        finally:
            ep.close(traj)
        out = traj.samples(sample)
        if error is not None and not traj.truncated:
            log.warning("agent of sample %s failed: %s", sample.index, error)
            for s in out:
                s.status = Status.FAILED
                s.metadata["agent_error"] = error
        return out[0] if len(out) == 1 else out

    generate.__name__ = getattr(run, "__name__", "generate")
    return generate
