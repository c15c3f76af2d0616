"""The driver's train side hands the workers whole optimizer steps: a rollout whose sample count is not a multiple
of --global-batch-size (a generate hook or agent that splits trajectories, with a per-sample estimator) trains its
first whole steps, as slime trims, instead of stopping the run in the workers' batch planner; fewer samples than
one step is an error naming the flags. No Ray, no Megatron: the actor group is a stand-in that plans as the
workers do."""

from __future__ import annotations

import pytest

from slime_lite.backends.megatron import batch as B
from slime_lite.backends.megatron import side
from slime_lite.args import parser_defaults
from slime_lite.config import TrainSideConfig
from slime_lite.errors import SlimeLiteError
from slime_lite.types import POST_PROCESSED_REWARD, Sample, TrainResult


class _Actor:
    def __init__(self) -> None:
        self.trained: list[list[int]] = []

    def train(self, rollout_id: int, data: list, values: object) -> tuple:
        steps = B.trajectory_steps(data, 4)  # the workers' plan: 4-trajectory steps over two data-parallel ranks
        for dp_rank in range(2):
            B.step_shards(steps, dp_rank, 2, 1)
        self.trained.append([s.index for s in data])
        return TrainResult({"train/loss": 0.5}, [1.0] * len(steps)), None


def test_a_rollout_of_partial_steps_trains_its_whole_steps(monkeypatch):
    monkeypatch.setattr(side.ray, "put", lambda value: value)
    train = object.__new__(side.TrainSide)
    train.actor, train.critic, train.global_batch_size = _Actor(), None, 4
    train.config = TrainSideConfig.from_args(parser_defaults())  # no --ref-update-interval
    samples = [Sample(index=i, tokens=[1, 2, 3], response_length=1) for i in range(11)]
    record: dict = {}
    assert train.train(0, samples, record)[0] == {"actor": [1.0, 1.0]}
    assert train.actor.trained == [list(range(8))] and record["train/loss"] == 0.5
    assert train.train(1, samples[:8], {})[0] == {"actor": [1.0, 1.0]}  # whole steps: all of them
    assert train.actor.trained[-1] == list(range(8))
    with pytest.raises(SlimeLiteError, match="rollout 2 has 3 samples, fewer than one optimizer step of "
                                             "--global-batch-size 4"):
        train.train(2, samples[:3], {})


def test_a_group_estimator_trims_in_whole_prompt_groups(monkeypatch):
    """GRPO with groups of 3 and steps of 4 (a rollout function that returned 7 groups, 21 samples): the trim keeps
    whole groups in whole steps (12 samples), never half a group, whose advantages could not be computed."""
    monkeypatch.setattr(side.ray, "put", lambda value: value)
    args = parser_defaults()
    args.advantage_estimator, args.n_samples_per_prompt, args.global_batch_size = "grpo", 3, 4
    train = object.__new__(side.TrainSide)
    train.actor, train.critic, train.global_batch_size = _Actor(), None, 4
    train.config = TrainSideConfig.from_args(args)
    samples = [Sample(index=i, group_index=i // 3, tokens=[1, 2, 3], response_length=1) for i in range(21)]
    train.train(0, samples, {})
    assert train.actor.trained == [list(range(12))]
    with pytest.raises(SlimeLiteError, match="in whole groups of 3 \\(12 samples\\)"):
        train.train(1, samples[:9], {})
    # a --custom-reward-post-process-path hook gives the rewards: no group is compared, whole steps suffice
    args.custom_reward_post_process_path = "mod.post"
    train.config = TrainSideConfig.from_args(args)
    train.train(2, samples, {})
    assert train.actor.trained[-1] == list(range(20))
    # split trajectories under GRPO (samples sharing a rollout_id): the manager normalised each sample's reward over
    # its group's trajectories, so the trim, by trajectories (19 in 21 samples), keeps whole steps of 4 trajectories
    # (16: 18 samples); whole trajectories are trimmed in whole groups as before, whatever their metadata holds
    args.custom_reward_post_process_path = None
    train.config = TrainSideConfig.from_args(args)
    for s in samples:
        s.metadata[POST_PROCESSED_REWARD] = 0.0
    train.train(3, samples, {})
    assert train.actor.trained[-1] == list(range(12))
    samples[0].rollout_id = samples[1].rollout_id = samples[2].rollout_id = 0
    assert train.train(4, samples, {})[0] == {"actor": [1.0] * 4}
    assert train.actor.trained[-1] == list(range(18))


def test_a_non_finite_grad_norm_with_a_finite_loss_stops_the_run(monkeypatch):
    """A step whose backward overflowed (a custom loss hook, bf16) reports a finite loss and a NaN grad-norm: with
    no loss scaler to skip it, it wrote NaN weights, and the run stops before a checkpoint saves them."""
    monkeypatch.setattr(side.ray, "put", lambda value: value)

    class Overflowing(_Actor):
        def train(self, rollout_id, data, values):
            return TrainResult({"train/loss": 0.5}, [1.0, float("nan")]), None

    train = object.__new__(side.TrainSide)
    train.actor, train.critic, train.global_batch_size = Overflowing(), None, 4
    train.config = TrainSideConfig.from_args(parser_defaults())
    samples = [Sample(index=i, tokens=[1, 2, 3], response_length=1) for i in range(8)]
    record: dict = {}
    norms, _ = train.train(0, samples, record)
    with pytest.raises(SlimeLiteError, match="rollout 0: the actor's grad-norm is not finite at step 1 \\(nan\\)"):
        train.check_finite(0, record, norms)


def test_the_actors_and_the_critics_kth_steps_are_one_step_record(monkeypatch):
    """PPO: the driver logs each optimizer step once, with the actor's values and the critic's train/critic-
    values of that step side by side; the grad-norms stay per role for the grad-norm checks."""
    monkeypatch.setattr(side.ray, "put", lambda value: value)

    class Actor(_Actor):
        def train(self, rollout_id, data, values):
            return TrainResult({"train/loss": 0.5}, [1.0, 2.0], [{"train/loss": 0.25}, {"train/loss": 0.75}]), None

    class Critic:
        def compute_values(self, data):
            return None

        def train(self, rollout_id, data, values, returns):
            return TrainResult({"train/critic-value_loss": 3.0}, [4.0, 5.0],
                               [{"train/critic-value_loss": 2.5}, {"train/critic-value_loss": 3.5}])

    train = object.__new__(side.TrainSide)
    train.actor, train.critic, train.global_batch_size = Actor(), Critic(), 4
    train.config = TrainSideConfig.from_args(parser_defaults())
    record: dict = {}
    norms, steps = train.train(0, [Sample(index=i, tokens=[1, 2, 3], response_length=1) for i in range(8)], record)
    assert norms == {"actor": [1.0, 2.0], "critic": [4.0, 5.0]}
    assert steps == [{"train/loss": 0.25, "train/critic-value_loss": 2.5},
                     {"train/loss": 0.75, "train/critic-value_loss": 3.5}]
    assert record == {"train/loss": 0.5, "train/critic-value_loss": 3.0, "perf/train_time": record["perf/train_time"]}
