"""The embedded engine's scheduler: one model thread doing continuous batching over an engine-owned KV cache.

Requests wait in a FIFO queue; whenever a batch slot is free (``--max-running-requests``), waiting requests are
prefilled together and join the running batch, which decodes one token per request per step. Finished slots are
refilled at the next step, so short and long generations share the batch without waiting for each other.

Everything that touches the model (generation, weight updates, memory release) runs in the model thread; other
threads talk to it through ``submit``/``abort``/``cancel`` and ``call(fn)``, which runs ``fn`` between two steps and
returns a ``concurrent.futures.Future``; the control operations (``pause``, ``flush_cache``, ``release_memory``, ...;
engine/control.py) run that way. Decode steps are launched and read back by a ``DecodePipeline``
(engine/pipeline.py). Results leave through each request's ``on_output`` callback, called in the model thread with
a ``RequestOutput`` snapshot (after every token for streaming requests, else once at the end).

Seeds: a request's seed is its ``sampling_seed`` if given, else derived from ``--random-seed`` and its ``rid``
(or, without a rid, from the order the server received requests in), so a fixed seed reproduces a run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import heapq
import itertools
import logging
import os
import queue
import threading
import time
import zlib
from collections import deque
from typing import Any, Callable

import torch

from slime_lite.engine import logprobs as lpx
from slime_lite.engine.admission import AdmissionMixin
from slime_lite.engine.control import ControlMixin
from slime_lite.engine.cuda_graph import PaddedDecoder
from slime_lite.engine.kv_cache import auto_max_running, kv_bytes_per_token
from slime_lite.engine.model import CausalLM, load_hf_model
from slime_lite.engine.pipeline import DecodePipeline
from slime_lite.engine.prefix_cache import PrefixCache
from slime_lite.engine.request import ENGINE_ERROR, REQUEST_ERROR, Request, abort_reason, rid_matches
from slime_lite.engine.token_rules import TokenRulesMixin
from slime_lite.engine.sampling import SamplingParams, mix64
from slime_lite.engine.weights import Weights
from slime_lite.errors import SlimeLiteError
from slime_lite.offload import TensorStash
from slime_lite.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Steps in a row that fail with no request alone to blame (a sticky CUDA error, an out-of-memory on every step): the
# model thread stops, as SGLang's scheduler process would die, so /health, /generate (503) and the trainer's fault
# tolerance see a dead engine instead of one that answers every request with an abort.
FAILED_STEPS_TO_STOP = 3


class Scheduler(AdmissionMixin, ControlMixin, TokenRulesMixin):
    """Loads the model and runs the generation loop in a background thread (``start``/``stop``)."""

    def __init__(self, model_path: str, *, tokenizer_path: str | None = None, dtype: str = "auto",
                 device: str | None = None, seed: int = 0, max_running_requests: int | None = 64,
                 requests_hint: int | None = None, kv_cache_tokens: int | None = None,
                 request_tokens: int | None = None, cpu_threads: int | None = None, cuda_graph: bool | None = None,
                 cuda_graph_max_bs: int | None = None, enable_torch_compile: bool = False,
                 enable_return_routed_experts: bool = False,
                 disable_radix_cache: bool = False) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise SlimeLiteError(f"--device {device!r}: expected cpu or cuda.")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise SlimeLiteError("--device cuda: CUDA is not available on this machine; use --device cpu.")
        if cuda_graph_max_bs is not None and cuda_graph_max_bs < 1:
            raise SlimeLiteError(f"--cuda-graph-max-bs {cuda_graph_max_bs}: must be >= 1 (or --disable-cuda-graph).")
        if max_running_requests is not None and max_running_requests < 1:
            raise SlimeLiteError(f"--max-running-requests {max_running_requests}: must be >= 1.")
        self.device = torch.device(device)
        if self.device.type == "cpu":
            # One intra-op thread unless told otherwise: small decode steps gain nothing from more, and spinning
            # OpenMP threads slow everything down ~10x when the cores are shared (trainer, other engines).
            env = os.environ.get("OMP_NUM_THREADS")
            torch.set_num_threads(cpu_threads or (int(env) if env else 1))
        self.model_path = str(model_path)
        self.tokenizer_path = str(tokenizer_path or model_path)
        self.seed = int(seed)
        self.hf = load_hf_model(self.model_path, dtype, self.device)
        self.hf.requires_grad_(False)

        self.tokenizer = load_tokenizer(self.tokenizer_path)
        self.tokenizer_lock = threading.Lock()
        self.context_len = context = int(getattr(self.hf.config, "max_position_embeddings", 1 << 30))
        # a slot's tokens without a cache size: 4,096 or a run's longest request (``request_tokens``), within context
        slot_tokens = min(context, max(4096, request_tokens or 0))
        if max_running_requests is None:
            memory = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
            max_running_requests = auto_max_running(memory, requests_hint, slot_tokens,
                                                    kv_bytes_per_token(self.hf), kv_cache_tokens)
            logger.info("engine: %d batch slots (requests of a rollout: %s; set --max-running-requests to choose)",
                        max_running_requests, requests_hint)
        self.max_running = int(max_running_requests)
        kv_cache_tokens = int(kv_cache_tokens or self.max_running * slot_tokens)
        self.slot_len = min(context, kv_cache_tokens // self.max_running)
        if self.slot_len < 2:
            raise SlimeLiteError(f"--kv-cache-tokens {kv_cache_tokens}: too small for {self.max_running} slots "
                                 "(each slot needs at least 2 tokens); raise it or lower --max-running-requests.")
        self.kv_cache_tokens = kv_cache_tokens
        self._capped_warned = False
        self.lm = CausalLM(self.hf, self.slot_len)
        self.weights = Weights(self.hf)
        # off with --disable-radix-cache, and under --deterministic-mode (rollout/engines.py passes it): whether a
        # prompt hits the cache depends on timing (which slots are free), and a hit's prefill sums in another order
        self.prefix = PrefixCache(lambda: self.weights.version, enabled=not disable_radix_cache)
        self.cache = self.lm.new_cache(self.max_running, self.slot_len)
        if enable_return_routed_experts:  # before any CUDA graph is captured: they write to its buffer
            self.lm.enable_routes(self.max_running, self.slot_len)
        # Padded decode steps (CUDA graphs on CUDA): on by default on CUDA; cuda_graph=True on CPU runs them eagerly.
        if cuda_graph is None:
            cuda_graph = self.device.type == "cuda"
        self.decoder: PaddedDecoder | None = None
        if cuda_graph:
            max_bs = min(self.max_running, cuda_graph_max_bs or self.max_running)
            self.decoder = PaddedDecoder(self.lm, self.cache, max_bs, capture=self.device.type == "cuda")
        if enable_torch_compile:
            if self.decoder is None:
                why = ("--disable-cuda-graph is set; drop one of the two" if self.device.type == "cuda"
                       else "this engine runs on CPU; drop --enable-torch-compile")
                raise SlimeLiteError(f"--enable-torch-compile compiles the CUDA-graph decode step, but {why}.")
            self.decoder.compile()
        self.pipeline = DecodePipeline(self.lm, self.cache, self.decoder, self._sample)
        self.eos_ids = self._eos_ids()
        self.weight_version = "default"
        self.paused = False
        self.abort_epoch = 0  # abort-alls so far (counted when asked for: see abort)
        self._abort_message = ""  # the last abort-all's
        self._abort_lock = threading.Lock()
        self.released: set[str] = set()
        self._stash = TensorStash(self.device)  # the weights while released (release_memory)
        self._weight_buffer = None  # a vmm.MappedBuffer the weights come back into at each resume (CUDA)
        self._weights_at: list[int] = []  # the weights' addresses before the last release
        self._map_weights()
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self._free_slots = list(range(self.max_running))
        self._admit_group = max(1, self.max_running // 8)
        self._inbox: queue.Queue = queue.Queue()
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False  # the model thread has ended: what arrives later is answered at once
        self.stop_reason: str | None = None  # why the model thread ended on an error
        self._failed_steps = 0  # steps in a row that failed with no request alone to blame
        self._handling: tuple | None = None  # the inbox message the model thread is handling
        self.num_generated = 0
        # Work counters, only ever growing (the rollout manager reads /get_server_info before and after a rollout and
        # logs the differences as perf/rollout/engine_*): model-thread seconds spent stepping (prefill and decode,
        # CUDA-graph captures included) and in prefill alone, and decode steps launched.
        self.busy_seconds = 0.0
        self.prefill_seconds = 0.0
        self.num_decode_steps = 0
        logger.info("engine: %s on %s (%s), %d slots x %d tokens", self.model_path, self.device, self.lm.dtype,
                    self.max_running, self.slot_len)

    # ---- called from any thread -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-model", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(("stop",))
            self._thread.join(timeout=30)
            self._stopped = not self._thread.is_alive()
            self._thread = None
            self._answer_stopped()

    def _answer_stopped(self) -> None:
        """Once the model thread has ended: what reached its inbox after ``stop`` (a request, a call) is answered
        (aborted, or the call's future failed) instead of waiting forever."""
        while self._stopped:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._refuse(msg, "engine shutting down")

    def _refuse(self, msg: tuple, why: str) -> None:
        """Answer an inbox message the model thread will not handle: a request aborted, a call's future failed."""
        if msg[0] == "add":
            self._finish(msg[1], abort_reason(why))
        elif msg[0] == "call" and msg[3].set_running_or_notify_cancel():
            msg[3].set_exception(RuntimeError(f"the engine has stopped ({why})"))

    def submit(self, req: Request) -> None:
        self._inbox.put(("add", req))
        self._answer_stopped()

    def abort(self, rid: str | None = None, message: str = "aborted by /abort_request") -> None:
        """Abort the request ``rid`` and the ``rid_<i>`` requests a batch or ``n`` made of it, or every request
        when ``rid`` is None. Aborted requests return what they generated, with finish reason ``abort``. An abort of
        every request also ends those made before this call and submitted after it (the rest of a batch waiting for
        its turn), not those made after it, whenever the model thread gets to it."""
        if rid is None:
            self.count_abort_all(message)
        self._inbox.put(("abort", rid, message))

    def count_abort_all(self, message: str) -> None:
        """An abort of every request is asked for now (from any thread): requests made before now and handled by
        the model thread later are aborted with ``message``; those made after are not."""
        with self._abort_lock:
            self.abort_epoch += 1
            self._abort_message = message

    def cancel(self, reqs: list[Request], message: str) -> None:
        """Abort exactly these submitted requests (a client left): not others whose rid starts the same way."""
        self._inbox.put(("cancel", list(reqs), message))

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` in the model thread between two steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, args, fut))
        self._answer_stopped()
        return fut

    def derive_seed(self, sampling_seed: int | None, rid: str | None, index: int = 0) -> int:
        if sampling_seed is not None:
            base = int(sampling_seed)
        elif rid is not None:
            base = mix64(self.seed, zlib.crc32(rid.encode()))
        else:
            base = mix64(self.seed, (1 << 40) + next(self._counter))
        return mix64(base, index) if index else base & ((1 << 63) - 1)

    def prepare(self, req: Request) -> None:
        """Validate a request against the model and cache; set its effective ``max_new``. ValueError if bad."""
        n = len(req.input_ids)
        if n == 0:
            raise ValueError("empty input: send a non-empty text or input_ids")
        bad = [t for t in req.input_ids if not 0 <= t < self.lm.vocab_size]
        if bad:
            raise ValueError(f"input_ids {bad[:5]} outside the vocabulary [0, {self.lm.vocab_size})")
        if n >= self.slot_len:
            raise ValueError(f"prompt of {n} tokens does not fit a batch slot of {self.slot_len} tokens "
                             "(model context or --kv-cache-tokens / --max-running-requests)")
        asked = req.params.max_new_tokens
        if asked is None:  # up to the context (SGLang's bound: input + output <= context - 2) or the slot
            asked = max(0, self.context_len - n - 2)
            req.params = dataclasses.replace(req.params, max_new_tokens=asked)
        req.max_new = min(asked, self.slot_len - n + 1)
        if req.max_new < asked and not self._capped_warned:  # SGLang would generate them: say so, once
            self._capped_warned = True
            logger.warning("request %s: max_new_tokens %d capped to %d by a batch slot of %d tokens (raise --engine-kv-"
                           "cache-tokens / --kv-cache-tokens); logged once", req.rid, asked, req.max_new, self.slot_len)
        for name, ids in (("sampling_params.logit_bias", list(req.params.logit_bias or ())),
                          ("sampling_params.stop_token_ids", req.params.stop_token_ids),
                          ("token_ids_logprob", req.token_ids_logprob or [])):
            bad = [t for t in ids if not 0 <= t < self.lm.vocab_size]
            if bad:
                raise ValueError(f"{name}: token id(s) {bad[:5]} outside the vocabulary [0, {self.lm.vocab_size})")
        req.logprob_start_len = lpx.resolve_start(req.logprob_start_len, n, req.token_ids_logprob)
        req.abort_epoch = self.abort_epoch

    @property
    def alive(self) -> bool:
        """The model thread runs and has not begun to stop (on an error: from before it answers its requests)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def may_generate(self) -> bool:
        """Requests may be admitted and decoded: generation is not paused and the weights are not released."""
        return not self.paused and "weights" not in self.released

    # ---- model thread --------------------------------------------------------------------------------------
    def _can_step(self) -> bool:
        return self.pipeline.in_flight or (self.may_generate and bool(self.waiting or self.running))

    def _loop(self) -> None:
        """The model thread. An error outside a step (handling a message) ends it: its requests are aborted and
        what arrives later is answered at once, instead of waiting for a thread that is gone (/health says 503)."""
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - reported, and every request answered
            logger.exception("the model thread stopped on an error")
            why = f"{ENGINE_ERROR}the model thread stopped ({type(exc).__name__}: {exc})"
            self.stop_reason = why
            self._stopped = True
            with contextlib.suppress(Exception):
                if self._handling is not None:  # the message it failed on
                    self._refuse(self._handling, why)
                self._abort_all(why, count=False)
            self._answer_stopped()

    def _serve(self) -> None:
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # streams and graph captures of this thread go to the engine's GPU
        with torch.inference_mode():
            while True:
                try:
                    msg = self._inbox.get(block=not self._can_step())
                except queue.Empty:
                    msg = None
                while msg is not None:
                    if msg[0] == "stop":
                        self._abort_all("engine shutting down")
                        self.weights.destroy_all()
                        return
                    self._handling = msg
                    self._handle(msg)
                    self._handling = None
                    try:
                        msg = self._inbox.get_nowait()
                    except queue.Empty:
                        msg = None
                if not self._can_step():
                    continue
                t0 = time.perf_counter()
                try:
                    self._step()
                except Exception as exc:  # noqa: BLE001 - keep serving; fail the requests to blame
                    self._fail_step(exc)
                self.busy_seconds += time.perf_counter() - t0

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            req = msg[1]
            if req.abort_epoch is not None and req.abort_epoch < self.abort_epoch:  # an abort-all came after it
                self._finish(req, abort_reason(self._abort_message))
            else:
                self.waiting.append(req)
        elif kind == "abort":
            _, rid, message = msg
            if rid is None:
                self._abort_all(message, count=False)  # counted by abort()
            else:
                for r in [r for r in [*self.waiting, *self.running.values()] if rid_matches(r.rid, rid)]:
                    self._finish(r, abort_reason(message))
        elif kind == "cancel":
            _, reqs, message = msg
            for r in reqs:
                if r.finish_reason is None and (self.running.get(r.slot) is r or r in self.waiting):
                    self._finish(r, abort_reason(message))
        elif kind == "call":
            try:
                self._collect()  # calls (weight updates, memory, pause) see no step in flight
            except Exception as exc:  # noqa: BLE001 - the step failed: fail the requests to blame, keep serving
                self._fail_step(exc)
            _, fn, args, fut = msg
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)

    def _fail_step(self, exc: Exception) -> None:
        """A step raised: end the requests the sampler fails on alone (on neutral logits) with the error (a
        ``REQUEST_ERROR``; an ``ENGINE_ERROR`` when the device failed, which the client sends elsewhere), send
        requests still in their prefill (no token yet) back to the queue, and go on with the others; abort
        everything only when no request is to blame (the model itself failed). ``FAILED_STEPS_TO_STOP`` steps in a
        row that blame no request, or every one while a neutral request fails too, stop the model thread (raised
        from here)."""
        logger.exception("engine step failed")
        self.pipeline.drop()
        requests = [*self.running.values(), *self.waiting]
        blamed = [r for r in requests if not self._samples_alone(r)]
        # nobody to blame, or everybody and the sampler fails a neutral request too (the device itself is broken)
        engine_failed = not blamed or (len(blamed) == len(requests) and not self._samples_alone(
            Request(rid="canary", input_ids=[0], params=SamplingParams(), seed=0)))
        reason = abort_reason(f"{ENGINE_ERROR if engine_failed else REQUEST_ERROR}{type(exc).__name__}: {exc}")
        if engine_failed:
            self._failed_steps += 1
            if self._failed_steps >= FAILED_STEPS_TO_STOP:
                raise RuntimeError(f"{self._failed_steps} steps in a row failed with no request alone to blame, the "
                                   f"last with {type(exc).__name__}: {exc}") from exc
        if not blamed:  # requests on their way in were not in the failed step: they run
            self._abort_all(reason["message"], count=False)
            return
        for r in blamed:
            self._finish(r, reason)
        for slot in [s for s in sorted(self.running, reverse=True) if not self.running[s].output_ids]:
            self._retract(slot)

    def _samples_alone(self, req: Request) -> bool:
        try:
            self._sample([req], torch.zeros((1, self.lm.vocab_size), device=self.lm.device))
        except Exception:  # noqa: BLE001 - this request is to blame
            return False
        return True

    def _retract(self, slot: int) -> None:
        """The request in ``slot`` goes back to the front of the queue (re-prefilled with what it generated)."""
        req = self.running.pop(slot)
        heapq.heappush(self._free_slots, slot)
        self.prefix.release(slot, None)  # its prefill may be half done
        req.slot, req.kv_version = -1, -1  # no K/V anywhere until its re-prefill completes (a failed one caches none)
        self.waiting.appendleft(req)

    def _abort_all(self, message: str, count: bool = True) -> None:
        """Abort every request; ``count``: also those made before now and submitted later (see ``abort``)."""
        if count:
            self.count_abort_all(message)
        self.pipeline.drop()
        for r in list(self.waiting) + list(self.running.values()):
            self._finish(r, abort_reason(message))

    def _emit(self, req: Request) -> None:
        if req.on_output is not None:
            try:
                req.on_output(req.snapshot(self.weight_version))
            except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
                logger.exception("request %s: output callback failed", req.rid)

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        if req.slot >= 0 and req.return_routed_experts:  # every position that went through the model
            end = len(req.input_ids) + len(req.output_ids) - 1
            req.routed_experts = self.lm.routes.read(req.slot, req.routed_experts_start_len, max(end, 0))
        if req.slot >= 0:
            del self.running[req.slot]
            heapq.heappush(self._free_slots, req.slot)
            # the slot keeps the K/V of what went through the model (prefix cache): not after a failed prefill, nor
            done = req.output_ids or reason == {"type": "length", "length": 0}  # when the weights changed since
            self.prefix.release(req.slot, self._prefill_seq(req) if done else None, req.kv_version,
                                req.cache_namespace)
            req.slot = -1
            if not self.running and not self.pipeline.holds_cache and not len(self.prefix):
                self.cache.free()  # memory does not grow from batch to batch
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._emit(req)

    def _step(self) -> None:
        if not self.may_generate:
            self._collect()  # the step in flight, if any: then the loop waits for a call
            return
        if self._admitting():
            self._collect()  # the step in flight first: its finished requests free slots
            t0 = time.perf_counter()
            self._admit()
            self.prefill_seconds += time.perf_counter() - t0
        if self.running:
            self._decode()
        else:
            self._collect()

    def _decode(self) -> None:
        if not self.pipeline.chains(self.running):
            self._collect()  # read the step in flight first: its finished requests leave the batch
            if not self.running:
                return
        drawn = self.pipeline.launch(self.running)
        self.num_decode_steps += 1
        self._append(*drawn)

    def _collect(self) -> None:
        self._append(*self.pipeline.collect(self.running))

    def _append(self, reqs: list[Request], tokens: list[int], logprobs: list[float],
                extra: list[Any] | None = None) -> None:
        self.num_generated += len(reqs)
        if reqs:
            self._failed_steps = 0
        for i, (r, tok, lp) in enumerate(zip(reqs, tokens, logprobs)):
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            r.output_weight_versions.append(self.weight_version)  # updates run between steps: this step's weights
            if extra is not None and extra[i] is not None:
                top, ids = extra[i]
                if top is not None:
                    r.output_top.append(top)
                if ids is not None:
                    r.output_ids_lp.append(ids)
            try:
                reason = self._check_finished(r, tok)
            except Exception as exc:  # noqa: BLE001 - this request's own rules failed: it ends, the batch goes on
                logger.exception("finish check failed for request %s", r.rid)
                reason = abort_reason(f"{REQUEST_ERROR}{type(exc).__name__}: {exc}")
            if reason is not None:
                self._finish(r, reason)
            elif r.stream:
                self._emit(r)
