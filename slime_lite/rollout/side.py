"""The driver's rollout side: everything about engines. It owns the rollout manager (prompts, generation, rewards,
eval, dumps), the engine actors or servers (or the external ones' URLs), the router of ``--use-sglang-router``,
fault-tolerant restarts (``--use-fault-tolerance``), the engines' memory release and resume around training
(``--offload-rollout``) and the engine-side fault of ``--debug-inject-fault kill-engine``. Under
``--debug-train-only`` / ``--load-debug-rollout-data`` it starts no engine: the manager only loads dumps, and the
engine phases do nothing. It never imports Megatron.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable

import ray

from slime_lite.backends.sglang.launcher import SGLangRouter
from slime_lite.config import RolloutSideConfig
from slime_lite.engine_client import lora_adapter_name
from slime_lite.metrics import memory_record
from slime_lite.profiling import DRIVER_TIMELINE, add_time, timed
from slime_lite.rollout.engines import EngineFleet, engine_memory, engines_request, start_engines
from slime_lite.rollout.manager import RolloutManager
from slime_lite.rollout.recovery import EngineRecovery, NoRecovery

log = logging.getLogger("slime_lite.train")

Push = Callable[[list[str], int], Any]  # push(urls, version): the trainer's weights to these engines, checked


class RolloutSide:
    # --offload-rollout: engines restarted since the release (a new process: it released nothing, so nothing to resume)
    _restarted: frozenset[str] = frozenset()

    def __init__(self, args: Any, pg: Any, bundles: list[int], push: Push | None) -> None:
        """Start the engines on their placement-group ``bundles`` (none under --debug-train-only) and the rollout
        manager. ``push`` sends the trainer's current weights to a restarted engine (None without a trainer)."""
        self.config = c = RolloutSideConfig.from_args(args)
        self.fleet = EngineFleet([], []) if c.debug_train_only else start_engines(args, pg, bundles)
        if c.use_sglang_router and self.fleet.urls:  # generation goes through the router; weights to each engine

            self.fleet.router = SGLangRouter(self.fleet.urls)
        generate_urls = [self.fleet.router.start()] if self.fleet.router else list(self.fleet.urls)
        fault_engine = self.fleet.engines[0] if c.debug_inject_fault == "kill-engine" and self.fleet.engines else None
        self.manager = ray.remote(RolloutManager).options(num_cpus=0.5, max_concurrency=2).remote(
            args, generate_urls, fault_engine, list(self.fleet.urls))
        self.recovery = (EngineRecovery(args, pg, bundles, self.fleet, self.manager, push)
                         if c.use_fault_tolerance and self.fleet.engines else NoRecovery())

    @property
    def urls(self) -> list[str]:
        """The engines' own URLs (weights and memory calls go to each); the list is changed in place by restarts."""
        return self.fleet.urls

    def start(self, start_rollout_id: int, data_state: Any) -> None:
        """Restore the prompt cursor of a resumed run; eval before any training (eval ids count trained rollouts)."""
        if data_state:
            ray.get(self.manager.load_state.remote(data_state))
        self.recovery.pushed(start_rollout_id)

    # ---- generation (RolloutSchedule launches it and waits for it) ---------------------------------------------
    def generate(self, rollout_id: int) -> Any:
        """The manager's generation (or dump load) of one rollout, started: a Ray object ref."""
        return self.manager.generate.remote(rollout_id)

    def wait(self, ref: Any, rollout_id: int) -> Any:
        """``ray.get(ref)``, dead engines restarted meanwhile (--use-fault-tolerance), with a progress bar of the
        rollout's finished samples when stderr is a terminal."""
        if not sys.stderr.isatty():
            return self.recovery.wait(ref)
        # rich: only on a terminal
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn(f"rollout {rollout_id}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, transient=True) as bar:
            task = bar.add_task("generate", total=None)

            def show() -> None:
                done, total = ray.get(self.manager.progress.remote())
                bar.update(task, completed=done, total=total or None)

            return self.recovery.wait(ref, on_poll=show)

    def data_state(self) -> Any:
        return ray.get(self.manager.state.remote())

    # ---- around training ---------------------------------------------------------------------------------------
    def release_memory(self, record: dict) -> None:
        """--offload-rollout, before training: the engines release all their memory (SGLang: weights, KV cache, CUDA
        graphs; resumed in push_weights and resume_memory) (perf/offload_time)."""
        if not (self.config.offload_rollout and self.urls):
            return
        with timed(record, "perf/offload_time"):
            t0 = time.monotonic()
            engine_memory(self.urls, "release")
            add_time(record, "perf/offload/engine_release_time", t0)
            record.update(memory_record("engine_released", ray.get([e.memory.remote() for e in self.fleet.engines])))

    def push_initial(self, push: Push | None, version: int) -> None:
        """Before the first rollout: the engines get the trainer's weights (a resumed run's checkpoint, too)."""
        if push is None or not self.urls:
            return
        t0 = time.monotonic()
        push(self.urls, version)
        self._name_adapter(version)
        log.info("initial weights pushed to %d engine(s) in %.2fs", len(self.urls), time.monotonic() - t0)

    def push_weights(self, push: Push | None, version: int, record: dict) -> None:
        """The trainer's weights to every engine as ``version`` (``push``: None without a trainer): under
        --offload-rollout the engines' weight memory comes back first; an engine that died since the rollout is
        replaced before (--use-fault-tolerance). With --update-weights-interval N only after every N-th rollout and
        before an eval (``pushes_after``): the engines keep serving the last version pushed."""
        if push is None or not self.urls or not self.config.pushes_after(version - 1):
            return
        with timed(record, "perf/update_weights_time"):
            self._check_engines()  # first: a dead engine would fail the resume; its replacement released nothing
            if self.config.offload_rollout:  # room for the weights now, for the KV cache after the trainer offloads
                t0 = time.monotonic()
                engine_memory([u for u in self.urls if u not in self._restarted], "resume", ["weights"])
                add_time(record, "perf/update_weights/engine_resume_time", t0)  # a part of update_weights_time
            # generation goes on: held between two decode steps, nothing aborted; the running requests are retracted
            # (re-prefilled under the new weights, what they generated included), so a token stamped with the new
            # version is the new weights' alone (in place, it would attend over K/V the old weights wrote)
            if self.config.fully_async:
                engines_request(self.urls, "/pause_generation", {"mode": "retract"})
                try:
                    record.update(push(self.urls, version) or {})
                finally:
                    engines_request(self.urls, "/continue_generation", {})
            else:
                record.update(push(self.urls, version) or {})
            self._name_adapter(version)
            self.recovery.pushed(version)

    def _name_adapter(self, version: int) -> None:
        """LoRA on real SGLang: the rollouts from now on name the adapters this push loaded."""
        if self.config.names_lora_adapter:
            ray.get(self.manager.use_lora_adapter.remote(lora_adapter_name(version)))

    def resume_memory(self, record: dict) -> None:
        """--offload-rollout, after the trainer offloaded: the engines get their KV cache back, and their CUDA graphs
        (the release, with no tags, released SGLang's too)."""
        if not (self.config.offload_rollout and self.urls):
            return
        with timed(record, "perf/offload_time"):
            t0 = time.monotonic()
            self._check_engines()
            engine_memory([u for u in self.urls if u not in self._restarted], "resume", ["kv_cache", "cuda_graph"])
            add_time(record, "perf/offload/engine_resume_time", t0)
        self._restarted = frozenset()

    def _check_engines(self) -> None:
        """Dead engines restarted (--use-fault-tolerance); under --offload-rollout their new URLs are remembered
        until the resume after training: a new engine has all its memory, and SGLang refuses to resume what it never
        released."""
        before = list(self.urls)
        self.recovery.check()
        if self.config.offload_rollout:
            self._restarted = self._restarted | {u for u in self.urls if u not in before}

    # ---- eval, metrics, end ----------------------------------------------------------------------------------------
    def evaluate(self, trained: int) -> dict[str, float]:
        """Eval after ``trained`` rollouts (0: before training), when --eval-interval says so and engines run."""
        if not self.urls or not self.config.evaluates_after(trained - 1):
            return {}
        with DRIVER_TIMELINE.span("eval"):
            return self.recovery.wait(self.manager.evaluate.remote(trained))

    def step_records(self) -> dict[str, float]:
        """Per rollout: engine restarts, and the memory of the rollout manager and the engines."""
        out = self.recovery.take_restarts()
        out.update(memory_record("rollout_manager", [ray.get(self.manager.memory.remote())]))
        if self.fleet.engines:
            out.update(memory_record("engine", ray.get([e.memory.remote() for e in self.fleet.engines])))
        return out

    def wait_dumps(self) -> None:
        """After a failure: the rollouts' dumps are what the user debugs it with."""
        log.info("the run failed: waiting for the debug rollout dumps to be written")
        try:
            ray.get(self.manager.wait_dumps.remote(), timeout=600)
        except Exception as exc:  # noqa: BLE001 - the run's own error is the one to raise
            log.warning("a debug rollout dump was not written: %s", exc)

    def close(self) -> None:
        try:
            ray.get(self.manager.close.remote())  # raises a dump write that failed
        finally:
            self.fleet.stop()
