"""Rollout engines as Ray actors, one per ``--rollout-num-gpus-per-engine`` bundles of the placement group.

``embedded``: slime_lite's own SGLang-compatible server runs inside the actor. ``sglang``: the actor launches a
real SGLang server process (``backends/sglang/launcher.py``). Either way the rest of the code sees only a URL.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


class EngineActor:
    """Hosts one engine; ``start()`` returns its base URL."""

    def __init__(self, args: Any, rank: int) -> None:
        self.args = args
        self.rank = rank
        self.server = None

    def start(self) -> str:
        a = self.args
        import torch

        device = a.rollout_device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            torch.set_num_threads(max(1, int(os.environ.get("SLIME_LITE_ENGINE_THREADS", "1"))))
        if a.rollout_backend == "sglang":
            from slime_lite.backends.sglang.launcher import SGLangServer

            self.server = SGLangServer(a, self.rank)
        else:
            from slime_lite.engine.server import EngineServer

            kwargs = {"max_running_requests": a.engine_max_running_requests,
                      "cuda_graph": False if a.engine_disable_cuda_graph else None,
                      "enable_torch_compile": a.engine_enable_torch_compile}
            if a.engine_kv_cache_tokens:
                kwargs["kv_cache_tokens"] = a.engine_kv_cache_tokens
            self.server = EngineServer(
                a.hf_checkpoint, device=device, dtype=a.engine_dtype, seed=a.rollout_seed + self.rank, **kwargs
            )
        url = self.server.start()
        log.info("engine %d ready at %s", self.rank, url)
        return url

    def pid(self) -> int:
        return os.getpid()

    def memory(self) -> dict[str, float]:
        from slime_lite.metrics import process_memory

        return process_memory()

    def imported_modules(self) -> list[str]:
        import sys

        return sorted(sys.modules)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def start_engines(args: Any, pg: Any, bundles: list[int]) -> tuple[list[Any], list[str]]:
    """Start one engine actor per engine's first bundle; returns (actors, urls). External addresses start none."""
    import ray

    from slime_lite.placement import bundle_options

    if args.rollout_external_engine_addrs:
        urls = [a if a.startswith("http") else f"http://{a}" for a in args.rollout_external_engine_addrs.split(",")]
        return [], urls
    per = args.rollout_num_gpus_per_engine
    share = 0.2 if args.colocate else 1.0
    cls = ray.remote(EngineActor)
    actors = [
        cls.options(**bundle_options(pg, bundles[i], share), name=None).remote(args, i // per)
        for i in range(0, len(bundles), per)
    ]
    urls = ray.get([a.start.remote() for a in actors])
    return actors, urls


def engine_memory(urls: list[str], action: str, tags: list[str] | None = None) -> None:
    """``release`` or ``resume`` the engines' memory (tags ``weights``, ``kv_cache``; None = all), as SGLang does."""
    from concurrent.futures import ThreadPoolExecutor

    from slime_lite.engine_client import request_json

    route = "/release_memory_occupation" if action == "release" else "/resume_memory_occupation"
    body = {"tags": tags} if tags else {}
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        list(pool.map(lambda u: request_json(u, route, body, timeout=300), urls))
