"""Clients of the SGLang-compatible engine API (embedded engine or real SGLang), sync and async.

Every call has a timeout; a failed engine is reported with its URL and the request that failed.
Imports nothing heavy, so the driver, the trainer and the debug tools all use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from slime_lite.errors import EngineError, EngineTimeout, EngineUnreachable

log = logging.getLogger(__name__)

API_KEY_ENV = "SLIME_LITE_ENGINE_API_KEY"  # the engines' API key (never on a command line)
API_KEY_FILE_ENV = "SLIME_LITE_ENGINE_API_KEY_FILE"  # or a file holding it
REPLACEMENT_WAIT_S = 3600.0  # --use-fault-tolerance: the longest a request waits for a restarted engine
# after a request timed out: the engine is alive if /health answers within this (longer than the 20 s that SGLang's
# and the embedded engine's /health give a generation before answering 503)
HEALTH_TIMEOUT_S = 30.0
# how the embedded engine's 503 begins once its model thread is down: no answer of a live engine, so the client takes
# that engine out at once (as one whose process died) instead of sending the request to it again
ENGINE_DOWN = "engine down: "
# how the abort message of a request the embedded engine failed (not its client, not a pause) begins: the engine answers
# 200 with finish reason abort; the client sends such a request again (ENGINE_ERROR_RETRIES times, to another live
# engine where there is one), so a device error that a step hit loses no group
ENGINE_ERROR = "engine error: "
ENGINE_ERROR_RETRIES = 2
# /generate answered with an HTTP 5xx (SGLang's 503 "Retracted ... Retry later", a 500 abort; not ENGINE_DOWN): the
# engine is alive, so the request is sent again (to the least-loaded engine) after 0.5, 1, 2, 4, 8 s, and no engine is
# taken out
ANSWERED_5XX_RETRIES = 5
ANSWERED_5XX_BACKOFF_S = 0.5
# engines are reached directly, as the async client and SentRequest reach them: an http_proxy of the environment
# (set on many clusters for pip) would send the health checks of servers on 127.0.0.1 or this node to the proxy
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def lora_adapter_name(version: int) -> str:
    """The name a real SGLang engine holds the adapters of weight version ``version`` under (LoRA with
    ``--rollout-backend sglang``); /generate names it in ``lora_path``."""
    return f"slime_lite_lora_v{version}"


def normalize_url(address: str) -> str:
    """An engine's base URL from ``host:port`` or a URL: http:// when no scheme is given, no trailing slash."""
    address = address.strip().rstrip("/")
    return address if "://" in address else f"http://{address}"


def api_key() -> str | None:
    """The engines' API key: $SLIME_LITE_ENGINE_API_KEY, else the first line of $SLIME_LITE_ENGINE_API_KEY_FILE."""

    key = os.environ.get(API_KEY_ENV, "").strip()
    path = os.environ.get(API_KEY_FILE_ENV, "")
    if not key and path:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as exc:
            raise EngineError(f"{API_KEY_FILE_ENV}={path}: cannot read the API key ({exc.strerror})") from None
    return key or None


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer KEY`` when an API key is set (engines without a key ignore it)."""
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def _describe(body: Any) -> str:
    text = json.dumps(body, default=str) if body is not None else ""
    return text if len(text) < 300 else text[:300] + "..."


def request_json(url: str, route: str, body: Any = None, *, timeout: float = 60.0, method: str | None = None) -> Any:
    """Synchronous JSON request (direct, no proxy); ``body=None`` means GET. Raises EngineError naming the URL on
    failure."""
    data = None if body is None else json.dumps(body).encode()
    try:
        req = urllib.request.Request(
            url.rstrip("/") + route,
            data=data,
            method=method or ("GET" if body is None else "POST"),
            headers={"Content-Type": "application/json", **auth_headers()},
        )
        with _DIRECT.open(req, timeout=timeout) as resp:
            raw = resp.read()
    except (ValueError, OverflowError, http.client.InvalidURL) as exc:  # the URL: no scheme, a port not a number
        raise EngineError(f"{url}: not an engine URL http://HOST:PORT ({exc})") from None
    except urllib.error.HTTPError as exc:
        raise _http_error(url, route, exc.code, exc.read(), body) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError, http.client.HTTPException) as exc:
        raise _no_answer(url, route, getattr(exc, "reason", exc), body) from None
    return _parse(raw)


class SentRequest:
    """A JSON POST already sent: ``result()`` reads the answer (parsed and failing as ``request_json``'s), so the
    caller can work while the engine does (the weight check hashes the trainer's tensors while the engines hash
    theirs, in one thread: no GIL handoffs). A direct connection (no proxy from the environment)."""

    def __init__(self, url: str, route: str, body: Any, *, timeout: float = 60.0) -> None:
        self.url, self.route, self.body = url, route, body
        parts = urlsplit(url.rstrip("/") + route)
        https = parts.scheme == "https"
        try:
            port = parts.port or (443 if https else 80)
        except ValueError as exc:  # a port out of range
            raise _no_answer(url, route, exc, body) from None
        kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
        self._conn = kind(parts.hostname or "", port, timeout=timeout)
        try:
            self._conn.request("POST", parts.path + (f"?{parts.query}" if parts.query else ""),
                               json.dumps(body).encode(), {"Content-Type": "application/json", **auth_headers()})
        except OSError as exc:
            self._conn.close()
            raise _no_answer(url, route, exc, body) from None

    def result(self) -> Any:
        try:
            resp = self._conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise _no_answer(self.url, self.route, exc, self.body) from None
        finally:
            self._conn.close()
        if resp.status >= 400:
            raise _http_error(self.url, self.route, resp.status, raw, self.body)
        return _parse(raw)

    def close(self) -> None:
        """Drop the connection without reading the answer (safe after ``result()``)."""
        self._conn.close()


def on_all(urls: list[str], fn: Callable[[str], Any]) -> list[Any]:
    """``fn(url)`` for every engine at once (a thread each); the results in the order of ``urls``."""
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        return list(pool.map(fn, urls))


@contextlib.contextmanager
def sent_to_all(urls: list[str], route: str, body: Any, timeout: float) -> Iterator[list[SentRequest]]:
    """The same POST sent to every engine now (``SentRequest``s, read by the caller while or after it works, in one
    thread); on the way out every connection is closed, also those not read after a failure."""
    sent: list[SentRequest] = []
    try:
        for url in urls:
            sent.append(SentRequest(url, route, body, timeout=timeout))
        yield sent
    finally:
        for request in sent:
            request.close()


def _http_error(url: str, route: str, code: int, raw: bytes, body: Any) -> EngineError:
    detail = raw.decode(errors="replace")[:500]
    return EngineError(f"engine {url}{route} answered HTTP {code}: {detail} (request: {_describe(body)})")


def _no_answer(url: str, route: str, reason: Any, body: Any) -> EngineUnreachable:
    return EngineUnreachable(f"engine {url}{route} did not answer ({reason}); request: {_describe(body)}", url, route,
                             reason)


def _parse(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.decode(errors="replace")


def engine_failed(out: Any) -> bool:
    """Whether a /generate answer is a request the engine failed (aborted with an ``ENGINE_ERROR`` message)."""
    reason = (out.get("meta_info") or {}).get("finish_reason") if isinstance(out, dict) else None
    return isinstance(reason, dict) and reason.get("type") == "abort" \
        and str(reason.get("message", "")).startswith(ENGINE_ERROR)


# the fields of a batched /generate body (SGLang's GenerateReqInput) that hold one value per prompt when a list (a
# flat token_ids_logprob is every prompt's; a list of lists, one each)
PER_PROMPT = ("text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
              "token_ids_logprob", "lora_path", "image_data", "audio_data", "video_data", "custom_logit_processor",
              "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "extra_key", "cache_salt",
              "session_params", "bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank")


def batch_size(body: dict[str, Any]) -> int | None:
    """How many prompts a batched /generate body holds (a list of texts or of token-id lists); None: one prompt."""
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text)
    return len(ids) if isinstance(ids, list) and ids and isinstance(ids[0], list) else None


def batch_items(body: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """The batched /generate ``body`` cut to its prompts at ``keep`` (a per-prompt list field cut, the rest kept; one
    ``rid`` for the batch becomes the names the engine gave those prompts, ``rid_<i>``)."""
    n = batch_size(body)

    def cut(k: str, v: Any) -> Any:
        if k == "rid" and isinstance(v, str) and n and n > 1:
            return [f"{v}_{i}" for i in keep]
        per_prompt = isinstance(v, list) and len(v) == n and (k != "token_ids_logprob" or isinstance(v[0], list))
        return [v[i] for i in keep] if k in PER_PROMPT and per_prompt else v

    return {k: cut(k, v) for k, v in body.items()}


class AsyncEngineClient:
    """Sends /generate requests to a set of engines, least-loaded first, retrying on the others if one dies."""

    def __init__(self, urls: list[str], timeout: float = 300.0, max_retries: int = 2,
                 wait_for_replacement: bool = False) -> None:
        if not urls:
            raise EngineError("no engine URLs to send requests to")
        self.urls = list(urls)
        self.timeout = timeout
        self.max_retries = max_retries
        # --use-fault-tolerance: the driver restarts a failed engine and calls replace(); a request that failed is
        # retried on the live engines, and waits for a replacement when none is left
        self.wait_for_replacement = wait_for_replacement
        self.inflight = {u: 0 for u in self.urls}
        self.dead: dict[str, str] = {}
        self._session = None
        # LoRA on real SGLang: the adapter every /generate names (lora_path), the newest pushed (lora_adapter_name)
        self.lora_path: str | None = None

    async def _get_session(self):
        import aiohttp  # aiohttp: only the async client needs it (the driver, the tools: sync)

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(limit=0),
                headers=auth_headers(),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _pick(self, avoid: Collection[str] = ()) -> str:
        alive = [u for u in self.urls if u not in self.dead]
        if not alive:
            raise EngineError("all engines failed: " + "; ".join(f"{u}: {why}" for u, why in self.dead.items()))
        return min([u for u in alive if u not in avoid] or alive, key=lambda u: self.inflight[u])

    async def _pick_or_wait(self, avoid: Collection[str] = ()) -> str:
        """``_pick``; under ``wait_for_replacement`` a request with no live engine waits until one is replaced."""
        deadline = time.monotonic() + REPLACEMENT_WAIT_S
        while self.wait_for_replacement and all(u in self.dead for u in self.urls):
            if time.monotonic() > deadline:
                raise EngineError(f"no engine was replaced within {REPLACEMENT_WAIT_S:.0f}s: "
                                  + "; ".join(f"{u}: {why}" for u, why in self.dead.items()))
            await asyncio.sleep(0.1)
        return self._pick(avoid)

    def failed(self) -> list[str]:
        """The current engine URLs whose requests failed (to be replaced); safe to call from another thread."""
        dead = dict(self.dead)
        return [u for u in list(self.urls) if u in dead]

    def replace(self, old: str, new: str) -> None:
        """``new`` (a restarted engine, or a restarted router) serves in place of ``old``; requests waiting for a
        live engine go on. Safe to call from another thread (the waiters poll)."""
        i = self.urls.index(old)
        self.inflight.setdefault(new, 0)  # old's entry stays: its requests still in flight decrement it
        self.dead.pop(new, None)
        self.urls[i] = new
        self.dead.pop(old, None)

    async def post(self, url: str, route: str, body: Any) -> Any:
        import aiohttp  # aiohttp: only the async client needs it (the driver, the tools: sync)

        session = await self._get_session()
        try:
            async with session.post(url + route, json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EngineError(f"engine {url}{route} answered HTTP {resp.status}: {text[:500]}")
                return json.loads(text) if text else None
        except asyncio.TimeoutError:
            raise EngineTimeout(f"engine {url}{route} did not answer within --rollout-request-timeout "
                                f"{self.timeout:g}s; last request: {_describe(body)}") from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise EngineError(
                f"engine {url}{route} failed ({type(exc).__name__}: {exc}); last request: {_describe(body)}"
            ) from None

    async def _answers_health(self, url: str) -> bool:
        """Whether the engine answers ``/health`` (200) within ``HEALTH_TIMEOUT_S``: alive, though a request timed
        out."""
        import aiohttp

        session = await self._get_session()
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
            return False

    async def generate(self, body: dict[str, Any]) -> Any:
        """POST /generate on the least-loaded live engine; on a dead engine, retry on another; on an HTTP 5xx
        answer (the engine is alive), retry after a pause (``ANSWERED_5XX_RETRIES``), unless it says ``ENGINE_DOWN``
        (dead). A request the engine failed (``ENGINE_ERROR``: a step raised) is sent again, the other requests of a
        batch kept. With ``lora_path`` set, a body that names no adapter gets it."""
        if self.lora_path is not None and body.get("lora_path") is None:
            body = {**body, "lora_path": self.lora_path}
        url, out = await self._generate(body)
        n = batch_size(body)
        if not (isinstance(out, dict) if n is None else isinstance(out, list) and len(out) == n):
            return out  # sampling params' n > 1: n answers a prompt, and a failed one is not sent again alone
        failed_on = {url}  # the engines that failed a request of this call: the others first
        for attempt in range(ENGINE_ERROR_RETRIES):
            outs = [out] if n is None else out
            failed = [i for i, o in enumerate(outs) if engine_failed(o)]
            if not failed:
                break
            log.warning("engine %s failed %d request(s) of this call (%s); sent again (%d/%d)", url, len(failed),
                        outs[failed[0]]["meta_info"]["finish_reason"]["message"], attempt + 1, ENGINE_ERROR_RETRIES)
            try:
                url, again = await self._generate(body if n is None else batch_items(body, failed), avoid=failed_on)
            except EngineError as exc:  # (e.g. no live engine left): the answers as they came back
                log.warning("sending the failed request(s) again failed: %s", exc)
                break
            failed_on.add(url)
            if n is None:
                out = again
            elif isinstance(again, list) and len(again) == len(failed):
                for i, o in zip(failed, again):
                    out[i] = o
            else:
                break
        return out

    async def _generate(self, body: dict[str, Any], avoid: Collection[str] = ()) -> tuple[str, Any]:
        """(the engine that answered, its answer) of one POST /generate, sent as ``generate`` says; ``avoid``:
        engines to skip while another is live."""
        attempts = answered = 0
        while True:
            url = await self._pick_or_wait(avoid)
            self.inflight[url] += 1
            try:
                return url, await self.post(url, "/generate", body)
            except EngineError as exc:
                status = str(exc).partition(" answered HTTP ")[2][:1]
                if status == "4":
                    raise  # the request itself is bad; another engine would refuse it too
                if status == "5" and ENGINE_DOWN in str(exc):
                    status = ""  # the embedded engine whose model thread is down: a dead engine
                if status == "5":
                    answered += 1
                    if answered <= ANSWERED_5XX_RETRIES:
                        delay = ANSWERED_5XX_BACKOFF_S * 2 ** (answered - 1)
                        log.warning("%s; sent again in %gs (%d/%d)", exc, delay, answered, ANSWERED_5XX_RETRIES)
                        await asyncio.sleep(delay)
                        continue
                    if not self.wait_for_replacement:
                        raise EngineError(f"{exc}; sent {answered} times, each answered with an HTTP 5xx error: the "
                                          "engine is alive but failing, see its log") from None
                    answered = 0  # --use-fault-tolerance: one that keeps failing (a router over a dead engine) is
                    # restarted as a dead one, and the request starts over
                if isinstance(exc, EngineTimeout) and await self._answers_health(url):
                    # alive and answering: a long generation or a busy engine, not a dead one (sent again elsewhere
                    # it would time out there too, and --use-fault-tolerance would restart healthy engines)
                    raise EngineTimeout(f"{exc}. The engine is alive (/health answers): the request needs longer "
                                        "(long responses, a busy engine); raise --rollout-request-timeout.") from None
                if url in self.urls:  # not already replaced while this request was in flight
                    self.dead[url] = str(exc)
                log.error("engine %s failed and is taken out of rotation: %s", url, exc)
                attempts += 1
                if attempts > self.max_retries and not self.wait_for_replacement:
                    raise  # under wait_for_replacement the driver bounds the restarts instead
            finally:
                self.inflight[url] -= 1
