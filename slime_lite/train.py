"""The driver: parse and check the flags (read-only from then on), place the processes, then run the loop one call
per phase: generate -> (release engine memory, onload trainer) -> train -> save -> push weights -> (offload
trainer, resume engines) -> eval -> log -> check.

It holds two objects and no other state: a rollout side (rollout/side.py: engines, router, rollout manager,
fault-tolerant recovery, engine memory) and a train side (backends/megatron/side.py: actor and critic groups; PPO's
values and returns pass between them as Ray refs). Each decides what its phases do in the run's mode: under
``--debug-rollout-only`` the train side has no group (Megatron is never imported) and the push does nothing; under
``--debug-train-only`` / ``--load-debug-rollout-data`` the rollout side starts no engine and the manager loads dumps.
``--async`` (train_async.py) generates rollout r + 1 while rollout r trains; the push waits for it. Under
``--fully-async`` the engines never stop generating (rollout/fully_async.py): each rollout takes the groups that
finished, and the push pauses the engines in place around the update (rollout/side.py). What a run
checks as it goes (--ci-test, grad-norms, the log-prob jump warning) is checks/ci.py's ``RunChecks``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from slime_lite.args import parse_args
from slime_lite.checks.ci import RunChecks
from slime_lite.errors import SlimeLiteError, run_main
from slime_lite.logging_setup import set_level, setup_logging
from slime_lite.metrics import MetricsLogger, write_args_json
from slime_lite.preflight import preflight
from slime_lite.profiling import DRIVER_TIMELINE, RunProfiler

log = logging.getLogger("slime_lite.train")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_level(args.log_level)  # third-party noise too
    preflight(args)  # outputs writable, every replay dump valid: before Ray starts
    import ray  # ray: `train --help` and flag errors stay instant

    try:
        return run(args)
    except ray.exceptions.RayTaskError as exc:  # a user error raised inside an actor is still a user error
        if isinstance(exc.cause, SlimeLiteError):
            raise exc.cause from None
        raise
    finally:
        ray.shutdown()


def run(args) -> int:
    """The RL loop, one call per phase. Each side decides what its phases do in the run's mode (see the module
    docstring); the parsed flags are read-only here."""
    # these import ray (`train --help` and flag errors stay instant); the train side imports Megatron only when it
    # builds a group, which --debug-rollout-only never does
    from slime_lite.backends.megatron.side import TrainSide
    from slime_lite.placement import create_placement_group, init_ray, plan_layout
    from slime_lite.rollout.side import RolloutSide
    from slime_lite.train_async import RolloutSchedule, record_lag

    layout = plan_layout(args)
    init_ray(args, layout.num_bundles)
    pg = create_placement_group(layout)
    if args.dump_details:
        write_args_json(args, os.path.join(args.dump_details, "args.json"))
    metrics = MetricsLogger(args)
    train = TrainSide(args, pg, layout)  # its workers start while the engines load
    rollout = RolloutSide(args, pg, layout.rollout, train.push_checked if train.trains else None)
    push = train.push if train.trains else None
    start, data_state = train.init()
    rollout.start(start, data_state)
    rollout.push_initial(push, start)
    train.offload({})
    if start == 0 and not args.skip_eval_before_train:  # eval ids count the rollouts trained so far: 0 = before
        metrics.log(rollout.evaluate(0), -1)
    checks = RunChecks(args, rollout.urls, start, train.trains)
    profiler = RunProfiler(args, train.groups, rollout.urls)  # --use-pytorch-profiler, memory snapshots
    schedule = RolloutSchedule(args, rollout.manager, rollout.wait, start)  # --async: one rollout ahead
    try:
        for rollout_id in range(start, args.num_rollout):
            step_t0 = time.monotonic()
            profiler.before(rollout_id)
            with DRIVER_TIMELINE.span("rollout"):
                samples, record = schedule.get(rollout_id)
            try:  # a rollout that stops the run (a lag past the bound, a NaN loss, a failed check) logs its metrics
                record_lag(schedule, samples, rollout_id, record)  # rollout/off_policy_lag
                rollout.release_memory(record)
                train.onload(record)
                schedule.train_started()
                grad_norms, steps = train.train(rollout_id, samples, record)
                if train.trains:
                    metrics.log_train_steps(steps, rollout_id)
                    train.check_finite(rollout_id, record, grad_norms, steps)
                schedule.train_finished(record)
                # before the save: a rollout that fails a check leaves no checkpoint a resume would go on from
                checks.after_rollout(rollout_id, record, grad_norms, schedule.expected_version(rollout_id))
            except BaseException:
                metrics.log(record, rollout_id)  # the failing rollout's metrics, for compare-runs
                raise
            train.save(rollout_id, lambda: schedule.data_state(rollout_id))
            schedule.before_push(record)  # --async: the generation ahead finishes first
            rollout.push_weights(push, rollout_id + 1, record)
            train.offload(record)
            rollout.resume_memory(record)
            record.update(rollout.evaluate(rollout_id + 1))
            record["perf/step_time"] = time.monotonic() - step_t0
            # the step's throughput: the rollout's tokens (prompts and responses) per second of the whole step
            record["perf/tokens_per_s"] = sum(len(s.tokens) for s in samples) / record["perf/step_time"]
            record.update(rollout.step_records() | train.step_records())
            metrics.log(record, rollout_id)
            profiler.after(rollout_id)
    except BaseException:
        if args.save_debug_rollout_data:
            rollout.wait_dumps()
        with contextlib.suppress(Exception):  # the run's own error is the one to raise
            metrics.close()  # TensorBoard's events of the failing rollout reach the disk too
        raise
    metrics.close()
    rollout.close()
    return 0


if __name__ == "__main__":
    setup_logging()
    raise SystemExit(run_main(main))
