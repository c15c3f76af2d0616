"""The driver's train side: the actor group and, for an estimator that needs one, the critic group, and everything
between them. PPO's values and returns pass between the groups as Ray object references (never through the
driver's memory); advantages are computed inside the actor. Under ``--debug-rollout-only`` there is no group and
every phase does nothing (nothing of Megatron is imported: the groups import their workers when built).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import ray

from slime_lite.backends.megatron.group import ActorGroup, CriticGroup
from slime_lite.config import TrainSideConfig
from slime_lite.errors import SlimeLiteError
from slime_lite.metrics import check_finite_losses, memory_record
from slime_lite.profiling import DRIVER_TIMELINE, timed
from slime_lite.types import trajectory_ends

log = logging.getLogger(__name__)


class TrainSide:
    def __init__(self, args: Any, pg: Any, layout: Any) -> None:
        """Create the groups' workers (their processes start while the engines load; ``init`` builds the models)."""
        self.config = c = TrainSideConfig.from_args(args)
        self.offload_train = c.offload_train
        self.global_batch_size = args.global_batch_size
        self.actor = ActorGroup(args, pg, layout.actor) if c.trains else None
        self.critic = CriticGroup(args, pg, layout.critic) if c.has_critic else None
        self.groups = [g for g in (self.actor, self.critic) if g is not None]

    @property
    def trains(self) -> bool:
        return self.actor is not None

    def init(self) -> tuple[int, Any]:
        """Build the models (from the HF checkpoint, or a --load checkpoint): (the first rollout id, the rollout
        data state saved with that checkpoint)."""
        if self.actor is None:
            return 0, None
        start = self.actor.init()
        if self.critic is not None:
            self.critic.init()
        return start

    def push(self, urls: list[str], version: int, check: bool = False) -> dict[str, float]:
        """The actor's weights to the engines at ``urls`` as ``version`` (``check``: the weight-equality check
        whatever --check-weight-update-equal says); the push's parts in seconds."""
        return self.actor.update_weights(urls, version, check) if self.actor is not None else {}

    def push_checked(self, urls: list[str], version: int) -> dict[str, float]:
        """What a restarted engine gets (--use-fault-tolerance): the current weights, always checked."""
        return self.push(urls, version, check=True)

    def train(self, rollout_id: int, samples: list, record: dict) -> tuple[dict[str, list[float]], list[dict]]:
        """One rollout's training, in PPO's order when there is a critic: its values, then the actor (log-probs,
        advantages, policy steps), then the critic's steps toward the returns. Metrics go into ``record``;
        returns each role's per-step grad-norms, and each optimizer step's metrics (the actor's and the critic's
        k-th steps in one record)."""
        if self.actor is None:
            return {}, []
        samples = self.whole_steps(rollout_id, samples)
        with timed(record, "perf/train_time"):
            t0 = time.monotonic()
            data = ray.put(samples)
            values = self.critic.compute_values(data) if self.critic is not None else None
            actor, returns = self.actor.train(rollout_id, data, values)
            DRIVER_TIMELINE.add("log_probs", t0, actor.metrics.get("perf/log_probs_time", 0.0))
            record.update(actor.metrics)
            norms, steps = {"actor": actor.grad_norms}, [dict(s) for s in actor.steps]
            if self.critic is not None:
                critic = self.critic.train(rollout_id, data, values, returns)
                record.update(critic.metrics)
                norms["critic"] = critic.grad_norms
                steps += [{} for _ in critic.steps[len(steps):]]
                for step, critic_step in zip(steps, critic.steps):
                    step.update(critic_step)
            if self.config.updates_reference_after(rollout_id):  # --ref-update-interval
                self.actor.update_reference()
        return norms, steps

    @staticmethod
    def check_finite(rollout_id: int, record: dict, norms: dict[str, list[float]], steps: list[dict] = ()) -> None:
        """Stop the run on a rollout's non-finite loss or grad-norm, before a checkpoint saves its weights, naming the
        first optimizer step (of ``steps``, the driver has logged them) that went wrong."""
        check_finite_losses(record, rollout_id, steps)
        for role, role_norms in norms.items():  # (no loss scaler skips such a step: it wrote non-finite weights)
            bad = next((i for i, g in enumerate(role_norms) if not math.isfinite(g)), None)
            if bad is not None:
                raise SlimeLiteError(
                    f"rollout {rollout_id}: the {role}'s grad-norm is not finite at step {bad} ({role_norms[bad]}) "
                    "though "
                    "its loss is: that step wrote non-finite weights, so the run stops before a checkpoint saves "
                    "them. Usual causes: a loss whose backward overflows (a custom loss or reducer hook), a learning "
                    "rate too high, an overflow in bf16; replay the rollout with --load-debug-rollout-data.")

    def whole_steps(self, rollout_id: int, samples: list) -> list:
        """The samples that fill whole optimizer steps of --global-batch-size trajectories (a trajectory split into
        several samples, by an agent or a generate hook, counts once, as slime counts rollouts): a rollout whose
        trajectory count is not a multiple of it (a rollout function returning more groups) trains its first whole
        steps and leaves the rest out, as slime trims, in whole prompt groups for a group estimator (GRPO); fewer
        trajectories than one step is an error naming the flags. A rollout of split trajectories (the manager
        normalised its rewards already) is trimmed by trajectories."""
        ends = trajectory_ends(samples)
        group = 1 if len(ends) < len(samples) else self.config.group_size
        g = math.lcm(self.global_batch_size, group)
        kept = len(ends) // g * g
        if kept == len(ends):
            return samples
        what = "samples" if len(ends) == len(samples) else f"trajectories (in {len(samples)} samples)"
        if kept == 0:
            raise SlimeLiteError(f"rollout {rollout_id} has {len(ends)} {what}, fewer than one optimizer step of "
                                 f"--global-batch-size {self.global_batch_size} in whole groups of {group} ({g} "
                                 f"{what.split()[0]}): lower --global-batch-size (it must divide by the "
                                 "data-parallel size x --micro-batch-size) or raise --rollout-batch-size.")
        keep = {samples[i].trajectory for i in ends[:kept]}
        trimmed = [s for s in samples if s.trajectory in keep]
        log.warning("rollout %d: %d %s are not a multiple of --global-batch-size %d in whole groups of %d: "
                    "training the first %d (%d step(s)), %d sample(s) left out", rollout_id, len(ends), what,
                    self.global_batch_size, group, kept, kept // self.global_batch_size, len(samples) - len(trimmed))
        return trimmed

    def save(self, rollout_id: int, data_state: Any) -> None:
        """Every --save-interval rollouts: each group's checkpoint (``data_state()``: the actor's copy of the
        rollout data cursor, read only when a checkpoint is written)."""
        if self.actor is None or not self.config.saves_after(rollout_id):
            return
        with DRIVER_TIMELINE.span("save"):
            self.actor.save(rollout_id, data_state())
            if self.critic is not None:
                self.critic.save(rollout_id, None)

    def onload(self, record: dict) -> None:
        """--offload-train, before training: the groups take their GPU memory back (perf/offload_time)."""
        if not (self.offload_train and self.groups):
            return
        with timed(record, "perf/offload_time"):
            for group in self.groups:
                group.onload()

    def offload(self, record: dict) -> None:
        """--offload-train, after the push (and once after start-up): the groups free their GPU memory."""
        if not (self.offload_train and self.groups):
            return
        with timed(record, "perf/offload_time"):
            for group in self.groups:
                group.offload()
            record.update(memory_record("actor_offloaded", self.groups[0].memory()))

    def step_records(self) -> dict[str, float]:
        """The memory of each group's processes after a step."""
        out: dict[str, float] = {}
        for name, group in (("actor", self.actor), ("critic", self.critic)):
            if group is not None:
                out.update(memory_record(name, group.memory()))
        return out
