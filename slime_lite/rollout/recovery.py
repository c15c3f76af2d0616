"""``--use-fault-tolerance`` (slime's flag), the driver's side: while a rollout or an eval is generated (and before
each weight push) the driver looks for dead engines: ones whose Ray actor or server process is gone, and ones the
rollout manager's requests failed on. Each is replaced by a new engine on the same placement-group bundle, started
the same way (``rollout/engines.py``: the embedded engine, or the SGLang launcher), which gets the current weights
from the trainer, checked with the weight-equality check whatever ``--check-weight-update-equal`` says; then the
rollout manager's client swaps the URL and the requests that did not finish are sent again (they waited for a live
engine, or went to the other engines). A router launched by the job (``--use-sglang-router``) is relaunched over the
new engine set. Every restart is a warning log line and counts in ``rollout/engine_restarts``.

Without the flag none of this runs: a dead engine stops the run with the client's error, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from slime_lite.errors import EngineError
from slime_lite.rollout.engines import restart_engine

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often the driver looks while a rollout runs
ALIVE_TIMEOUT_S = 10.0  # an engine actor that cannot say whether its server runs is left to the request timeouts
MAX_RESTARTS_PER_STEP = 3  # per engine and rollout step: an engine that keeps dying stops the run (the router too)
ROUTER_FAILED = "requests to it failed"


class NoRecovery:
    """Without --use-fault-tolerance: waiting is ``ray.get``, and a dead engine stops the run with the client's
    error."""

    def wait(self, ref: Any, on_poll: Callable[[], None] | None = None) -> Any:
        if on_poll is not None:
            while not ray.wait([ref], timeout=POLL_S)[0]:
                on_poll()
        return ray.get(ref)

    def check(self) -> None:
        pass

    def pushed(self, version: int) -> None:
        pass

    def take_restarts(self) -> dict[str, float]:
        return {}


class EngineRecovery:
    """Watches the engines of one run and restarts the dead ones. It owns the changes to ``fleet`` (the engine
    actors, their URLs, the router): the lists are changed in place, so later weight pushes, offloads and the final
    stop reach the new engines. ``push(urls, version)`` gives a restarted engine the trainer's weights, checked
    (None without a trainer: --debug-rollout-only engines serve the checkpoint's weights, as the old one did)."""

    def __init__(self, args: Any, pg: Any, bundles: list[int], fleet: Any, manager: Any,
                 push: Callable[[list[str], int], Any] | None) -> None:
        self.args, self.pg, self.bundles = args, pg, bundles
        self.fleet, self.manager, self.push = fleet, manager, push
        self.version = 0  # the weight version the engines serve (pushed() after each push)
        self.restarts = 0  # in the current step; take_restarts() reads and resets it
        self._per_engine = [0] * len(fleet.engines)
        self._router_failures = 0  # relaunches of the router for its own failed requests, in the current step
        self.router_restarts = 0

    def pushed(self, version: int) -> None:
        """The engines now serve weight ``version``: what a restarted engine gets."""
        self.version = version

    # ---- waiting ---------------------------------------------------------------------------------------------
    def wait(self, ref: Any, on_poll: Callable[[], None] | None = None) -> Any:
        """``ray.get(ref)``, looking for dead engines while it runs."""

        while not ray.wait([ref], timeout=POLL_S)[0]:
            self.check()
            if on_poll is not None:
                on_poll()
        result = ray.get(ref)
        self.check()  # an engine that died near the end (its requests went elsewhere) is replaced within this step
        return result

    def take_restarts(self) -> dict[str, float]:
        """``rollout/engine_restarts``: restarts since the last call; the per-engine bound resets."""
        n, self.restarts = self.restarts, 0
        routers, self.router_restarts, self._router_failures = self.router_restarts, 0, 0
        self._per_engine = [0] * len(self.fleet.engines)
        return {"rollout/engine_restarts": float(n),
                **({"rollout/router_restarts": float(routers)} if self.fleet.router is not None else {})}

    # ---- finding the dead ---------------------------------------------------------------------------------------
    def check(self) -> None:
        """Restart every engine found dead (and the router over them, when there is one)."""

        failed = set(ray.get(self.manager.failed_engines.remote()))
        dead = {i: "requests to it failed" for i, url in enumerate(self.fleet.urls) if url in failed}
        for i, why in self._not_running().items():
            dead.setdefault(i, why)
        router_failed = self.fleet.router is not None and self.fleet.router.url in failed
        if not dead and not router_failed:
            return
        for i, why in sorted(dead.items()):
            self.restart(i, why)
        if self.fleet.router is not None:
            self._restart_router("an engine behind it was restarted" if dead else ROUTER_FAILED)

    def _not_running(self) -> dict[int, str]:
        """Engines whose Ray actor died or whose server process exited."""

        refs = [e.alive.remote() for e in self.fleet.engines]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ALIVE_TIMEOUT_S)
        out = {}
        for i, ref in enumerate(refs):
            if ref not in ready:
                continue  # busy or hung: a hung server is caught by the request timeout
            try:
                if not ray.get(ref):
                    out[i] = "its server process exited"
            except ray.exceptions.RayActorError:
                out[i] = "its process died"
        return out

    # ---- restarting -----------------------------------------------------------------------------------------------
    def restart(self, i: int, why: str) -> None:
        """Replace engine ``i``: new actor on the same bundle, current weights pushed and checked, URL swapped."""


        self._per_engine[i] += 1
        old_url = self.fleet.urls[i]
        if self._per_engine[i] > MAX_RESTARTS_PER_STEP:
            raise EngineError(f"--use-fault-tolerance: engine {i} ({old_url}) died {self._per_engine[i]} times in one "
                              f"rollout step ({why}); not restarting it again. Look at the engine's log (for "
                              "SGLang engines: SLIME_LITE_ENGINE_LOG_DIR, or the temp folder's slime_lite_engines).")
        log.warning("engine %d (%s) is dead: %s; restarting it on its placement-group bundle", i, old_url, why)
        t0 = time.monotonic()
        self.fleet.engines[i], new_url = restart_engine(self.args, self.pg, self.bundles, self.fleet.engines[i], i)
        self.fleet.urls[i] = new_url
        if self.push is not None:
            times = self.push([new_url], self.version) or {}
            checked = ("weight check passed" if "perf/update_weights/check_time" in times
                       else "not checked: the engine cannot be (warned above)")
            weights = f"weights version {self.version} pushed, {checked}"
        else:
            weights = "no trainer: it serves --hf-checkpoint's weights, as before"
        ray.get(self.manager.replace_engine.remote(old_url, new_url))  # behind a router: where aborts go
        self.restarts += 1
        log.warning("engine %d restarted at %s in %.1fs (%s); the unfinished requests are sent again",
                    i, new_url, time.monotonic() - t0, weights)

    def _restart_router(self, why: str) -> None:
        """The router is launched again over the current engines (it has no portable way to swap a worker)."""

        old = self.fleet.router.url
        if why == ROUTER_FAILED:  # engines restarts are bounded by their own count; a router failing alone is not
            self._router_failures += 1
            if self._router_failures > MAX_RESTARTS_PER_STEP:
                raise EngineError(
                    f"--use-fault-tolerance: requests to the router ({old}) failed {self._router_failures} times in "
                    "one rollout step while every engine behind it runs; not launching it again. An engine may hang "
                    "(its process alive, its requests never answered): look at the engines' logs (for SGLang "
                    "engines: SLIME_LITE_ENGINE_LOG_DIR, or the temp folder's slime_lite_engines).")
        log.warning("router %s: %s; launching it again over %s", old, why, ", ".join(self.fleet.urls))
        self.fleet.router.stop()
        self.fleet.router.worker_urls = list(self.fleet.urls)
        ray.get(self.manager.replace_engine.remote(old, self.fleet.router.start()))
        self.router_restarts += 1
