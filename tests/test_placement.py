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
