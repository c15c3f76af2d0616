"""The placement layout of each mode (colocated, disaggregated, rollout-only, train-only) is a pure function."""

from __future__ import annotations

import pytest

from slime_lite.args import parser_defaults
from slime_lite.placement import plan_layout


def make(**kw):
    base = dict(actor_num_nodes=1, actor_num_gpus_per_node=2, critic_num_nodes=1, critic_num_gpus_per_node=2,
                rollout_num_gpus=2, advantage_estimator="grpo", debug_rollout_only=False, debug_train_only=False,
                colocate=False, rollout_external_engine_addrs=None)
    base.update(kw)
    return parser_defaults(**base)


@pytest.mark.parametrize(
    "kw, bundles, actor, critic, rollout",
    [
        ({}, 4, [0, 1], [], [2, 3]),
        ({"advantage_estimator": "ppo"}, 6, [0, 1], [2, 3], [4, 5]),
        ({"colocate": True}, 2, [0, 1], [], [0, 1]),
        ({"colocate": True, "rollout_num_gpus": 4}, 4, [0, 1], [], [0, 1, 2, 3]),
        ({"colocate": True, "advantage_estimator": "ppo"}, 2, [0, 1], [0, 1], [0, 1]),
        ({"debug_rollout_only": True}, 2, [], [], [0, 1]),
        ({"debug_train_only": True}, 2, [0, 1], [], []),
        ({"debug_train_only": True, "advantage_estimator": "ppo"}, 4, [0, 1], [2, 3], []),
        ({"rollout_external_engine_addrs": "h:1"}, 2, [0, 1], [], []),
        ({"debug_rollout_only": True, "rollout_external_engine_addrs": "h:1"}, 0, [], [], []),
    ],
)
def test_layout_table(kw, bundles, actor, critic, rollout):
    layout = plan_layout(make(**kw))
    assert (layout.num_bundles, layout.actor, layout.critic, layout.rollout) == (bundles, actor, critic, rollout)


def test_an_engine_that_would_span_two_nodes_is_refused_before_ray():
    """--num-gpus-per-node 2: the engines' bundles follow the trainer's 1 GPU, so a 2-GPU engine would take the
    last GPU of node 0 and the first of node 1; a trainer of 2 GPUs, or --colocate, keeps engines on one node."""
    from slime_lite.errors import SlimeLiteError

    flags = dict(num_gpus_per_node=2, rollout_num_gpus_per_engine=2, actor_num_gpus_per_node=1)
    with pytest.raises(SlimeLiteError, match=r"the engines' GPUs start after the trainer's 1 .*"
                                             r"--rollout-num-gpus-per-engine 2 does not divide"):
        plan_layout(make(**flags))
    assert plan_layout(make(**{**flags, "actor_num_gpus_per_node": 2})).rollout == [2, 3]
    assert plan_layout(make(**{**flags, "colocate": True})).rollout == [0, 1]


def test_ray_start_up_timeout_is_retried_once_and_other_errors_are_not(monkeypatch):
    """FAKE ray.init (Ray's own start-up timeout cannot be caused on purpose here): one timeout, then a start."""
    import ray

    from slime_lite import driver_watch, placement
    from slime_lite.engine_client import API_KEY_ENV

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv(API_KEY_ENV, "k")
    monkeypatch.setattr(driver_watch, "start", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    errors = [Exception("The current node timed out during startup. This could happen because ...")]

    def fake_init(**kw):
        calls.append("init")
        # a cluster of this run's own, even where `ray start` runs or left /tmp/ray/ray_current_cluster behind
        assert kw["address"] == "local"
        if errors:
            raise errors.pop()

    monkeypatch.setattr(ray, "init", fake_init)
    calls: list[str] = []
    placement.init_ray(make(log_level="info", debug_env=[]), 2)
    assert calls == ["init", "shutdown", "init"]
    calls.clear()
    errors[:] = [RuntimeError("some other failure")]
    with pytest.raises(RuntimeError, match="some other failure"):
        placement.init_ray(make(log_level="info", debug_env=[]), 2)
    assert calls == ["init"]
    calls.clear()
    errors[:] = [Exception("timed out during startup (2)"), Exception("timed out during startup (1)")]
    with pytest.raises(Exception, match=r"startup \(2\)"):  # a second timeout is the run's error
        placement.init_ray(make(log_level="info", debug_env=[]), 2)
    assert calls == ["init", "shutdown", "init"]


def test_bundles_ask_for_gpus_when_the_cluster_has_them_whatever_the_driver_sees(monkeypatch):
    """A job submitted from a node without CUDA (a CPU-only head node) asked for `slot` bundles no GPU node has:
    it waited out the placement timeout. With Ray up, the cluster's resources decide."""
    import ray

    from slime_lite import placement

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    for cluster, want in (({"CPU": 4.0, "GPU": 2.0}, "GPU"), ({"CPU": 4.0, "slot": 2.0}, "slot")):
        monkeypatch.setattr(ray, "cluster_resources", lambda c=cluster: c)
        assert placement.gpu_resource() == want
        opts = placement.bundle_options(None, 0, 0.4)
        assert (opts.get("num_gpus"), opts.get("resources")) == ((0.4, None) if want == "GPU" else
                                                                (None, {"slot": 0.4}))
