"""Where a rollout's time goes: ``perf/rollout/*``, the parts of ``perf/rollout_time`` (issue 13 item 1).

Manager side, from monotonic times the manager and the generator take:
  prepare_time   start of the rollout -> first /generate request sent (prompt rendering and tokenisation)
  generate_time  first request sent -> last response back
  reward_time    last response back -> rollout done (rewards and filters still running after the last response)
The three partition rollout_time (rewards scored while requests are in flight fall in generate_time).
Engine side, the growth of the counters the embedded engine reports in /get_server_info's ``step_stats`` between
just before and just after the rollout, over all engines (busy/prefill/capture times: the largest engine's):
  engine_busy_time        the model thread stepping (prefill, decode, CUDA-graph captures)
  engine_idle_time        generate_time - engine_busy_time: requests in flight but the engine not stepping
                          (HTTP, request parsing, queueing, detokenisation, waiting for the next request)
  engine_prefill_time     prefill steps (admission) alone
  engine_capture_time     CUDA-graph captures (after a memory release or a KV cache growth they happen again)
  engine_cuda_graph_captures, engine_decode_steps
  engine_cuda_graph_resets  times live graphs were dropped mid-serving (the KV cache grew: all captured again)
  engine_tokens_per_s     tokens the engines generated / engine_busy_time
Engines without ``step_stats`` (SGLang) give only the manager-side keys.
"""

from __future__ import annotations

import asyncio
import logging

from slime_lite.engine_client import request_json

log = logging.getLogger(__name__)

PREFIX = "perf/rollout/"


async def engine_step_stats(urls: list[str]) -> list[dict[str, float] | None]:
    """Each engine's ``step_stats`` counters (None where it has none or does not answer)."""

    async def one(url: str) -> dict[str, float] | None:
        try:
            info = await asyncio.to_thread(request_json, url, "/get_server_info", timeout=5.0, method="GET")
        except Exception as exc:  # noqa: BLE001 - timing is best effort: never fail a rollout over it
            log.debug("no step stats from %s: %s", url, exc)
            return None
        stats = info.get("step_stats") if isinstance(info, dict) else None
        return stats if isinstance(stats, dict) else None

    return list(await asyncio.gather(*(one(u) for u in urls)))


def phase_metrics(start: float, first_sent: float | None, last_back: float | None, end: float,
                  before: list[dict[str, float] | None], after: list[dict[str, float] | None]) -> dict[str, float]:
    """The ``perf/rollout/*`` keys of one rollout (see the module docstring); ``start``/``end`` bound
    ``perf/rollout_time``."""
    sent = first_sent if first_sent is not None else end
    back = max(last_back, sent) if last_back is not None else sent
    m = {"prepare_time": sent - start, "generate_time": back - sent, "reward_time": end - back}
    # an engine restarted during the rollout (--use-fault-tolerance) counts from zero again: left out
    pairs = [(b, a) for b, a in zip(before, after) if b is not None and a is not None
             and all(float(a.get(k, 0.0)) >= float(b.get(k, 0.0)) for k in b)]
    if pairs:
        def grown(key: str) -> list[float]:
            return [float(a.get(key, 0.0)) - float(b.get(key, 0.0)) for b, a in pairs]

        busy = max(grown("busy_seconds"))
        tokens = sum(grown("num_generated_tokens"))
        m.update({
            "engine_busy_time": busy,
            "engine_idle_time": max(0.0, m["generate_time"] - busy),
            "engine_prefill_time": max(grown("prefill_seconds")),
            "engine_capture_time": max(grown("cuda_graph_capture_seconds")),
            "engine_cuda_graph_captures": sum(grown("cuda_graph_captures")),
            "engine_cuda_graph_resets": sum(grown("cuda_graph_resets")),
            "engine_decode_steps": sum(grown("num_decode_steps")),
            "engine_tokens_per_s": tokens / busy if busy > 0 else 0.0,
        })
    return {PREFIX + k: float(v) for k, v in m.items()}
