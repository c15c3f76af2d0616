"""Health, info and load routes of the embedded engine (SGLang's names and shapes).

- ``/``, ``/ready`` (the model thread runs), ``/health``, ``/health_generate``: SGLang's semantics (see ``health``).
- ``/get_model_info`` (``/model_info``: paths, names, the HF config's model_type and architectures),
  ``/get_server_info`` (``/server_info``), ``/get_weight_version``.
  ``/get_server_info`` carries the ``ServerArgs`` fields slime reads or compares for an external engine
  (``tp_size``, ``dp_size``, ``pp_size``, ``ep_size``, ``dtype``, ``enable_memory_saver``,
  ``disaggregation_mode``, ``encoder_only``, ``enable_return_routed_experts``, ...), plus live state.
- ``/v1/loads`` (``include``: comma-separated sections, ``core`` or ``all``; one DP rank) and the older
  ``/get_load`` (a list with one ``{dp_rank, num_reqs, num_waiting_reqs, num_tokens, ...}``), which slime polls
  to wait until an engine is idle after an abort.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from aiohttp import web

from slime_lite import __version__
from slime_lite.engine.http_json import BadRequest, json_response
from slime_lite.engine.request import ENGINE_ERROR

HEALTH_GENERATE_TIMEOUT_S = 20.0
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def add_info_routes(app: Any, server: Any) -> None:
    """``server`` is the ``EngineServer`` (server.py imports this module)."""
    info = _Info(server)
    r = app.router
    r.add_get("/", info.root)
    r.add_get("/ready", info.ready)
    r.add_get("/health", info.health)
    r.add_get("/health_generate", info.health)
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, info.model_info)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, info.server_info)
    r.add_get("/get_weight_version", info.get_weight_version)
    r.add_get("/v1/loads", info.loads)
    r.add_get("/get_load", info.get_load)


class _Info:
    def __init__(self, server: Any) -> None:
        self.server = server

    async def root(self, request):
        return json_response("slime_lite embedded engine (SGLang API) is running")  # SGLang: "SGLang is running"

    async def ready(self, request):
        """SGLang's ``/ready``: 200 once the engine takes requests (its model thread runs), else 503. Unlike
        ``/health`` it generates nothing, and paused generation or released weights still count as ready."""

        return web.Response(status=200 if self.server.scheduler.alive else 503)

    async def health(self, request):
        """``/health`` and ``/health_generate`` (SGLang's semantics): 200 when a one-token generation answers, or
        when the engine produced any token since the check began (a busy engine is alive); 503 when it does not
        within ``HEALTH_GENERATE_TIMEOUT_S`` (a model thread stuck in a call) or its request fails (an engine error),
        and at once when the model thread is down or generation is paused or its weights are released."""

        s = self.server.scheduler
        if not s.alive or not s.may_generate:
            why = ("the model thread is not running" if not s.alive else "generation is paused" if s.paused
                   else "the weights are released (/resume_memory_occupation)")
            return web.Response(status=503, text=why)
        token = min(s.eos_ids) if s.eos_ids else 0
        reqs = self.server.new_requests([[token]], {"max_new_tokens": 1, "temperature": 0.0},
                                        rid=f"health_{uuid.uuid4().hex}")
        generated, loop = s.num_generated, asyncio.get_running_loop()
        deadline = loop.time() + HEALTH_GENERATE_TIMEOUT_S
        task = asyncio.ensure_future(self.server.run_requests(reqs))
        try:
            while not task.done() and s.num_generated == generated:
                if loop.time() > deadline:
                    return web.Response(status=503, text=f"generation did not answer in {HEALTH_GENERATE_TIMEOUT_S}s")
                await asyncio.wait({task}, timeout=0.05)
        finally:
            task.cancel()  # aborts the check's request if it is still queued
        if s.num_generated == generated and not task.cancelled() and task.exception() is None:
            out = task.result()[0]  # done: no token from anyone, and the check's request ended
            reason = out.finish_reason if out is not None else None
            if reason is not None and str(reason.get("message", "")).startswith(ENGINE_ERROR):  # not a pause's
                return web.Response(status=503, text=f"generation failed: {reason.get('message')}")
        return web.Response(status=200)

    async def model_info(self, request):
        s, config = self.server.scheduler, self.server.scheduler.hf.config
        return json_response({"model_path": s.model_path, "tokenizer_path": s.tokenizer_path, "is_generation": True,
                              "served_model_name": self.server.served_model_name,
                              "preferred_sampling_params": None, "weight_version": s.weight_version,
                              "has_image_understanding": False, "has_audio_understanding": False,  # text models
                              "model_type": getattr(config, "model_type", None),
                              "architectures": getattr(config, "architectures", None)})

    async def server_info(self, request):
        srv, s = self.server, self.server.scheduler
        return json_response({
            "engine": "slime_lite.embedded", "version": __version__, "model_path": s.model_path,
            "tokenizer_path": s.tokenizer_path, "served_model_name": srv.served_model_name, "host": srv.host,
            "port": srv.url and int(srv.url.rsplit(":", 1)[1]), "device": str(s.device),
            "dtype": str(s.lm.dtype).removeprefix("torch."),
            # the parallel layout and the features slime compares against what it would launch
            "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0,
            "enable_memory_saver": srv.enable_memory_saver,  # as launched; memory release works either way
            "disaggregation_mode": "null", "encoder_only": False,
            "enable_return_routed_experts": s.lm.routes is not None,
            "skip_server_warmup": True, "disable_radix_cache": not s.prefix.enabled,
            "random_seed": s.seed, "max_running_requests": s.max_running, "kv_cache_tokens": s.kv_cache_tokens,
            "max_total_num_tokens": s.kv_cache_tokens, "context_length": s.slot_len,
            "num_running_reqs": s.num_running, "num_waiting_reqs": s.num_waiting,
            "paused": s.paused, "released_memory": sorted(s.released), "weight_version": s.weight_version,
            "num_generated_tokens": s.num_generated, "kv_cache_allocated": list(s.cache.allocated),
            "prefix_cache": {"entries": len(s.prefix), "tokens": s.prefix.cached_tokens, "hits": s.prefix.hits,
                             "lookups": s.prefix.lookups, "hit_tokens": s.prefix.hit_tokens},
            "disable_cuda_graph": s.decoder is None or not s.decoder.capture,
            "cuda_graph_max_bs": s.decoder.max_bs if s.decoder else None,
            "enable_torch_compile": s.decoder is not None and s.lm.compiled,
            "num_cuda_graphs": len(s.decoder.graphs) if s.decoder else 0,
            # counters since start (the rollout manager logs their growth per rollout as perf/rollout/engine_*)
            "step_stats": {"busy_seconds": s.busy_seconds, "prefill_seconds": s.prefill_seconds,
                           "num_decode_steps": s.num_decode_steps, "num_generated_tokens": s.num_generated,
                           "cuda_graph_captures": s.decoder.num_captures if s.decoder else 0,
                           "cuda_graph_capture_seconds": s.decoder.capture_seconds if s.decoder else 0.0,
                           "cuda_graph_resets": s.decoder.num_graph_resets if s.decoder else 0},
        })

    async def get_weight_version(self, request):
        return json_response({"weight_version": self.server.scheduler.weight_version})

    def _core_load(self) -> dict[str, Any]:
        """One DP rank's core numbers, read from the HTTP thread (counts only; a snapshot a step may move)."""
        s = self.server.scheduler
        running, waiting = list(s.running.values()), list(s.waiting)
        used = sum(len(r.input_ids) + len(r.output_ids) for r in running)
        pending = sum(len(r.input_ids) for r in waiting)
        lookups = max(1, s.prefix.prompt_tokens)
        return {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": len(running),
                "num_waiting_reqs": len(waiting), "num_waiting_uncached_tokens": pending, "num_used_tokens": used,
                "num_total_tokens": s.kv_cache_tokens, "max_total_num_tokens": s.kv_cache_tokens,
                "max_running_requests": s.max_running, "token_usage": used / max(1, s.kv_cache_tokens),
                "cache_hit_rate": s.prefix.hit_tokens / lookups, "utilization": len(running) / s.max_running}

    async def loads(self, request):
        include = [x.strip() for x in request.query.get("include", "").split(",") if x.strip()]
        bad = sorted(set(include) - set(LOAD_SECTIONS))
        if bad:
            raise BadRequest(f"include: invalid section(s) {bad}; valid: {', '.join(LOAD_SECTIONS)}")
        dp_rank = request.query.get("dp_rank")
        if dp_rank not in (None, "0"):
            raise BadRequest(f"dp_rank={dp_rank}: the embedded engine has one DP rank (0)")
        if request.query.get("format") not in (None, "json"):
            raise BadRequest("format: only json is served by the embedded engine")
        device = str(self.server.scheduler.device)
        return json_response({"timestamp": datetime.now(timezone.utc).isoformat(), "version": __version__,
                              "accelerator": device, "num_accelerators": 1, "loads": [self._core_load()]})

    async def get_load(self, request):
        load = self._core_load()
        s = self.server.scheduler
        return json_response([{
            "dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
            "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_used_tokens"],
            "num_pending_tokens": load["num_waiting_uncached_tokens"], "ts_tic": time.perf_counter(),
            "max_total_num_tokens": s.kv_cache_tokens}])
