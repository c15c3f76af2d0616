"""Which rollout the driver trains on, and when each is generated: ``--async`` is one-step-off training (slime's
``train_async.py``).

Synchronous (the default): rollout r is generated, then trained on, then the weights are pushed (version r + 1), so
rollout r is always generated with weight version r. ``--async`` (disaggregated placement only): as soon as rollout r
is in hand, rollout r + 1 starts generating while r trains; the weight push after training r waits for that
generation to finish (a push never lands mid-rollout), and rollout r + 2 starts after the push. Rollout r > first is
then generated with weight version r - 1: the off-policy lag (trainer version minus sample version) is 1, logged
per rollout as ``rollout/off_policy_lag`` and asserted <= 1.

Per rollout the metrics carry a timeline in seconds since the run started (``timeline/generate_start``,
``generate_end``, ``train_start``, ``train_end``) and ``perf/async_overlap_time``: how long rollout r + 1's
generation ran while rollout r trained.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from slime_lite.config import RolloutSideConfig
from slime_lite.errors import SlimeLiteError
from slime_lite.types import FINISHED_BEFORE

log = logging.getLogger("slime_lite.train")

CI_NOTE = ("--ci-test with --async: rollouts after the first are generated with weights one version older than "
           "the trainer's (off-policy lag 1), so train_rollout_logprob_diff is checked on the first rollout only, "
           "weight_version_served expects version r - 1 for rollout r, and the log-prob jump warning is off; the "
           "other checks are unchanged, and a lag above 1 stops the run")

FULLY_ASYNC_CI_NOTE = ("--ci-test with --fully-async: the engines must serve weight version r when rollout r is "
                       "taken; the train/rollout log-prob check and the log-prob jump warning run only on rollouts "
                       "that hold tokens of the trainer's weights (rollout/async/newest_lag 0), over those tokens")


class RolloutSchedule:
    """``get(r)`` returns rollout r's samples and metrics; ``before_push()`` returns once no generation runs."""

    def __init__(self, args: Any, manager: Any, wait: Callable[[Any, int], Any], start_rollout_id: int,
                 get: Callable[[Any], Any] | None = None) -> None:
        """``wait(ref, rollout_id)`` waits for a generation; ``get`` for the manager's small calls (ray.get)."""
        if get is None:
            get = ray.get
        self.args, self.manager, self.wait, self.fetch = args, manager, wait, get
        self.overlap = bool(args.async_train)
        self.pushes = RolloutSideConfig.from_args(args)  # when the weights are pushed (--update-weights-interval)
        self.start = start_rollout_id
        self.t0 = time.time()
        self.pending: tuple[int, Any, float] | None = None  # (rollout id, ref, start time) of the generation ahead
        self.ahead: tuple[Any, float] | None = None  # its result once waited for (before the push)
        self.data_states: dict[int, Any] = {}  # --async --save: the data cursor before rollout r was generated
        self.train_start = 0.0
        if self.overlap and args.ci_test:
            log.info(CI_NOTE)
        if args.fully_async and args.ci_test:
            log.info(FULLY_ASYNC_CI_NOTE)

    def _now(self) -> float:
        return time.time() - self.t0

    def _launch(self, rollout_id: int) -> None:
        if self.overlap and self.args.save:  # the manager is idle now: its cursor is the one before rollout_id
            # only rollout_id - 1's checkpoint can still read one: the older ones (rollouts not saved) are dropped
            self.data_states = {r: s for r, s in self.data_states.items() if r >= rollout_id}
            self.data_states[rollout_id] = self.fetch(self.manager.state.remote())
        self.pending = (rollout_id, self.manager.generate.remote(rollout_id), self._now())

    def _collect(self) -> tuple[Any, float]:
        rollout_id, ref, started = self.pending
        result = self.wait(ref, rollout_id)
        self.pending = None
        return result, started

    def get(self, rollout_id: int) -> tuple[list, dict[str, float]]:
        wait_t0 = time.monotonic()
        if self.ahead is not None:
            (samples, record), started = self.ahead
            self.ahead = None
        else:
            if self.pending is None:
                self._launch(rollout_id)
            assert self.pending[0] == rollout_id, (self.pending[0], rollout_id)
            (samples, record), started = self._collect()
        record["perf/rollout_wait_time"] = time.monotonic() - wait_t0
        record["timeline/generate_start"] = started
        record["timeline/generate_end"] = started + record.get("perf/rollout_time", 0.0)
        if self.overlap and rollout_id + 1 < self.args.num_rollout:
            self._launch(rollout_id + 1)  # generates while rollout_id trains
        return samples, record

    def train_started(self) -> None:
        self.train_start = self._now()

    def train_finished(self, record: dict[str, float]) -> None:
        record["timeline/train_start"], record["timeline/train_end"] = self.train_start, self._now()

    def before_push(self, record: dict[str, float]) -> None:
        """--async: wait for the generation ahead (the engines serve one weight version per rollout), and record
        how long it overlapped this rollout's training."""
        if self.pending is None:
            return
        self.ahead = self._collect()
        (_, ahead_record), started = self.ahead
        if "timeline/train_start" in record:
            ended = started + ahead_record.get("perf/rollout_time", 0.0)
            overlap = min(ended, record["timeline/train_end"]) - max(started, record["timeline/train_start"])
            record["perf/async_overlap_time"] = max(0.0, overlap)

    def data_state(self, rollout_id: int) -> Any:
        """The rollout data state to save with the checkpoint of rollout_id: the cursor before rollout_id + 1."""
        if rollout_id + 1 in self.data_states:
            return self.data_states.pop(rollout_id + 1)
        return self.fetch(self.manager.state.remote())

    def expected_version(self, rollout_id: int) -> int:
        """The weight version rollout_id must be generated with: r (synchronous), r - 1 after the first (--async);
        with --update-weights-interval that of the last push before it (a push skipped by the interval is expected,
        one that was due and did not land is not)."""
        if self.overlap:
            return max(rollout_id - 1, self.start)
        return self.pushes.served_version(rollout_id, self.start)

    def on_policy(self, rollout_id: int) -> bool:
        return self.expected_version(rollout_id) == rollout_id


def off_policy_lag(samples: list, trainer_version: int) -> int | None:
    """Trainer version minus the oldest weight version the engines generated this rollout with: each sample's last
    request's (a sample continued by --partial-rollout also holds older tokens: their age is
    rollout/partial/age_max; one carried already finished made no request this rollout and is left out). None when
    no sample was generated this rollout, or an engine reported no pushed version, e.g. it still serves the weights
    it loaded itself."""
    versions = [v for s in samples if not (isinstance(s.metadata, dict) and FINISHED_BEFORE in s.metadata)
                for v in s.weight_versions[-1:]]
    if not versions or not all(str(v).isdigit() for v in versions):
        return None
    return trainer_version - min(int(v) for v in versions)


def record_lag(schedule: RolloutSchedule, samples: list, rollout_id: int, record: dict[str, float]) -> None:
    """``rollout/off_policy_lag`` of rollout_id; under --async a lag above 1 is a scheduling bug and stops the run."""
    lag = off_policy_lag(samples, rollout_id)
    if lag is None:
        return
    record["rollout/off_policy_lag"] = float(lag)
    if schedule.overlap and lag > 1:
        raise SlimeLiteError(
            f"--async: rollout {rollout_id} has samples generated with weight version {rollout_id - lag}, {lag} "
            "versions behind the trainer (at most 1 is allowed): a weight push did not reach the engines before "
            "the next generation started. This is a bug in the driver's schedule; rerun without --async.")
