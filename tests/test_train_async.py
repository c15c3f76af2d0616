"""--async (one-step-off training, slime's train_async.py): the schedule of generations and weight versions, the lag
check, what --ci-test relaxes, and the refusals. No Ray: the rollout manager is a fake that records the order of
calls (the real run is test_loop.py::test_async_overlaps_generation_with_training)."""

from __future__ import annotations

import itertools

import pytest

from slime_lite.args import parse_args, parser_defaults
from slime_lite.config import CiConfig
from slime_lite.checks import ci as cc
from slime_lite.errors import SlimeLiteError
from slime_lite.train_async import RolloutSchedule, off_policy_lag, record_lag
from slime_lite.types import Sample


class FakeManager:
    """Stands in for the RolloutManager actor: ``.generate.remote(r)`` / ``.state.remote()`` log the call and return
    the value itself (the schedule's ``wait`` / ``get`` are then the identity)."""

    def __init__(self, served: list[int]) -> None:
        self.calls: list[str] = []
        self.served = served  # the weight version the engine serves now (a one-element list, set by the "push")
        outer = self

        class Remote:
            def __init__(self, fn):
                self.remote = fn

        def generate(r):
            outer.calls.append(f"generate {r}")
            return [Sample(weight_versions=[str(outer.served[0])])], {"perf/rollout_time": 0.0}

        def state():
            outer.calls.append("state")
            return {"cursor": len([c for c in outer.calls if c.startswith("generate")])}

        self.generate, self.state = Remote(generate), Remote(state)


def drive(async_train: bool, n: int = 4, save: bool = False):
    """The driver's loop order (train.py): get -> lag -> train -> before_push -> push; returns lags and the calls."""
    args = parser_defaults(async_train=async_train, num_rollout=n, ci_test=False, save="/ckpt" if save else None)
    served = [0]
    manager = FakeManager(served)
    schedule = RolloutSchedule(args, manager, lambda ref, r: ref, 0, get=lambda ref: ref)
    lags, states = [], []
    for r in range(n):
        samples, record = schedule.get(r)
        record_lag(schedule, samples, r, record)
        lags.append(record["rollout/off_policy_lag"])
        manager.calls.append(f"train {r}")
        schedule.train_started()
        schedule.train_finished(record)
        if save:
            states.append(schedule.data_state(r))
        schedule.before_push(record)
        served[0] = r + 1
        manager.calls.append(f"push {r + 1}")
        assert schedule.expected_version(r) == int(samples[0].weight_versions[0])
    return lags, manager.calls, states


def test_sync_generates_each_rollout_with_the_weights_trained_on_all_before_it():
    lags, calls, _ = drive(async_train=False, n=3)
    assert lags == [0, 0, 0]
    assert calls == ["generate 0", "train 0", "push 1", "generate 1", "train 1", "push 2", "generate 2", "train 2",
                     "push 3"]


def test_async_generates_the_next_rollout_before_training_and_pushes_between_generations():
    lags, calls, _ = drive(async_train=True, n=4)
    assert lags == [0, 1, 1, 1]  # one step off, never more
    assert calls == ["generate 0", "generate 1", "train 0", "push 1", "generate 2", "train 1", "push 2",
                     "generate 3", "train 2", "push 3", "train 3", "push 4"]  # no generation past --num-rollout


def test_async_checkpoint_saves_the_data_cursor_before_the_next_rollout_not_the_one_generating():
    _, _, states = drive(async_train=True, n=3, save=True)
    # rollout r's checkpoint resumes at r + 1: its cursor must be the one before rollout r + 1 was generated
    assert states[:2] == [{"cursor": 1}, {"cursor": 2}]


def test_a_lag_above_one_stops_an_async_run_and_is_only_logged_in_sync():
    args = parser_defaults(async_train=True, num_rollout=5, ci_test=False, save=None)
    schedule = RolloutSchedule(args, FakeManager([0]), lambda ref, r: ref, 0, get=lambda ref: ref)
    stale = [Sample(weight_versions=["1"]), Sample(weight_versions=["3"])]  # the oldest sample counts
    assert off_policy_lag(stale, 3) == 2 and off_policy_lag([Sample(weight_versions=["default"])], 3) is None
    # a sample continued by --partial-rollout (requests at versions 1 and 3): its last request tells the schedule;
    # the age of its older tokens is rollout/partial/age_max
    assert off_policy_lag([Sample(weight_versions=["1", "3"])], 3) == 0
    with pytest.raises(SlimeLiteError, match=r"rollout 3 has samples generated with weight version 1, 2 versions "
                                             r"behind the trainer \(at most 1"):
        record_lag(schedule, stale, 3, {})
    schedule.overlap = False
    record = {}
    record_lag(schedule, stale, 3, record)
    assert record["rollout/off_policy_lag"] == 2.0


def test_ci_test_under_async_expects_version_r_minus_1_and_skips_the_logprob_check_off_policy():
    cfg = CiConfig.from_args(parser_defaults(ci_logprob_diff_threshold=1e-3))
    off_policy = {"rollout/weight_version": 1.0, "train/train_rollout_logprob_abs_diff": 0.5,
                  "train/first_step/ppo_kl": 0.0, "train/first_step/grad_norm": 1.0}
    checks = {c.name: c for c in cc.enforce(cfg, off_policy, 2, first=False, expected_version=1)}
    assert checks["weight_version_served"].passed and "train_rollout_logprob_diff" not in checks
    with pytest.raises(cc.CiCheckFailed, match="weight_version_served failed at rollout 2: value 0.0, expected == 1"):
        cc.enforce(cfg, dict(off_policy, **{"rollout/weight_version": 0.0}), 2, first=False, expected_version=1)
    with pytest.raises(cc.CiCheckFailed, match="train_rollout_logprob_diff"):  # synchronous: the same data fails
        cc.enforce(cfg, dict(off_policy, **{"rollout/weight_version": 2.0}), 2, first=False)
    with pytest.raises(cc.CiCheckFailed, match="first_step_ppo_kl_zero"):  # trainer-side checks stay on
        cc.enforce(cfg, dict(off_policy, **{"train/first_step/ppo_kl": 0.1}), 2, first=False, expected_version=1)


@pytest.mark.parametrize("extra, says", [
    (["--colocate"], "--colocate puts the engines on the trainer's GPUs, so there is nothing to overlap"),
    (["--debug-rollout-only"], "--debug-rollout-only builds no trainer"),
    (["--debug-train-only"], "start no engine"),
    (["--offload-rollout"], "--offload-rollout releases the engines' memory"),
    (["--use-fault-tolerance"], "not supported with --async yet"),
])
def test_async_is_refused_where_nothing_can_overlap(extra, says):
    with pytest.raises(SlimeLiteError) as info:  # before the model is even looked at: no --hf-checkpoint needed
        parse_args(["--async", *extra])
    assert str(info.value).startswith("--async: ") and says in str(info.value)


# ---- on 2 GPUs (scripts/test-gpu.sh): trainer and engine each on its own GPU, the disaggregated layout --async is for
def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices (trainer and engine on their own GPUs)")
def test_async_on_two_gpus_keeps_the_lag_at_one_and_passes_ci_test(tiny_model_dir, tmp_path):
    import json
    import subprocess
    import sys

    from slime_lite.tasks import make_data

    data = tmp_path / "addition.jsonl"
    make_data("addition", str(data), n_train=64, n_eval=8, seed=0)
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
            "--lr", "3e-3", "--entropy-coef", "0.01", "--num-rollout", "3", "--async", "--ci-test",
            "--check-weight-update-equal", "--metrics-path", str(tmp_path / "m.jsonl")]
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", *argv], capture_output=True, text=True,
                          timeout=900, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "--ci-test with --async" in log
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["rollout/off_policy_lag"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 0.0, 1.0]
    for prev, nxt in itertools.pairwise(rows):
        assert nxt["timeline/generate_start"] <= prev["timeline/train_start"]


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices (trainer and engine on their own GPUs)")
def test_fully_async_on_two_gpus_serves_each_push_and_passes_ci_test(tiny_model_dir, tmp_path):
    """--fully-async with the CUDA engine (captured decode steps updated in place while requests are paused between
    steps) and the trainer on its own GPU: every push reaches the engine, the weights check equal, each token's
    version is one the engine served, and --ci-test passes."""
    import json
    import subprocess
    import sys

    from slime_lite.rollout.dumps import load_rollout_dump
    from slime_lite.tasks import make_data
    from slime_lite.types import TOKEN_VERSIONS

    data = tmp_path / "addition.jsonl"
    make_data("addition", str(data), n_train=64, n_eval=8, seed=0)
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "64",
            "--lr", "3e-3", "--entropy-coef", "0.01", "--num-rollout", "4", "--fully-async", "--ci-test",
            "--max-weight-staleness", "1", "--check-weight-update-equal", "--metrics-path", str(tmp_path / "m.jsonl"),
            "--save-debug-rollout-data", str(tmp_path / "d_{rollout_id}.pt")]
    proc = subprocess.run([sys.executable, "-m", "slime_lite.cli", "train", *argv], capture_output=True, text=True,
                          timeout=900, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    for r in rows:
        assert r["rollout/async/lag_max"] <= 1  # the bound dropped anything older
        for s in load_rollout_dump(str(tmp_path / f"d_{r['rollout_id']}.pt")).samples:
            versions = s.metadata[TOKEN_VERSIONS]
            assert len(versions) == s.response_length and versions == sorted(versions)
            assert r["rollout_id"] - 1 <= min(versions) and max(versions) <= r["rollout_id"]


def test_the_doctor_runs_synchronously_when_given_async():
    # its iteration-2 reload check needs rollout 1 generated from the trained weights, which --async never does
    from slime_lite.debug.doctor import train_argv

    argv = train_argv(["--async", "--hf-checkpoint", "m", "--lr", "1e-4"], "/tmp/doctor-out")
    assert "--async" not in argv and argv[:4] == ["--hf-checkpoint", "m", "--lr", "1e-4"]


def test_async_save_keeps_only_the_cursor_the_next_checkpoint_can_need():
    """--async --save reads the rollout data state (with --partial-rollout: every carried sample) before each
    generation; with --save-interval above 1 the ones no checkpoint took must not pile up on the driver."""
    args = parser_defaults(async_train=True, num_rollout=10, ci_test=False, save="/ckpt")
    served = [0]
    schedule = RolloutSchedule(args, FakeManager(served), lambda ref, r: ref, 0, get=lambda ref: ref)
    saved = []
    for r in range(10):
        schedule.get(r)
        schedule.train_started()
        schedule.train_finished({})
        if r % 3 == 2:  # --save-interval 3
            saved.append(schedule.data_state(r))
        assert len(schedule.data_states) <= 1, sorted(schedule.data_states)
        schedule.before_push({})
        served[0] = r + 1
    assert saved == [{"cursor": 3}, {"cursor": 6}, {"cursor": 9}]
