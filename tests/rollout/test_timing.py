"""perf/rollout/* (rollout/timing.py): the manager-side parts of perf/rollout_time."""

from __future__ import annotations

import pytest

from slime_lite.rollout.timing import phase_metrics


@pytest.mark.parametrize("sent, back", [(2.0, 20.0), (None, None)])
def test_the_phases_partition_the_rollout_time_and_no_key_is_a_constant_zero(sent, back) -> None:
    """prepare + generate + reward cover start -> end exactly (a rollout function that never used the generator:
    all prepare), so no remainder is logged: an ``overhead_time`` would always be 0."""
    m = phase_metrics(1.0, sent, back, 25.0, [], [])
    assert set(m) == {"perf/rollout/prepare_time", "perf/rollout/generate_time", "perf/rollout/reward_time"}
    assert sum(m.values()) == pytest.approx(24.0)
    if sent is not None:
        assert (m["perf/rollout/prepare_time"], m["perf/rollout/generate_time"]) == (1.0, 18.0)
