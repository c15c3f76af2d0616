"""The embedded engine's HTTP server: SGLang's native API (a subset), so it can stand in for a real SGLang server.

``slime-lite serve --model-path DIR --port P`` runs it from the shell; ``EngineServer(...).start()`` runs it inside
a process (a Ray actor, a test) on a background thread with its own event loop. Routes and fields are SGLang's
(names, shapes, defaults); generation happens in the ``Scheduler``'s model thread.

No request can stall or poison the others: every field is checked before admission (``validate``: a 400 naming
the field), bodies are limited (``--max-request-bytes``; 413), one HTTP request holds at most the KV cache's
tokens in the engine at a time (the rest wait their turn), a client that disconnects cancels its requests (and
no one else's: a rid is refused while a request of that rid is live), and ``/health`` answers 503 when generation
is paused or stuck.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
import os
import signal
import tempfile
import threading
import uuid
from collections import Counter
from typing import Any, AsyncIterator

from aiohttp import web

from slime_lite.engine import logprobs as lpx
from slime_lite.engine import validate as check
from slime_lite.engine.http_json import BadRequest, dumps, error_response, json_response, read_body
from slime_lite.engine.info_routes import add_info_routes
from slime_lite.engine.openai_api import add_openai_routes
from slime_lite.engine.request import Request, abort_reason, rid_matches
from slime_lite.engine.sampling import SamplingParams
from slime_lite.engine_client import ENGINE_DOWN
from slime_lite.errors import SlimeLiteError

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8 << 20  # default body limit of every route but the weight upload
WEIGHTS_BODY_LIMIT = 1 << 34
WEIGHTS_ROUTES = ("/update_weights_from_tensor",)
OPEN_ROUTES = ("/health", "/health_generate", "/ready")  # answered without the API key (liveness probes)


def _rid(value: Any) -> str:
    """A request id: a string, as on /abort_request (SGLang's GenerateReqInput and AbortReq take strings only)."""
    if not isinstance(value, str):
        raise BadRequest(f"rid={value!r} must be a string (or a list of them, one per prompt)")
    return value


def _as_list(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name}: got a list of {len(value)} for {n} prompts")
        return value
    return [value] * n


class EngineServer:
    """The engine behind an aiohttp server. ``start()`` returns the base URL (``port=0`` picks a free port)."""

    def __init__(self, model_path: str, *, tokenizer_path: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, dtype: str = "auto", device: str | None = None, seed: int = 0,
                 max_running_requests: int | None = 64, requests_hint: int | None = None,
                 kv_cache_tokens: int | None = None, request_tokens: int | None = None, api_key: str | None = None,
                 served_model_name: str | None = None, cpu_threads: int | None = None,
                 cuda_graph: bool | None = None, cuda_graph_max_bs: int | None = None,
                 enable_torch_compile: bool = False, max_request_bytes: int = MAX_REQUEST_BYTES,
                 disable_radix_cache: bool = False, enable_memory_saver: bool = False,
                 profile_dir: str | None = None, enable_return_routed_experts: bool = False) -> None:
        # torch, transformers: `slime-lite serve --help` stays instant
        from slime_lite.engine.scheduler import Scheduler

        self.host, self.port, self.api_key = host, int(port), api_key
        if max_request_bytes < 1:
            raise SlimeLiteError(f"--max-request-bytes {max_request_bytes}: must be >= 1.")
        self.max_request_bytes = int(max_request_bytes)
        self.scheduler = Scheduler(model_path, tokenizer_path=tokenizer_path, dtype=dtype, device=device,
                                   seed=seed, max_running_requests=max_running_requests,
                                   requests_hint=requests_hint, kv_cache_tokens=kv_cache_tokens,
                                   request_tokens=request_tokens,
                                   cpu_threads=cpu_threads,
                                   cuda_graph=cuda_graph, cuda_graph_max_bs=cuda_graph_max_bs,
                                   enable_torch_compile=enable_torch_compile,
                                   disable_radix_cache=disable_radix_cache,
                                   enable_return_routed_experts=enable_return_routed_experts)
        self.enable_memory_saver = enable_memory_saver
        self.profile_dir = os.path.abspath(profile_dir or default_profile_dir())
        self.served_model_name = served_model_name or model_path
        self.url: str | None = None
        self._live_rids: set[str] = set()  # ids of the /generate requests in flight (read and written in the loop)
        self._waiting_turn: dict[str, Any] = {}  # rid -> request of a batch not submitted yet (in the loop too)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> str:
        """Start the model thread and the HTTP server thread; return ``http://host:port``."""
        self.scheduler.start()
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start_site())
            except BaseException as exc:  # noqa: BLE001 - reported by start()
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="engine-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self.scheduler.stop()
            raise SlimeLiteError(f"engine HTTP server could not listen on {self.host}:{self.port}: {failure[0]}")
        logger.info("engine serving %s at %s", self.scheduler.model_path, self.url)
        return self.url

    async def _start_site(self) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its requests
        self._runner = web.AppRunner(self.make_app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{port}"

    def stop(self) -> None:
        """Abort what runs, stop the model thread, close the HTTP server."""
        self.scheduler.stop()
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        self._thread = self._loop = None

    def run_forever(self) -> None:
        """Serve until SIGINT/SIGTERM (the CLI)."""
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())  # before "ready": a SIGTERM right after it stops cleanly
        url = self.start()
        print(f"slime-lite engine ready at {url}", flush=True)
        try:
            while not done.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    # ---- plumbing ------------------------------------------------------------------------------------------
    def make_app(self):
        from slime_lite.engine.admin_routes import add_admin_routes  # torch, safetensors: when the app is made

        app = web.Application(client_max_size=WEIGHTS_BODY_LIMIT, middlewares=[self._middleware])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        add_info_routes(app, self)
        add_admin_routes(app, self.scheduler, self.profile_dir, abort_waiting=self.abort_waiting)
        # /flush_cache answers GET too (SGLang takes both; slime sends GET)
        r.add_get("/flush_cache", next(x.handler for x in r.routes()
                                       if x.method == "POST" and x.resource.canonical == "/flush_cache"))
        add_openai_routes(app, self)
        return app

    @property
    def _middleware(self):
        @web.middleware
        async def middleware(request, handler):
            if self.api_key and request.path not in OPEN_ROUTES and not hmac.compare_digest(
                    request.headers.get("Authorization", "").encode(), f"Bearer {self.api_key}".encode()):
                return error_response("missing or wrong API key (Authorization: Bearer ...)", 401)
            limit = WEIGHTS_BODY_LIMIT if request.path in WEIGHTS_ROUTES else self.max_request_bytes
            too_large = (f"request body over {limit} bytes (the limit of {request.path}; 'slime-lite serve "
                         "--max-request-bytes' sets it; under 'slime-lite train', 32 bytes a token of the run's longest "
                         "request, --rollout-max-context-len or else the prompt and response bounds, for every request "
                         "of a call)")
            if (request.content_length or 0) > limit:
                return error_response(too_large, 413)
            try:
                return await handler(request.clone(client_max_size=limit))
            except BadRequest as exc:
                return error_response(str(exc))
            except web.HTTPRequestEntityTooLarge:
                return error_response(too_large, 413)
            except web.HTTPException:
                raise
            except Exception as exc:  # noqa: BLE001 - answer, log, keep serving
                logger.exception("%s %s failed", request.method, request.path)
                return error_response(f"{type(exc).__name__}: {exc}", 500)

        return middleware

    # ---- generation ----------------------------------------------------------------------------------------
    def new_requests(self, prompts: list[list[int]], sampling_params: Any, *, rid: Any = None,
                     return_logprob: Any = False, logprob_start_len: Any = -1, top_logprobs_num: Any = 0,
                     token_ids_logprob: Any = None, return_text_in_logprobs: Any = False,
                     stream: Any = False, extra_key: Any = None, cache_salt: Any = None) -> list[Any]:
        """Validated ``Request`` objects: one per prompt and sample (``n``), in prompt-major order. ``BadRequest``
        names the field that is wrong; nothing is submitted."""
        try:
            return self._new_requests(prompts, sampling_params, rid, return_logprob, logprob_start_len,
                                      top_logprobs_num, token_ids_logprob, return_text_in_logprobs, stream,
                                      check.cache_namespaces(extra_key, cache_salt, len(prompts)))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def _new_requests(self, prompts, sampling_params, rid, return_logprob, logprob_start_len, top_logprobs_num,
                      token_ids_logprob, return_text_in_logprobs, stream, spaces) -> list[Any]:
        n_prompts = len(prompts)
        sps = _as_list(sampling_params if sampling_params is not None else {}, n_prompts, "sampling_params")
        if isinstance(sampling_params, list):
            check.objects(sps, "sampling_params")
        lps = [check.boolean(x, "return_logprob") for x in _as_list(return_logprob, n_prompts, "return_logprob")]
        starts = [check.integer(-1 if x is None else x, "logprob_start_len", -1)
                  for x in _as_list(logprob_start_len, n_prompts, "logprob_start_len")]
        tops = [check.integer(0 if x is None else x, "top_logprobs_num", 0, check.MAX_TOP_LOGPROBS)
                for x in _as_list(top_logprobs_num, n_prompts, "top_logprobs_num")]
        if isinstance(token_ids_logprob, list) and token_ids_logprob and isinstance(token_ids_logprob[0], list):
            id_lists = _as_list(token_ids_logprob, n_prompts, "token_ids_logprob")
        else:  # SGLang reads an empty list as not given
            id_lists = [token_ids_logprob if token_ids_logprob != [] else None] * n_prompts
        id_lists = [None if x is None else check.logprob_token_ids(x) for x in id_lists]
        text_lp = check.boolean(return_text_in_logprobs, "return_text_in_logprobs")
        stream = check.boolean(stream, "stream")
        if isinstance(rid, list):
            rids = [None if r is None else _rid(r) for r in _as_list(rid, n_prompts, "rid")]
        elif rid is not None:
            rids = [_rid(rid)] if n_prompts == 1 else [f"{_rid(rid)}_{i}" for i in range(n_prompts)]
        else:
            rids = [None] * n_prompts
        ns = [check.integer(1 if sp.get("n") is None else sp["n"], "sampling_params.n", 1, check.MAX_N)
              if isinstance(sp, dict) else 1 for sp in sps]
        if sum(ns) > check.MAX_SEQUENCES:
            raise BadRequest(f"{n_prompts} prompts x sampling_params.n make {sum(ns)} sequences; at most "
                             f"{check.MAX_SEQUENCES} per request")
        reqs = []
        for ids, sp, n, user_rid, lp, start, top, tids, space in zip(prompts, sps, ns, rids, lps, starts, tops,
                                                                      id_lists, spaces):
            params = SamplingParams.from_dict(sp)
            base = user_rid if user_rid is not None else uuid.uuid4().hex
            for j in range(n):
                req = Request(
                    rid=base if n == 1 else f"{base}_{j}", input_ids=ids, params=params,
                    seed=self.scheduler.derive_seed(params.sampling_seed, user_rid, j), return_logprob=lp,
                    logprob_start_len=start if lp else -1, top_logprobs_num=top if lp else 0,
                    token_ids_logprob=tids if lp else None, return_text_in_logprobs=text_lp, stream=stream,
                    cache_namespace=space,
                )
                self.scheduler.prepare(req)
                reqs.append(req)
            check.logprob_entries(len(ids) - req.logprob_start_len + req.max_new, req.top_logprobs_num,
                                  req.token_ids_logprob)
            check.fits_context(len(ids), params.max_new_tokens if sp.get("max_new_tokens") is not None else None,
                               self.scheduler.context_len)
        return reqs

    def _routed_experts(self, reqs: list[Any], wanted: Any, start: Any) -> None:
        """SGLang's return_routed_experts / routed_experts_start_len on each request (BadRequest when the server
        keeps no routing, or the start is past a prompt)."""
        try:  # a wrong type is the client's: 400 naming the field
            if not check.boolean(wanted, "return_routed_experts"):
                return
            start = check.integer(start, "routed_experts_start_len", 0)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if self.scheduler.lm.routes is None:
            raise BadRequest("return_routed_experts: start the server with --enable-return-routed-experts (an MoE "
                             "model) to get the experts each token was routed to")
        for req in reqs:
            if start > len(req.input_ids):
                raise BadRequest(f"routed_experts_start_len {start} is past the prompt's {len(req.input_ids)} tokens")
            req.return_routed_experts, req.routed_experts_start_len = True, start

    async def encode_prompts(self, text: Any = None, input_ids: Any = None, *,
                             add_special_tokens: bool = True) -> tuple[list[list[int]], bool]:
        """``text`` or ``input_ids`` (one or a list) -> (token id lists, whether the input was a single prompt).
        Texts are tokenized in a worker thread: a big batch of them leaves the other requests' HTTP alone; with the
        tokenizer's special tokens (a BOS where it adds one), as SGLang tokenizes a text prompt, unless
        ``add_special_tokens`` is False (a chat template's text, which holds them already)."""
        if (text is None) == (input_ids is None):
            raise BadRequest("send exactly one of 'text' and 'input_ids'")
        if text is not None:
            single = isinstance(text, str)
            texts = [text] if single else text
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise BadRequest("'text' must be a string or a non-empty list of strings")
            if len(texts) > check.MAX_SEQUENCES:
                raise BadRequest(f"'text': {len(texts)} prompts; at most {check.MAX_SEQUENCES} per request")
            ids = await asyncio.get_running_loop().run_in_executor(
                None, lambda: [self.encode_text(t, "text" if single else f"text[{i}]", add_special_tokens)
                               for i, t in enumerate(texts)])
            return ids, single
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("'input_ids' must be a non-empty list of token ids (or a list of such lists)")
        single = not isinstance(input_ids[0], list)
        prompts = [input_ids] if single else input_ids
        if len(prompts) > check.MAX_SEQUENCES:
            raise BadRequest(f"'input_ids': {len(prompts)} prompts; at most {check.MAX_SEQUENCES} per request")
        for i, p in enumerate(prompts):
            try:
                check.token_ids(p, "input_ids" if single else f"input_ids[{i}]", self.scheduler.lm.vocab_size)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        return prompts, single

    def encode_text(self, text: str, name: str, special: bool) -> list[int]:
        """Token ids of ``text``; a text whose first 64 characters per slot token already overflow the slot is
        refused without tokenizing the rest (tokenizing megabytes holds the tokenizer, and this thread, for seconds)."""
        slot, cut = self.scheduler.slot_len, 64 * self.scheduler.slot_len
        if len(text) > cut and len(self.scheduler.encode(text[:cut], special)) >= slot:
            raise BadRequest(f"{name}: more than {slot} tokens; the batch slot holds {slot} (model context or "
                             "--kv-cache-tokens / --max-running-requests)")
        return self.scheduler.encode(text, special)

    async def iter_outputs(self, reqs: list[Any]) -> AsyncIterator[tuple[int, Any]]:
        """Submit ``reqs``; yield ``(index, RequestOutput)`` as they come; abort what is left if the consumer stops.

        Admission by token budget: the requests of one HTTP request hold at most the KV cache's tokens (prompt plus
        max new tokens each) in the engine at a time, queued or running; the rest are submitted as those finish, so
        a big batch takes turns with other clients' requests instead of queueing ahead of them all. Those waiting
        for their turn are ended by an abort of their rid (``abort_waiting``) or an abort of every request.

        Only each request's newest output waits here (its finish is its last): a stream that is read slower than its
        tokens come (its client, or its chunks' log-probs, which grow with the output) gets fewer chunks, each
        holding everything so far, and holds neither the event loop nor a snapshot per token."""
        loop = asyncio.get_running_loop()
        newest: dict[int, Any] = {}
        ready = asyncio.Event()

        def put(i: int, out: Any) -> None:
            newest[i] = out
            ready.set()

        for i, req in enumerate(reqs):
            req.on_output = lambda out, i=i: loop.call_soon_threadsafe(put, i, out)
            self._waiting_turn[req.rid] = req
        cost = [len(r.input_ids) + r.max_new for r in reqs]
        in_engine = [False] * len(reqs)
        budget, held, submitted, remaining = self.scheduler.kv_cache_tokens, 0, 0, len(reqs)
        try:
            while remaining:
                while submitted < len(reqs) and (held == 0 or held + cost[submitted] <= budget):
                    req = reqs[submitted]
                    if req.finish_reason is None:  # else aborted while it waited: its output is on its way
                        self._waiting_turn.pop(req.rid, None)
                        self.scheduler.submit(req)
                        held += cost[submitted]
                        in_engine[submitted] = True
                    submitted += 1
                await ready.wait()
                ready.clear()
                batch = list(newest.items())
                newest.clear()
                for i, out in batch:
                    if out.finish_reason is not None:
                        remaining -= 1
                        held -= cost[i] if in_engine[i] else 0
                        if out.finish_reason["type"] == "abort" and self._aborted_all(reqs[i]):  # so is the rest
                            for j in range(submitted, len(reqs)):
                                if reqs[j].finish_reason is None:
                                    self._waiting_turn.pop(reqs[j].rid, None)
                                    reqs[j].finish_reason = out.finish_reason
                                    put(j, reqs[j].snapshot(self.scheduler.weight_version))
                            submitted = len(reqs)
                    yield i, out
                    await asyncio.sleep(0)  # other clients' handlers between chunks
        finally:
            for req in reqs:
                if self._waiting_turn.get(req.rid) is req:
                    del self._waiting_turn[req.rid]
            if remaining:
                self.scheduler.cancel([r for r, sent in zip(reqs, in_engine) if sent], "client disconnected")

    def _aborted_all(self, req: Any) -> bool:
        """Whether every request was aborted since ``req`` was made (abort_all, a pause, shutdown): not an abort of
        its rid alone."""
        return req.abort_epoch is None or self.scheduler.abort_epoch > req.abort_epoch

    def abort_waiting(self, rid: str, message: str) -> None:
        """End the requests ``rid`` and ``rid_<i>`` that wait for their batch's turn (not submitted yet, so the
        scheduler's abort misses them) with finish reason abort, as SGLang ends a queued request. In the loop."""
        for key in [k for k in self._waiting_turn if rid_matches(k, rid)]:
            req = self._waiting_turn.pop(key)
            req.finish_reason = abort_reason(message)
            req.on_output(req.snapshot(self.scheduler.weight_version))

    @contextlib.contextmanager
    def claim_rids(self, reqs: list[Any]):
        """The requests' ids are taken while they run. A request with an id that is live, or twice in one batch, is
        a 400 (SGLang's rule): an abort by that id, or a client's disconnect, must not end another one's request."""
        rids = [r.rid for r in reqs]
        taken = sorted({r for r in rids if r in self._live_rids} | {r for r, k in Counter(rids).items() if k > 1})
        if taken:
            raise BadRequest(f"rid: duplicate request id(s) {taken[:5]}: already in flight or repeated in this "
                             "request; give each live request its own rid")
        self._live_rids.update(rids)
        try:
            yield
        finally:
            self._live_rids.difference_update(rids)

    async def run_requests(self, reqs: list[Any]) -> list[Any]:
        outs: list[Any] = [None] * len(reqs)
        async with contextlib.aclosing(self.iter_outputs(reqs)) as outputs:
            async for i, out in outputs:
                if out.finish_reason is not None:
                    outs[i] = out
        return outs

    def format_output(self, req: Any, out: Any) -> dict[str, Any]:
        """One ``/generate`` result object (also a stream chunk, with ``finish_reason`` null until the end)."""
        sch = self.scheduler
        meta: dict[str, Any] = {
            "id": out.rid, "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(out.output_ids), "cached_tokens": out.cached_tokens,
            "weight_version": out.weight_version, "e2e_latency": round(out.e2e_latency, 6),
            "output_token_weight_versions": out.output_weight_versions,
        }
        if req.return_logprob:
            text = (lambda t: sch.decode([t], False)) if req.return_text_in_logprobs else None
            meta.update(lpx.meta_info(out, req.top_logprobs_num, req.token_ids_logprob, text))
        if out.routed_experts is not None:  # SGLang's encoding: base64 of the int32 [positions, layers, top_k]
            meta["routed_experts"] = base64.b64encode(out.routed_experts.numpy().tobytes()).decode("ascii")
        return {"text": sch.output_text(out), "output_ids": out.output_ids, "meta_info": meta}

    async def generate(self, request):
        body = await read_body(request)
        try:
            check.generate_fields(body)
            check.generate_types(body)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        prompts, single = await self.encode_prompts(body.get("text"), body.get("input_ids"))

        def opt(key: str, default: Any) -> Any:
            return default if body.get(key) is None else body[key]

        reqs = self.new_requests(
            prompts, body.get("sampling_params"), rid=body.get("rid"), return_logprob=opt("return_logprob", False),
            logprob_start_len=opt("logprob_start_len", -1), top_logprobs_num=opt("top_logprobs_num", 0),
            token_ids_logprob=body.get("token_ids_logprob"),
            return_text_in_logprobs=opt("return_text_in_logprobs", False), stream=opt("stream", False),
            extra_key=body.get("extra_key"), cache_salt=body.get("cache_salt"),
        )
        self._routed_experts(reqs, opt("return_routed_experts", False), opt("routed_experts_start_len", 0))
        with self.claim_rids(reqs):
            return await self._generate(request, reqs, single)

    async def _generate(self, request, reqs: list[Any], single: bool):
        stream = reqs[0].stream
        single = single and len(reqs) == 1
        sch = self.scheduler
        if not stream:
            outs = await self.run_requests(reqs)
            if not sch.alive and any(o.finish_reason.get("type") == "abort" for o in outs):
                # the model thread is down (SGLang's server would be gone): not an answer, so clients fail over
                return error_response(ENGINE_DOWN + (sch.stop_reason or "the model thread is not running"), 503)
            results = [self.format_output(r, o) for r, o in zip(reqs, outs)]
            return json_response(results[0] if single else results)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            async with contextlib.aclosing(self.iter_outputs(reqs)) as outputs:
                async for i, out in outputs:
                    chunk = self.format_output(reqs[i], out)
                    if not single:
                        chunk["index"] = i
                    await resp.write(b"data: " + dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            logger.info("stream client left; aborted %s", reqs[0].rid if len(reqs) == 1 else f"{len(reqs)} requests")
        return resp


def default_profile_dir() -> str:
    """SGLang's $SGLANG_TORCH_PROFILER_DIR when set, else a folder of the engine's own under the temp folder."""
    return os.environ.get("SGLANG_TORCH_PROFILER_DIR") or os.path.join(tempfile.gettempdir(), "slime-lite-profiles")

