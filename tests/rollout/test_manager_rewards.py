"""The rollout manager stops a run whose reward function returned NaN or inf, after saving the rollout's dump."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_lite.args import parser_defaults
from slime_lite.errors import SlimeLiteError
from slime_lite.rollout.dumps import load_rollout_dump
from slime_lite.types import Sample, Status


class _Generator:
    """Stands in for the engines: one rollout of 4 samples, sample 2 with the given reward."""

    def __init__(self, reward: float) -> None:
        from types import SimpleNamespace

        self.reward = reward
        self.progress = [0, 0]
        self.client = SimpleNamespace(urls=[], failed=lambda: [])  # no engine to read step counters from
        self.over = SimpleNamespace(engine_urls=lambda: [])  # nor a weight version

    async def rollout(self, rollout_id: int, source) -> tuple[list[Sample], dict[str, float]]:  # noqa: ANN001
        samples = [Sample(group_index=i // 2, index=i, tokens=[5, 6, 7], response_length=1, loss_mask=[1],
                          reward=self.reward if i == 2 else 1.0, status=Status.COMPLETED) for i in range(4)]
        return samples, {}


def _manager(tiny_model_dir: Path, tmp_path: Path, reward: float):
    from slime_lite.rollout.manager import RolloutManager

    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), debug_rollout_only=True,
                           save_debug_rollout_data=str(tmp_path / "d_{rollout_id}.pt"))
    manager = RolloutManager(args, [])
    manager.generator, manager.source = _Generator(reward), object()
    return manager


@pytest.mark.parametrize("reward", [float("nan"), float("inf")])
def test_non_finite_reward_stops_the_rollout_naming_rollout_and_sample(tiny_model_dir, tmp_path, reward) -> None:
    manager = _manager(tiny_model_dir, tmp_path, reward)
    with pytest.raises(SlimeLiteError, match=rf"rollout 3: samples\[2\]\.reward is {reward} \(sample index 2, "
                                             r"prompt group 1\)"):
        manager.generate(3)
    assert str(load_rollout_dump(str(tmp_path / "d_3.pt")).samples[2].reward) == str(reward)  # kept to inspect


def test_finite_rewards_pass(tiny_model_dir, tmp_path) -> None:
    samples, metrics = _manager(tiny_model_dir, tmp_path, 0.0).generate(0)
    assert len(samples) == 4 and metrics["rollout/raw_reward"] == 0.75


@pytest.mark.parametrize("served, expected", [(["default"], -1.0), (["0", "default"], -1.0), (["2"], 2.0),
                                              ([], None)])
def test_the_weight_version_served_is_reported_and_never_pushed_is_minus_one(tiny_model_dir, tmp_path, served,
                                                                            expected) -> None:
    """An engine that never got a push serves "default": the version is -1, so --ci-test's version check fails
    (before, the metric was left out and a run whose every push was skipped passed that check)."""
    manager = _manager(tiny_model_dir, tmp_path, 0.0)
    rollout = manager.generator.rollout

    async def with_versions(rollout_id, source):  # noqa: ANN001
        samples, extra = await rollout(rollout_id, source)
        for s in samples:
            s.weight_versions = list(served)
        return samples, extra

    manager.generator.rollout = with_versions
    metrics = manager.generate(0)[1]
    assert metrics.get("rollout/weight_version") == expected


def test_one_stale_engine_among_several_shows_in_the_weight_version(tiny_model_dir, tmp_path) -> None:
    """The oldest version the rollout's requests reported, not the newest: one engine that kept old weights fails
    --ci-test's weight_version_served; a sample --partial-rollout carried already finished (its request was made in
    an earlier rollout) does not count."""
    from slime_lite.types import FINISHED_BEFORE

    manager = _manager(tiny_model_dir, tmp_path, 0.0)
    rollout = manager.generator.rollout
    marked: list[bool] = []

    async def one_stale(rollout_id, source):  # noqa: ANN001
        samples, extra = await rollout(rollout_id, source)
        for i, s in enumerate(samples):
            s.weight_versions = ["1" if i == 0 else "2"]
        if marked:
            samples[0].metadata[FINISHED_BEFORE] = rollout_id
        return samples, extra

    manager.generator.rollout = one_stale
    assert manager.generate(0)[1]["rollout/weight_version"] == 1.0
    marked.append(True)
    assert manager.generate(1)[1]["rollout/weight_version"] == 2.0


def test_dumps_are_written_in_the_background_and_a_failed_write_is_raised(tiny_model_dir, tmp_path,
                                                                           monkeypatch) -> None:
    """generate returns while its dump is still being written (the driver trains meanwhile); wait_dumps (and
    close) return once it is on disk; a write that failed is raised by wait_dumps (or a later generate), naming
    its error."""
    import threading

    from slime_lite.rollout import dumps

    manager = _manager(tiny_model_dir, tmp_path, 0.0)
    release, save = threading.Event(), dumps.save_rollout_dump

    def slow_save(*args, **kwargs):  # noqa: ANN002, ANN003
        assert release.wait(30)
        save(*args, **kwargs)

    monkeypatch.setattr(dumps, "save_rollout_dump", slow_save)
    samples, _ = manager.generate(0)
    assert len(samples) == 4 and not (tmp_path / "d_0.pt").exists()  # returned before the write
    release.set()
    manager.wait_dumps()
    assert len(load_rollout_dump(str(tmp_path / "d_0.pt")).samples) == 4

    def full_disk(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        raise SlimeLiteError(f"no space left on the device to write {path}")

    monkeypatch.setattr(dumps, "save_rollout_dump", full_disk)
    manager.generate(1)
    with pytest.raises(SlimeLiteError, match=r"no space left .*d_1\.pt"):
        manager.wait_dumps()
    manager.wait_dumps()  # raised once: nothing left to write


def test_a_non_finite_eval_reward_stops_the_run_after_its_eval_dump_is_on_disk(tiny_model_dir, tmp_path) -> None:
    """The eval before training runs outside the loop's failure handling: the manager itself waits for the eval's
    dump before raising (a writer thread still writing when Ray shuts down leaves no dump to inspect)."""
    manager = _manager(tiny_model_dir, tmp_path, 0.0)
    samples = [Sample(group_index=0, index=i, tokens=[5, 6, 7], response_length=1, loss_mask=[1],
                      reward=float("nan") if i == 1 else 1.0, status=Status.COMPLETED) for i in range(2)]
    manager.eval_fn = lambda *a, **k: {"e": {"samples": samples}}
    waited = []
    real = manager.wait_dumps
    manager.wait_dumps = lambda: (waited.append(True), real())[1]
    with pytest.raises(SlimeLiteError, match=r"eval e at rollout 0: samples\[1\]\.reward is nan"):
        manager.evaluate(0)
    assert waited and load_rollout_dump(str(tmp_path / "d_eval_0.pt")).samples[1].reward != 1.0
