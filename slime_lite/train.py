"""The driver: parse and check the flags, place the processes, then loop generate -> (onload) -> train -> save ->
push weights -> (offload) -> eval -> log. Training is PPO's order when there is a critic: the critic's values, then
the actor's log-probs, advantages and policy steps, then the critic's value steps toward the returns. With
``--async`` (train_async.py) rollout r + 1 generates while rollout r trains, and the push waits for it.

The debug modes are the visible branches below: ``--debug-rollout-only`` never builds (or imports) the trainer,
``--debug-train-only`` / ``--load-debug-rollout-data`` start no engine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from slime_lite.args import parse_args
from slime_lite.errors import SlimeLiteError
from slime_lite.metrics import MetricsLogger, check_finite_losses, memory_record, write_args_json
from slime_lite.preflight import preflight

log = logging.getLogger("slime_lite.train")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    preflight(args)  # outputs writable, every replay dump valid: before Ray starts
    import ray

    try:
        return run(args)
    except ray.exceptions.RayTaskError as exc:  # a user error raised inside an actor is still a user error
        if isinstance(exc.cause, SlimeLiteError):
            raise exc.cause from None
        raise
    finally:
        ray.shutdown()


def run(args) -> int:
    import ray

    from slime_lite.placement import create_placement_group, init_ray, plan_layout
    from slime_lite.rollout.engines import engine_memory, start_engines
    from slime_lite.config import CiConfig
    from slime_lite.debug.ci_checks import CiCheckFailed, enforce, iteration2_check, with_engine_dtype
    from slime_lite.debug.grad_norm import STEP_GRAD_NORMS, GradNormCI
    from slime_lite.profiling import DRIVER_TIMELINE, RunProfiler
    from slime_lite.rollout.manager import RolloutManager
    from slime_lite.train_async import RolloutSchedule, record_lag

    layout = plan_layout(args)
    init_ray(args, layout.num_bundles)
    pg = create_placement_group(layout)
    if args.dump_details:
        write_args_json(args, os.path.join(args.dump_details, "args.json"))
    metrics = MetricsLogger(args)

    actor = critic = None
    if not args.debug_rollout_only:  # created now, so their processes start while the engines load; init below
        from slime_lite.backends.megatron.group import ActorGroup, CriticGroup  # the trainer is imported only here

        actor = ActorGroup(args, pg, layout.actor)
        critic = CriticGroup(args, pg, layout.critic) if args.advantage_estimator == "ppo" else None
    engines, urls = ([], []) if args.debug_train_only else start_engines(args, pg, layout.rollout)
    router = None
    if args.use_sglang_router and urls:  # generation goes through the router; weights still to each engine
        from slime_lite.backends.sglang.launcher import SGLangRouter

        router = SGLangRouter(urls)
    fault_engine = engines[0] if args.debug_inject_fault == "kill-engine" and engines else None
    manager = ray.remote(RolloutManager).options(num_cpus=0.5, max_concurrency=2).remote(
        args, [router.start()] if router else urls, fault_engine)
    recovery = None  # --use-fault-tolerance: dead engines are restarted (rollout/recovery.py)
    if args.use_fault_tolerance and engines:
        from slime_lite.rollout.recovery import EngineRecovery

        recovery = EngineRecovery(args, pg, layout.rollout, engines, urls, manager, router)
    get = recovery.wait if recovery is not None else ray.get

    start_rollout_id = 0
    if actor is not None:
        start_rollout_id, data_state = actor.init()
        if critic is not None:
            critic.init()
        if data_state:
            ray.get(manager.load_state.remote(data_state))
        if urls:
            t0 = time.monotonic()
            actor.update_weights(urls, version=start_rollout_id)
            log.info("initial weights pushed to %d engine(s) in %.2fs", len(urls), time.monotonic() - t0)
        if recovery is not None:  # a restarted engine gets the weights the others serve, always checked
            recovery.push = lambda new_urls, version: actor.update_weights(new_urls, version, check=True)
            recovery.version = start_rollout_id
    trainers = [g for g in (actor, critic) if g is not None]
    if args.offload_train:
        for group in trainers:
            group.offload()

    evaluate = bool(urls and args.eval_interval)
    if evaluate and start_rollout_id == 0:  # eval ids count the rollouts trained so far: 0 = before training
        metrics.log(get(manager.evaluate.remote(0)), -1)
    ci = with_engine_dtype(CiConfig.from_args(args), urls)  # the log-prob bound follows the engines' precision
    watch = LogprobDiffWatch(ci.logprob_diff_jump_factor)
    grad_ci = GradNormCI.from_args(args, start_rollout_id)  # --ci-save-grad-norm / --ci-load-grad-norm
    profiler = RunProfiler(args, trainers, urls)  # --use-pytorch-profiler / --profile-target, memory snapshots
    # when each rollout is generated: before its training (default), or during the previous one's (--async)
    rollouts = RolloutSchedule(args, manager, lambda ref, r: wait_with_progress(manager, ref, r, recovery),
                               start_rollout_id)
    try:
        done = 0
        for rollout_id in range(start_rollout_id, args.num_rollout):
            step_t0 = time.monotonic()
            profiler.before(rollout_id)
            with DRIVER_TIMELINE.span("rollout"):
                samples, record = rollouts.get(rollout_id)  # --async: rollout_id + 1 starts generating here
            if actor is not None:
                record_lag(rollouts, samples, rollout_id, record)  # rollout/off_policy_lag
                onload_phase(args, urls, engines, trainers, record)
                with timed(record, "perf/train_time"):
                    train_t0 = time.monotonic()
                    rollouts.train_started()
                    data = ray.put(samples)
                    # PPO: critic values -> actor (log-probs, advantages, policy steps) -> critic steps to the returns
                    values = critic.compute_values(data) if critic is not None else None
                    train_metrics, returns = actor.train(rollout_id, data, values)
                    step_norms = {"actor": train_metrics.pop(STEP_GRAD_NORMS)}
                    DRIVER_TIMELINE.add("log_probs", train_t0, train_metrics.get("perf/log_probs_time", 0.0))
                    record.update(train_metrics)
                    if critic is not None:
                        critic_metrics = critic.train(rollout_id, data, values, returns)
                        step_norms["critic"] = critic_metrics.pop(STEP_GRAD_NORMS)
                        record.update(critic_metrics)
                    rollouts.train_finished(record)
                check_finite_losses(record, rollout_id)
                if args.save and args.save_interval and (rollout_id + 1) % args.save_interval == 0:
                    with DRIVER_TIMELINE.span("save"):
                        actor.save(rollout_id, rollouts.data_state(rollout_id))
                        if critic is not None:
                            critic.save(rollout_id, None)
                if urls:
                    rollouts.before_push(record)  # --async: the generation ahead finishes first
                    with timed(record, "perf/update_weights_time"):
                        if args.offload_rollout:  # colocated: room for the weights now, for the KV cache after offload
                            resume_t0 = time.monotonic()
                            engine_memory(urls, "resume", ["weights"])
                            add_time(record, "perf/offload/engine_resume_time", resume_t0)
                        if recovery is not None:  # an engine that died since the rollout is replaced first
                            recovery.check()
                        record.update(actor.update_weights(urls, version=rollout_id + 1))
                        if recovery is not None:
                            recovery.version = rollout_id + 1
                offload_phase(args, urls, trainers, record)
            if evaluate and ((rollout_id + 1) % args.eval_interval == 0 or rollout_id + 1 == args.num_rollout):
                with DRIVER_TIMELINE.span("eval"):
                    record.update(get(manager.evaluate.remote(rollout_id + 1)))
            if recovery is not None:
                record["rollout/engine_restarts"] = float(recovery.take_restarts())
            record["perf/step_time"] = time.monotonic() - step_t0
            record.update(memory_records(manager, engines, actor, critic))
            metrics.log(record, rollout_id)
            profiler.after(rollout_id)
            if actor is not None:
                if rollouts.on_policy(rollout_id):  # --async: off-policy rollouts differ from the trainer by design
                    watch.update(record)
                if args.ci_test:
                    enforce(ci, record, rollout_id, first=rollout_id == start_rollout_id,
                            expected_version=rollouts.expected_version(rollout_id))
                if grad_ci is not None:  # after the metrics are written: compare-runs can show the failing rollout
                    for role, norms in step_norms.items():
                        grad_ci.update(role, rollout_id, norms)
            done += 1
        if args.ci_test and actor is not None and args.num_rollout - start_rollout_id >= 2:
            check = iteration2_check(done)
            if not check.passed:
                raise CiCheckFailed(check, start_rollout_id + done)

    except BaseException:  # the dumps of the rollouts so far are what the user debugs this failure with
        if args.save_debug_rollout_data:
            log.info("the run failed: waiting for the debug rollout dumps to be written")
            try:
                ray.get(manager.wait_dumps.remote(), timeout=600)
            except Exception as exc:  # noqa: BLE001 - the run's own error is the one to raise
                log.warning("a debug rollout dump was not written: %s", exc)
        raise
    metrics.close()
    try:
        ray.get(manager.close.remote())  # raises a dump write that failed
    finally:
        for engine in engines:
            ray.get(engine.stop.remote())
        if router is not None:
            router.stop()
    return 0


def add_time(record: dict, key: str, t0: float) -> None:
    """perf/offload/engine_{release,resume}_time: the engines' memory calls, parts of perf/offload_time (the weights'
    resume is in perf/update_weights_time). What a resume leaves for later (CUDA-graph captures on the first decode
    steps) is in perf/rollout/engine_capture_time."""
    record[key] = record.get(key, 0.0) + time.monotonic() - t0


@contextmanager
def timed(record: dict, key: str) -> Iterator[None]:
    """Add the seconds the block takes to ``record[key]`` (and a span to the driver timeline)."""
    from slime_lite.profiling import DRIVER_TIMELINE

    t0 = time.monotonic()
    yield
    record[key] = record.get(key, 0.0) + time.monotonic() - t0
    DRIVER_TIMELINE.add(key.removeprefix("perf/").removesuffix("_time"), t0, time.monotonic() - t0)


def onload_phase(args, urls: list[str], engines: list, trainers: list, record: dict) -> None:
    """Before training, colocated: the engines release their memory (--offload-rollout) and the train groups take
    theirs back (--offload-train). Counted in perf/offload_time, with offload_phase."""
    if not (args.offload_train or args.offload_rollout):
        return
    import ray

    from slime_lite.rollout.engines import engine_memory

    with timed(record, "perf/offload_time"):
        if args.offload_rollout and urls:
            t0 = time.monotonic()
            engine_memory(urls, "release")
            add_time(record, "perf/offload/engine_release_time", t0)
            record.update(memory_record("engine_released", ray.get([e.memory.remote() for e in engines])))
        if args.offload_train:
            for group in trainers:
                group.onload()


def offload_phase(args, urls: list[str], trainers: list, record: dict) -> None:
    """After the weight push: the train groups free their memory (--offload-train) and the engines get their KV
    cache back (--offload-rollout)."""
    if not (args.offload_train or args.offload_rollout):
        return
    from slime_lite.rollout.engines import engine_memory

    with timed(record, "perf/offload_time"):
        if args.offload_train:
            for group in trainers:
                group.offload()
            record.update(memory_record("actor_offloaded", trainers[0].memory()))
        if args.offload_rollout and urls:
            t0 = time.monotonic()
            engine_memory(urls, "resume", ["kv_cache"])
            add_time(record, "perf/offload/engine_resume_time", t0)


def memory_records(manager, engines: list, actor, critic) -> dict[str, float]:
    """perf/memory/<process group>/...: the rollout manager, the engines and the train groups, after a step."""
    import ray

    out = memory_record("rollout_manager", [ray.get(manager.memory.remote())])
    if engines:
        out.update(memory_record("engine", ray.get([e.memory.remote() for e in engines])))
    for name, group in (("actor", actor), ("critic", critic)):
        if group is not None:
            out.update(memory_record(name, group.memory()))
    return out


def wait_with_progress(manager, ref, rollout_id: int, recovery=None):
    """ray.get (``recovery.wait`` under --use-fault-tolerance: dead engines are restarted meanwhile), with a progress
    bar of the rollout's finished samples when stderr is a terminal."""
    import sys

    import ray

    if not sys.stderr.isatty():
        return recovery.wait(ref) if recovery is not None else ray.get(ref)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(f"rollout {rollout_id}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("generate", total=None)

        def show() -> None:
            done, total = ray.get(manager.progress.remote())
            bar.update(task, completed=done, total=total or None)

        if recovery is not None:
            return recovery.wait(ref, on_poll=show)
        while not ray.wait([ref], timeout=0.2)[0]:
            show()
    return ray.get(ref)


class LogprobDiffWatch:
    """Warns when the rollout/train log-prob mismatch jumps between rollouts (names the weight version)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.best: float | None = None

    def update(self, record: dict) -> None:
        value = record.get("train/train_rollout_logprob_abs_diff")
        if value is None or not self.factor:
            return
        if self.best is not None and value > self.factor * max(self.best, 1e-7):
            log.warning(
                "train_rollout_logprob_abs_diff jumped to %.3g (lowest so far %.3g) with engine weight version %s: "
                "check the last weight push (--check-weight-update-equal) and the engine's precision",
                value, self.best, record.get("rollout/weight_version", "?"),
            )
        self.best = value if self.best is None else min(self.best, value)


if __name__ == "__main__":
    from slime_lite.cli import run_main
    from slime_lite.logging_setup import setup_logging

    setup_logging()
    raise SystemExit(run_main(main))
