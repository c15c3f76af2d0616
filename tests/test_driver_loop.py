"""The driver's loop (train.run) around phases that stop the run, without Ray: the two sides and the placement are
fakes (named so below) that record the calls; the loop, the schedule, the run checks and the metrics logger are the
real ones."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from slime_lite.args import parse_args
from slime_lite.errors import SlimeLiteError
from slime_lite.types import Sample


class FakeRolloutSide:
    """Engines and rollout manager: each rollout is four finished samples of the weights pushed last."""

    urls: list[str] = []

    def __init__(self, args, pg, layout, push) -> None:
        self.version = 0
        self.manager = SimpleNamespace(generate=SimpleNamespace(remote=lambda rollout_id: rollout_id),
                                       state=SimpleNamespace(remote=lambda: {}))

    def wait(self, ref, rollout_id):
        samples = [Sample(index=i, group_index=i // 2, tokens=[1, 2, 3], response_length=1, reward=1.0,
                          loss_mask=[1], rollout_log_probs=[-1.0], weight_versions=[str(self.version)])
                   for i in range(4)]
        return samples, {"rollout/raw_reward": 1.0}

    def push_weights(self, push, version, record) -> None:
        self.version = version

    def evaluate(self, trained) -> dict:
        return {}

    def step_records(self) -> dict:
        return {}

    def start(self, *a) -> None: ...
    def push_initial(self, *a) -> None: ...
    def release_memory(self, *a) -> None: ...
    def resume_memory(self, *a) -> None: ...
    def wait_dumps(self) -> None: ...
    def close(self) -> None: ...


class FakeTrainSide:
    """The actor: rollout 1's loss is NaN, and it stops the run as the real train side does (after recording it)."""

    trains, groups = True, []

    def __init__(self, args, pg, layout) -> None:
        pass

    def init(self):
        return 0, None

    def train(self, rollout_id, samples, record):
        record["train/loss"] = float("nan") if rollout_id == 1 else 0.5
        return {"actor": [1.0]}, [{"train/loss": record["train/loss"]}]

    @staticmethod
    def check_finite(rollout_id, record, norms, steps):
        if math.isnan(record["train/loss"]):
            raise SlimeLiteError(f"rollout {rollout_id}: the loss is nan")

    def push(self, *a) -> None: ...
    def push_checked(self, *a) -> None: ...
    def save(self, *a) -> None: ...
    def onload(self, *a) -> None: ...
    def offload(self, *a) -> None: ...

    def step_records(self) -> dict:
        return {}


def test_the_rollout_that_stops_the_run_still_writes_its_metrics_row(tiny_model_dir, tmp_path, monkeypatch):
    """A NaN loss (or a lag past the bound) stopped the run before its rollout's metrics reached --metrics-path:
    the one row compare-runs needs most. It is written, then the error goes on."""
    from slime_lite import placement, train
    from slime_lite.backends.megatron import side as train_side
    from slime_lite.rollout import side as rollout_side

    monkeypatch.setattr(train_side, "TrainSide", FakeTrainSide)
    monkeypatch.setattr(rollout_side, "RolloutSide", FakeRolloutSide)
    monkeypatch.setattr(placement, "init_ray", lambda args, n: None)
    monkeypatch.setattr(placement, "create_placement_group", lambda layout: None)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(4)))
    metrics = tmp_path / "m.jsonl"
    args = parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition",
                       "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "3",
                       "--skip-eval-before-train", "--metrics-path", str(metrics)])
    with pytest.raises(SlimeLiteError, match="the loss is nan"):
        train.run(args)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [row.get("rollout_id", row.get("step")) for row in rows]
    assert len(rows) == 2 and math.isnan(rows[1]["train/loss"]) and rows[0]["train/loss"] == 0.5, (steps, rows)
    # and its optimizer steps, logged before the check stops the run
    steps = [json.loads(line) for line in (tmp_path / "m.train_steps.jsonl").read_text().splitlines()]
    assert [x["train/step"] for x in steps] == [0, 1] and math.isnan(steps[1]["train/loss"])
