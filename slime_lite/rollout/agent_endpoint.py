"""Black-box agents: an OpenAI-compatible endpoint per trajectory, in front of the engine's ``/generate``.

An agent written against the official ``openai`` client (chat completions, with tools) runs unchanged against the
base URL it is given (``http://127.0.0.1:PORT/t/<trajectory>/v1``). Each chat call is rendered to token ids and sent
to the engine as ``input_ids``; the endpoint records the call's prompt ids, completion ids and log-probs as the
engine produced them, and the trajectory becomes a multi-turn sample from those records, never from the text the
agent got back. A call whose messages extend the previous call's (its messages, then the assistant reply it got,
then new tool or user messages) is sent as the previous prompt + completion ids + the chat template's text of the
new messages only, so earlier turns keep the engine's tokens and the engine reuses their KV (prefix cache); a call
that rewrites the history starts a new segment (one more sample of the same trajectory, sharing ``rollout_id``). A
chat template that renders the earlier turns otherwise once new messages follow (Qwen3 leaves out an earlier turn's
think block, empty or not) does not start one: the engine goes on from the tokens it wrote, and the new messages are
rendered as the template renders them after that history.

Tool calls in the model's text become OpenAI ``tool_calls``, read in the format ``--tool-call-parser`` names
(tool_calls.py); a malformed call is content text, kept and counted (``metadata["malformed_tool_calls"]``). With
``--reasoning-parser`` a thinking model's ``<think>`` block is the reply's ``reasoning_content``, not its content.
``stream: true`` gets the finished reply as OpenAI's chunks. The rollout's sampling parameters apply whatever the
agent sends (the trainer scores at ``--rollout-temperature``); its ``max_tokens``, ``stop`` strings (kept in the
trained tokens), ``logprobs`` and ``chat_template_kwargs`` (over ``--apply-chat-template-kwargs``) are honoured. A
turn that did not end at the template's end of turn (``<|im_end|>``, ``<|eot_id|>``) gets it at the start of the
next call's inserted tokens, as the template renders the turn.

Limits: ``--rollout-max-response-len`` tokens of response in all (model and inserted; calls in flight at once each
reserve what they may write) and ``--max-turns`` calls (those in flight counted); a call past either is a 400 and
the sample ends TRUNCATED. An agent that raises ends it FAILED (``metadata["agent_error"]``). Once over-sampling
has its groups, every open trajectory ends ABORTED (its call in flight aborted by the engine, every later call a
400, an agent busy with its own tools cancelled). What was recorded is kept in each case. Bad input is a 400
naming the field, the engine refusing a call a 400 with its reason, an engine failure a 502; none is recorded.
Calls sent at once from the same history (branches): the first to finish continues that sample, the others start
samples of their own.

Use: ``generate = openai_agent(run)`` in the agent's module, where ``async def run(base_url, sample)`` is the agent
(``sample.prompt``, ``sample.label``, ``sample.metadata`` are the task), and pass
``--custom-generate-function-path module.generate``. An agent written for the synchronous client (``openai.OpenAI``)
is a plain ``def run(base_url, sample)``: it runs in a thread of its own. An ``async def`` agent must use
``openai.AsyncOpenAI``: a blocking call inside it stops the event loop that serves the endpoint, and the call never
gets its answer. ``openai_agent(run, timeout=S)``: an agent still running after S seconds (stuck on its own I/O, or
retrying a refused call forever) is cancelled, its call in flight cancelled at the engine (a 404 for an agent in a
thread, which cannot be stopped), and its sample ends FAILED, what it recorded kept; without it an agent may run as
long as it likes.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import uuid
from typing import Any, Awaitable, Callable

from aiohttp import web

from slime_lite.engine.http_json import BadRequest as HttpBadRequest, read_body
from slime_lite.errors import EngineError
from slime_lite.rollout.agent_messages import (BadRequest, call_options, chat_completion, normalise, read_answer,
                                                render, reply_content, stop_strings, stream_chunks, stream_options,
                                                tool_choice)
from slime_lite.rollout.agent_runner import start_agent
from slime_lite.rollout.agent_samples import Call, segments, trajectory_samples
from slime_lite.rollout.multi_turn import cap_min_new_tokens, context_bound, turn_seed
from slime_lite.rollout.oversample import ON_ABORT
from slime_lite.rollout.tool_calls import detect_parser, end_of_turn, parse_tool_calls, split_reasoning
from slime_lite.rollout.turns import restart
from slime_lite.tokenizer import load_tokenizer
from slime_lite.types import Sample, Status, version_number

log = logging.getLogger(__name__)


class BudgetExhausted(Exception):
    """The trajectory has no response tokens left (``--rollout-max-response-len``)."""


class Finished(Exception):
    """The trajectory closed while the call was in flight (its agent was past its timeout): a 404."""


class Aborted(Exception):
    """The engine aborted a call of the trajectory (over-sampling has its groups, an engine error): the sample ends
    ABORTED."""


class Trajectory:
    """The calls of one agent run and the budget they share."""

    def __init__(self, endpoint: "AgentEndpoint", key: str, sampling_params: dict[str, Any],
                 max_turns: int | None = None, context: int | None = None,
                 template_kwargs: dict[str, Any] | None = None, routing: bool = False) -> None:
        self.endpoint, self.key, self.max_turns, self.context = endpoint, key, max_turns, context
        self.routing = routing  # --use-rollout-routing-replay
        self.sampling_params = dict(sampling_params)
        self.template_kwargs = dict(template_kwargs or {})  # --apply-chat-template-kwargs
        self.budget = int(sampling_params.get("max_new_tokens") or 0) or None
        self.calls: list[Call] = []
        self.sent = 0  # calls sent to the engine, those in flight included (--max-turns counts them)
        self.reserved = 0  # response tokens the calls in flight may still write (the budget they share)
        self.released = asyncio.Event()  # a call in flight has ended: what it did not write is free again
        self.seeded = 0  # calls given a sampling seed (never decreases: a retried call gets a seed of its own)
        self.truncated = False
        self.aborted = False
        self.stopped = asyncio.Event()  # set by ``abort``: the hook stops waiting for the agent
        self.in_flight: set[asyncio.Future] = set()  # engine requests of calls not answered yet (``close`` cancels)
        self.closed = False

    def abort(self) -> None:
        """The rollout has its groups (over-sampling): the trajectory ends ABORTED now, its agent is cancelled
        (or, in a thread, left to the 404s of its next calls) whatever it is doing."""
        self.aborted = True
        self.stopped.set()
        self.released.set()  # calls waiting for the budget end too

    @property
    def base_url(self) -> str:
        return f"{self.endpoint.url}/t/{self.key}/v1"

    def _parent(self, messages: list[dict[str, Any]]) -> Call | None:
        """The latest call whose messages then reply ``messages`` begin with, followed by tool or user messages only
        (calls sent at once from the same history each find the call they branch from)."""
        for prev in reversed(self.calls):
            n = len(prev.messages)
            echo = {k: v for k, v in messages[n].items() if k != "name"} if len(messages) > n else None
            reply = prev.reply  # (an agent may send the reply back without its reasoning_content)
            if echo is not None and "reasoning_content" not in echo:
                reply = {k: v for k, v in reply.items() if k != "reasoning_content"}
            if (echo == reply and messages[:n] == prev.messages  # (a reply echoed with a name: AutoGen's)
                    and all(m["role"] != "assistant" for m in messages[n + 1:])):
                return prev
        return None

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        ep = self.endpoint
        messages = [normalise(m, f"messages[{i}]") for i, m in enumerate(body["messages"])]
        stops = stop_strings(body.get("stop"))
        want_lp, top, agent_kwargs, asked = call_options(body)
        if self.aborted:
            raise Aborted("the engine aborted an earlier call of this trajectory; the sample ends aborted")
        tools, parse = tool_choice(body)
        kwargs = {**self.template_kwargs, **agent_kwargs}
        # rendered and tokenized in a worker thread: megabytes of text take seconds, which would hold every other
        # trajectory's calls (the tokenizer lets go of the GIL)
        text, parent, new_ids = await asyncio.to_thread(self._prepare, messages, self._parent(messages), tools, kwargs)
        if self.aborted:  # meanwhile
            raise Aborted("the rollout aborted this trajectory while the call was rendered; the sample ends aborted")
        if parent is not None:
            prompt_ids, start = parent.prompt_ids + parent.completion_ids + new_ids, parent.start
        else:
            prompt_ids, start = new_ids, len(new_ids)
        rollout_stop = self.sampling_params.get("stop") or []
        rollout_stop = [rollout_stop] if isinstance(rollout_stop, str) else list(rollout_stop)
        params = dict(self.sampling_params, no_stop_trim=True, skip_special_tokens=False,
                      stop_token_ids=sorted({*ep.stop_ids, *(self.sampling_params.get("stop_token_ids") or [])}))
        if stops:
            params["stop"] = rollout_stop + [x for x in stops if x not in rollout_stop]
        if self.budget is not None:
            left = await self._left(prompt_ids, start, parent)
            if self.aborted:  # while it waited
                raise Aborted("the rollout aborted this trajectory while the call waited; the sample ends aborted")
            if self.key not in ep.trajectories:
                raise BadRequest("the trajectory has finished (its agent was stopped)")
            if left <= 0:
                self.truncated = True
                raise BudgetExhausted(f"the trajectory used its {self.budget} response tokens "
                                      "(--rollout-max-response-len)")
            params["max_new_tokens"] = left
        if asked is not None:
            params["max_new_tokens"] = min(asked, params.get("max_new_tokens") or asked)
        if self.context is not None:  # the conversation's tokens, as multi_turn bounds a sample's
            room = self.context - len(prompt_ids)
            if room <= 0:
                self.truncated = True
                raise BudgetExhausted(f"the conversation fills its {self.context} tokens (--rollout-max-context-len)")
            params["max_new_tokens"] = min(params.get("max_new_tokens") or room, room)
        cap_min_new_tokens(params)
        if params.get("sampling_seed") is not None:
            params["sampling_seed"] = turn_seed(int(params["sampling_seed"]), self.seeded)
            self.seeded += 1
        if self.max_turns is not None and self.sent >= self.max_turns:  # (after the budget's wait, if any)
            self.truncated = True
            raise BudgetExhausted(f"the trajectory made its {self.max_turns} calls (--max-turns)")
        request = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True,
                   "return_routed_experts": self.routing}
        if top:
            request["top_logprobs_num"] = top
        self.sent += 1
        inserted = len(prompt_ids) - (len(parent.prompt_ids) + len(parent.completion_ids) if parent else start)
        reserved = inserted + params["max_new_tokens"] if self.budget is not None else 0
        self.reserved += reserved
        engine_call = asyncio.ensure_future(ep.engine_client.generate(request))
        self.in_flight.add(engine_call)
        try:
            out = await engine_call
        except BaseException:
            self.sent -= 1  # not served: the call does not count
            if self.closed and engine_call.cancelled() and not asyncio.current_task().cancelling():
                raise Finished("the trajectory has finished (its agent was stopped); the call was cancelled") from None
            raise
        finally:
            self.in_flight.discard(engine_call)
            self.reserved -= reserved
            self.released.set()
        try:
            meta, ids, log_probs = read_answer(out)
        except ValueError as exc:  # the engine's failure, not a call
            self.sent -= 1
            raise EngineError(str(exc)) from None
        finish_info = meta.get("finish_reason") or {}
        finish = finish_info.get("type") or "stop"
        reasoning, content = split_reasoning(reply_content(out["text"], finish_info.get("matched"), ep.tokenizer),
                                             ep.reasoning_parser)
        parsed = parse_tool_calls(content, ep.stop_texts, ep.parser if parse else None, tools)
        tool_calls = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                      for c in parsed.calls]
        reply: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
        if reasoning:
            reply["reasoning_content"] = reasoning
        if tool_calls:
            reply["tool_calls"] = tool_calls
        n_prev = len(parent.messages) + 1 if parent is not None else 0
        per_token = meta.get("output_token_weight_versions")
        if parent is not None:
            parent.routed_experts = None  # this call's table covers the parent's tokens
        self.calls.append(Call(
            messages=messages, reply=normalise(reply), prompt_ids=list(prompt_ids), completion_ids=ids,
            # the turn's text is its tokens' (a stop string ending inside a token leaves the engine's text shorter)
            log_probs=log_probs, text=ep.tokenizer.decode(ids), finish_reason=finish, extends=parent is not None,
            new_roles=[m["role"] for m in messages[n_prev:]] if parent is not None else [],
            weight_version=None if meta.get("weight_version") is None else str(meta["weight_version"]),
            token_versions=([version_number(str(v)) for v in per_token]
                            if per_token is not None and len(per_token) == len(ids) else None),
            routed_experts=meta.get("routed_experts"), rendered=text if parent is None else None,
            cached_tokens=int(meta.get("cached_tokens") or 0), malformed=parsed.malformed, parent=parent,
            start=start, tools=tools, kwargs=kwargs))
        if finish == "abort":
            self.aborted = True
            raise Aborted(f"the engine aborted this call ({finish_info.get('message') or 'abort'}: over-sampling "
                          "has its groups, or an engine error); the sample ends aborted")
        tops = (meta.get("output_top_logprobs") or [None] * len(ids)) if want_lp else None
        return chat_completion(body.get("model") or ep.model_name, reply, finish, len(prompt_ids), ids, log_probs,
                               tops, ep.tokenizer)

    def _prepare(self, messages: list[dict[str, Any]], parent: Call | None, tools: Any,
                 kwargs: dict[str, Any]) -> tuple[str, Call | None, list[int]]:
        """The call's new text (``render``), the parent call kept, and the text's token ids. A text far longer than
        the context has room for is refused untokenized: a token is at most ``longest_token`` characters (the
        vocabulary's longest; a byte-level token has a character per byte), and x4 leaves room for normalisers that
        compose characters (NFC: up to 3 into 1), so no text that could fit is refused (bar a normaliser that drops
        characters, which chat models' tokenizers do not have)."""
        text, parent = render(self.endpoint, messages, parent, tools, kwargs)
        if self.context is not None:
            room = self.context - (len(parent.prompt_ids) + len(parent.completion_ids) if parent else 0)
            if len(text) > 4 * self.endpoint.longest_token * max(room, 0):
                self.truncated = True
                raise BudgetExhausted(f"messages: {len(text)} characters of new text, far more than the {room} tokens "
                                      f"left of the conversation's {self.context} (--rollout-max-context-len) hold")
        return text, parent, self.endpoint.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def _left(self, prompt_ids: list[int], start: int, parent: Call | None) -> int:
        """Response tokens a call may write: the budget, less every segment's response and what the calls in flight
        reserved (their inserted tokens and what they may write). The segment this call continues (its parent ends
        it) counts as this call's prompt past that segment's own prompt; a call from inside a segment (a branch)
        starts a segment of its own, whose prompt is all it was sent. While those hold all of it the call waits for
        them (calls sent at once from one history then run one after the other); 0 when nothing is left."""
        while True:
            used, own = 0, len(prompt_ids) - start
            for g in segments(self.calls):
                if parent is not None and g[-1] is parent:
                    own = len(prompt_ids) - len(g[0].prompt_ids)
                    continue
                used += len(g[-1].prompt_ids) + len(g[-1].completion_ids) - len(g[0].prompt_ids)
                if any(c is parent for c in g):
                    own = 0
            left = self.budget - used - own - self.reserved
            if left > 0 or not self.reserved or self.aborted:
                return max(left, 0)
            self.released.clear()
            await self.released.wait()

    def samples(self, sample: Sample) -> list[Sample]:
        """The trajectory as training samples (agent_samples.py: one per segment)."""
        return trajectory_samples(self, sample)


class AgentEndpoint:
    """The HTTP server of the trajectories of one process (one event loop): ``/t/<key>/v1/chat/completions`` and
    ``/t/<key>/v1/models`` on 127.0.0.1, a free port."""

    def __init__(self, engine_client: Any, tokenizer: Any, model_name: str = "slime-lite",
                 tool_call_parser: str = "auto", reasoning_parser: str | None = None) -> None:
        self.engine_client, self.tokenizer, self.model_name = engine_client, tokenizer, model_name
        self.reasoning_parser = reasoning_parser  # --reasoning-parser
        self.parser = detect_parser(tokenizer) if tool_call_parser == "auto" else tool_call_parser
        log.info("agent endpoint: tool calls read in the %s format (--tool-call-parser %s)", self.parser,
                 tool_call_parser)
        self.trajectories: dict[str, Trajectory] = {}
        self.end_of_turn = end_of_turn(tokenizer)  # the chat template's (``<|im_end|>`` for ChatML)
        self.longest_token = max(map(len, tokenizer.get_vocab()), default=1)  # characters (Trajectory._prepare)
        self.stop_texts = tuple(t for t in (self.end_of_turn, tokenizer.eos_token) if t)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in self.stop_texts}  # a text that is one token only
        self.stop_ids = sorted({i for t, i in ids.items() if i is not None and tokenizer.convert_ids_to_tokens(i) == t})
        # a turn is closed by the end of turn itself (a turn that ended at EOS still gets it, as the template renders
        # the turn); by any stop token where the end of turn is not one token
        one = ids.get(self.end_of_turn)
        self.closing_ids = {one} if one in self.stop_ids else set(self.stop_ids)
        self._keys = itertools.count()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> "AgentEndpoint":
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/t/{key}/v1/chat/completions", self._chat)
        app.router.add_get("/t/{key}/v1/models", self._models)
        # handler_cancellation: an agent that leaves a call (cancelled, its client's timeout) cancels the call's
        # engine request, which the engine then aborts; the reply it never got is not recorded
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
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

    def open(self, sampling_params: dict[str, Any], max_turns: int | None = None,
             context: int | None = None, template_kwargs: dict[str, Any] | None = None,
             routing: bool = False) -> Trajectory:
        key = f"{next(self._keys)}-{uuid.uuid4().hex[:8]}"
        traj = self.trajectories[key] = Trajectory(self, key, sampling_params, max_turns, context, template_kwargs,
                                                   routing)
        return traj

    def close(self, traj: Trajectory) -> None:
        """The hook is done with ``traj``: calls in flight (an agent in a thread, which cannot be stopped, left
        waiting at its timeout) are cancelled at the engine, not run to their token limit for nobody."""
        self.trajectories.pop(traj.key, None)
        traj.closed = True
        for call in traj.in_flight:
            call.cancel()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "slime-lite"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        traj = self.trajectories.get(request.match_info["key"])
        if traj is None:
            return _error(404, "no such trajectory (it has finished)")
        try:  # strict UTF-8 JSON, no lone surrogate in any text: one would fail the tokenizer with a bare 500
            body = await read_body(request)
        except HttpBadRequest as exc:
            return _error(400, str(exc))
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "messages: a non-empty list is required")
        stream = body.get("stream")
        if stream not in (None, True, False):
            return _error(400, f"stream={stream!r:.40} must be true or false")
        if body.get("n") not in (None, 1):
            return _error(400, f"n={body['n']!r:.40}: one choice per call (call again for another)")
        try:
            include_usage = stream_options(body) if stream else False
            completion = await traj.chat(body)
            if not stream:
                return web.json_response(completion)
            # streamed: the finished completion as OpenAI's chunks (errors above are plain HTTP errors, as OpenAI's)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            for chunk in stream_chunks(completion, include_usage):
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        except (BadRequest, Aborted) as exc:
            return _error(400, str(exc))
        except BudgetExhausted as exc:
            return _error(400, f"{exc}; the sample ends truncated")
        except Finished as exc:
            return _error(404, str(exc))
        except EngineError as exc:  # not recorded: the agent may call again
            if "answered HTTP 4" in str(exc):
                return _error(400, f"the engine refused the call: {exc}")
            return _error(502, f"the engine failed to serve the call: {exc}")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                        else "server_error", "param": None, "code": status}}, status=status)


_ENDPOINTS: dict[int, AgentEndpoint] = {}  # per event loop of this process (the rollout manager has one)
_STARTING: dict[int, asyncio.Task] = {}  # per event loop: the endpoint being started, which every first call awaits


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    return load_tokenizer(path)


async def endpoint_for(args: Any) -> AgentEndpoint:
    """This process's endpoint for the running loop, started on first use."""
    loop = asyncio.get_running_loop()
    ep = _ENDPOINTS.get(id(loop))
    if ep is None or ep.loop is not loop:
        # a rollout starts its hooks at once: they all wait for one server (a failed start is tried again)
        starting = _STARTING.get(id(loop))
        if starting is None or starting.get_loop() is not loop:
            starting = _STARTING[id(loop)] = loop.create_task(AgentEndpoint(
                args.engine_client, _tokenizer(args.hf_checkpoint), str(args.hf_checkpoint),
                args.tool_call_parser, args.reasoning_parser).start())
        try:
            ep = _ENDPOINTS[id(loop)] = await asyncio.shield(starting)
        finally:
            if starting.done() and _STARTING.get(id(loop)) is starting:
                del _STARTING[id(loop)]
    ep.engine_client = args.engine_client
    return ep


Agent = Callable[[str, Sample], Awaitable[Any] | Any]  # async def, or a plain def run in a thread


def _abort_trajectories() -> None:
    """Over-sampling aborts its groups: every open trajectory of this loop's endpoint ends ABORTED."""
    ep = _ENDPOINTS.get(id(asyncio.get_running_loop()))
    for traj in list(ep.trajectories.values()) if ep is not None else []:
        traj.abort()


ON_ABORT.append(_abort_trajectories)


async def stop_endpoint() -> None:
    """Stop the running event loop's endpoint, if a hook started one (the rollout manager's close)."""
    ep = _ENDPOINTS.pop(id(asyncio.get_running_loop()), None)
    if ep is not None:
        await ep.stop()


def openai_agent(run: Agent, timeout: float | None = None) -> Callable[..., Awaitable[Sample | list[Sample]]]:
    """A ``--custom-generate-function-path`` hook that runs ``run(base_url, sample)`` against a fresh trajectory
    and returns the sample built from its records (a list when the agent rewrote its history)."""

    async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any],
                       evaluation: bool = False) -> Sample | list[Sample]:
        if sample.status is Status.ABORTED:  # carried by --partial-rollout: the agent runs again from the start
            restart(sample)
        ep = await endpoint_for(args)
        traj = ep.open(sampling_params, args.max_turns, context_bound(args, evaluation),
                       args.apply_chat_template_kwargs, bool(args.use_rollout_routing_replay))
        error = None
        agent = start_agent(run, traj.base_url, sample)
        stopped = asyncio.ensure_future(traj.stopped.wait())
        try:
            done, _ = await asyncio.wait({agent, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if agent not in done:  # (a thread cannot be stopped: its calls from now on are answered 404)
                agent.cancel()
                await asyncio.gather(agent, return_exceptions=True)
                if not traj.aborted:
                    error = f"the agent did not finish within its {timeout:g} s (openai_agent's timeout)"
            elif agent.cancelled():  # it raised CancelledError itself (the hook was not cancelled: it is here)
                error = "the agent was cancelled (it raised CancelledError)"
            elif agent.exception() is not None:  # the agent's failure ends this sample, not the rollout
                error = f"{type(agent.exception()).__name__}: {agent.exception()}"
        finally:
            stopped.cancel()
            if not agent.done():  # the hook itself was cancelled
                agent.cancel()
            ep.close(traj)
        out = traj.samples(sample)
        if error is not None and not traj.truncated and not traj.aborted:
            log.warning("agent of sample %s failed: %s", sample.index, error)
            for s in out:
                s.status = Status.FAILED
                s.metadata["agent_error"] = error
        return out[0] if len(out) == 1 else out

    generate.__name__ = getattr(run, "__name__", "generate")
    return generate
