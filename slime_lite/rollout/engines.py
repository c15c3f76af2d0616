"""Rollout engines as Ray actors, one per ``--rollout-num-gpus-per-engine`` bundles of the placement group.

``embedded``: slime_lite's own SGLang-compatible server runs inside the actor. ``sglang``: the actor launches a
real SGLang server process (``backends/sglang/launcher.py``). Either way the rest of the code sees only a URL.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray

from slime_lite.backends.sglang.launcher import SGLangServer
from slime_lite.config import EngineConfig
from slime_lite.determinism import set_deterministic
from slime_lite.engine_client import normalize_url, request_json
from slime_lite.errors import SlimeLiteError
from slime_lite.metrics import process_memory
from slime_lite.placement import bundle_options
from slime_lite.profiling import trace_dir

log = logging.getLogger(__name__)

# `slime-lite serve`'s flags that the embedded engine's errors name, and the train flags that set them
_SERVE_TO_TRAIN = {"--device": "--rollout-device", "--dtype": "--engine-dtype", "--model-path": "--hf-checkpoint",
                   "--kv-cache-tokens": "--engine-kv-cache-tokens",
                   "--max-running-requests": "--engine-max-running-requests",
                   "--enable-torch-compile": "--engine-enable-torch-compile",
                   "--disable-cuda-graph": "--engine-disable-cuda-graph",
                   "--enable-return-routed-experts": "--use-rollout-routing-replay"}


def train_flag_names(message: str) -> str:
    """An embedded engine's error with the serve flags it names spelled as the train flags that set them."""
    return re.sub(r"(?<![\w-])(--[a-z-]+)(?![\w-])", lambda m: _SERVE_TO_TRAIN.get(m.group(1), m.group(1)), message)


class EngineActor:
    """Hosts one engine; ``start()`` returns its base URL."""

    def __init__(self, args: Any, rank: int, profile_dir: str) -> None:
        self.args = args  # SGLang servers read the placement from it
        self.config = EngineConfig.from_args(args)
        self.rank = rank
        self.profile_dir = profile_dir  # absolute, made by the driver: the folder its /start_profile names
        self.server = None

    def start(self) -> str:
        c = self.config
        import torch  # torch: in the engine's process, not the driver's

        if self.args.deterministic_mode:
            set_deterministic()
        device = c.rollout_device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            torch.set_num_threads(max(1, int(os.environ.get("SLIME_LITE_ENGINE_THREADS", "1"))))
        if c.rollout_backend == "sglang":
            self.server = SGLangServer(self.args, self.rank)
        else:
            from slime_lite.engine.server import MAX_REQUEST_BYTES, EngineServer  # torch: in the engine's process

            try:
                self.server = EngineServer(
                    c.hf_checkpoint, device=device, dtype=c.engine_dtype, seed=c.rollout_seed + self.rank,
                    max_running_requests=c.engine_max_running_requests, requests_hint=c.requests_per_engine,
                    kv_cache_tokens=c.engine_kv_cache_tokens, request_tokens=c.request_tokens,
                    cuda_graph=False if c.engine_disable_cuda_graph else None,
                    enable_torch_compile=c.engine_enable_torch_compile,
                    disable_radix_cache=self.args.deterministic_mode,  # a cache hit depends on timing
                    profile_dir=self.profile_dir,
                    enable_return_routed_experts=c.use_rollout_routing_replay,
                    max_request_bytes=max(MAX_REQUEST_BYTES, c.request_body_bytes),
                )
            except SlimeLiteError as exc:  # the engine names `slime-lite serve`'s flags: here they are train's
                raise SlimeLiteError(train_flag_names(str(exc))) from None
        url = self.server.start()
        log.info("engine %d ready at %s", self.rank, url)
        return url

    def alive(self) -> bool:
        """Whether the engine's server process runs (for the embedded engine, this actor's own process: whether its
        model thread runs)."""
        if self.config.rollout_backend != "sglang":
            return self.server is not None and self.server.scheduler.alive
        proc = self.server.proc if self.server is not None else None
        return proc is not None and proc.poll() is None

    def kill_server(self) -> None:
        """--debug-inject-fault kill-engine: SIGKILL the process serving this engine, as a crash would (the SGLang
        server's for the launcher path, this actor's own for the embedded engine)."""

        proc = getattr(self.server, "proc", None)
        os.kill(proc.pid if proc is not None else os.getpid(), signal.SIGKILL)

    def memory(self) -> dict[str, float]:
        return process_memory()

    def imported_modules(self) -> list[str]:
        return sorted(sys.modules)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@dataclass
class EngineFleet:
    """The run's engines: their Ray actors (none for external servers), their URLs in the same order, and the router
    in front of them (--use-sglang-router). --use-fault-tolerance restarts change the lists in place."""

    engines: list[Any]
    urls: list[str]
    router: Any = None

    def stop(self, timeout: float = 120.0) -> None:
        """Stop every engine (all asked at once, each waited for at most ``timeout`` s), then the router: an engine
        that is dead or stuck is logged and does not leave the others, or the router, running."""
        try:
            refs = [engine.stop.remote() for engine in self.engines]
            for i, ref in enumerate(refs):
                try:
                    ray.get(ref, timeout=timeout)
                except Exception as exc:  # noqa: BLE001 - the others still stop
                    log.warning("engine %d did not stop cleanly: %s", i, exc)
        finally:
            if self.router is not None:
                self.router.stop()


def start_engines(args: Any, pg: Any, bundles: list[int]) -> EngineFleet:
    """One engine actor per engine's first bundle, started. External addresses start none."""


    if args.rollout_external_engine_addrs:
        return EngineFleet([], [normalize_url(a) for a in args.rollout_external_engine_addrs.split(",")])
    per = args.rollout_num_gpus_per_engine
    actors = [engine_actor(args, pg, bundles[i], i // per) for i in range(0, len(bundles), per)]
    return EngineFleet(actors, ray.get([a.start.remote() for a in actors]))


def engine_actor(args: Any, pg: Any, bundle: int, rank: int) -> Any:
    """The Ray actor of engine ``rank`` on its first placement-group bundle (not started yet)."""


    share = 0.2 if args.colocate else 1.0
    return ray.remote(EngineActor).options(**bundle_options(pg, bundle, share), name=None).remote(
        args, rank, os.path.abspath(trace_dir(args)))


def restart_engine(args: Any, pg: Any, bundles: list[int], old: Any, rank: int) -> tuple[Any, str]:
    """--use-fault-tolerance: stop what is left of engine ``rank`` (its server, its actor) and start a new one on
    the same bundle, the same way (embedded engine or SGLang launcher); returns (actor, url)."""

    try:
        ray.get(old.stop.remote(), timeout=60)
    except Exception as exc:  # noqa: BLE001 - the actor died with its engine (or hangs): killed below either way
        log.info("engine %d: stopping what was left of it: %s", rank, type(exc).__name__)
    ray.kill(old, no_restart=True)
    actor = engine_actor(args, pg, bundles[rank * args.rollout_num_gpus_per_engine], rank)
    return actor, ray.get(actor.start.remote())


def engine_memory(urls: list[str], action: str, tags: list[str] | None = None) -> None:
    """``release`` or ``resume`` the engines' memory (tags ``weights``, ``kv_cache``, ``cuda_graph``; None = all), as
    SGLang does (the embedded engine's CUDA graphs come back with its cache and weights: it takes that tag as a
    no-op)."""
    route = "/release_memory_occupation" if action == "release" else "/resume_memory_occupation"
    engines_request(urls, route, {"tags": tags} if tags else {})


def engines_request(urls: list[str], route: str, body: dict) -> None:
    """POST ``body`` to ``route`` of every engine at once."""
    with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
        list(pool.map(lambda u: request_json(u, route, body, timeout=300), urls))
