from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from slime_lite.debug.replay_reward import main, rewards_equal
from slime_lite.rollout.dumps import save_rollout_dump

_ids = itertools.count()


def _rm_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> str:
    """Write a reward hook module into tmp_path (a fresh module name per test) and return its dotted path."""
    name = f"replay_rm_{next(_ids)}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}.reward"


DISAGREES_ON_SAMPLE_2 = """
async def reward(args, sample, **kwargs):
    return 0.0 if sample.response == "answer-2" else 1.0
"""


def test_custom_rm_that_disagrees_on_one_sample(dump_template: str, tmp_path: Path, monkeypatch, capsys) -> None:
    rm = _rm_module(tmp_path, monkeypatch, DISAGREES_ON_SAMPLE_2)
    argv = ["--load-debug-rollout-data", dump_template, "--rollout-id", "0", "--custom-rm-path", rm]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1 rewards differ" in out
    row = next(line for line in out.splitlines() if "answer-2" in line)
    assert "1/2" in row and "1.0" in row and "0.0" in row  # group/index, stored, new
    assert "answer-0" not in out and "answer-3" not in out  # the agreeing samples are not listed
    # summary rows: train file 4 samples 3 same 1 differ; eval file (one sample, answer-0) all same
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if "rollout_0.pt" in line]
    assert ["train", "0", dump_template.format(rollout_id=0), "4", "3", "1"] in rows
    assert main(argv + ["--fail-on-diff"]) == 1


def test_agreeing_rm_reports_no_difference(dump_template: str, tmp_path: Path, monkeypatch, capsys) -> None:
    rm = _rm_module(tmp_path, monkeypatch, "def reward(args, sample):\n    return 1.0\n")
    assert main(["--load-debug-rollout-data", dump_template, "--custom-rm-path", rm, "--fail-on-diff"]) == 0
    out = capsys.readouterr().out
    assert "all rewards are the same" in out
    assert "rollout_1.pt" in out and "rollout_eval_0.pt" in out  # every dump of the template


def test_dict_rewards_compared_at_reward_key(tmp_path: Path, monkeypatch, capsys, samples_factory) -> None:
    template = str(tmp_path / "d_{rollout_id}.pt")
    samples = samples_factory(1, 2)
    for s in samples:
        s.reward = {"acc": 1.0, "fmt": 0.0}
    save_rollout_dump(template.format(rollout_id=0), 0, samples)
    rm = _rm_module(tmp_path, monkeypatch, "def reward(args, sample):\n    return {'acc': 1.0, 'fmt': 1.0}\n")
    base = ["--load-debug-rollout-data", template, "--custom-rm-path", rm, "--fail-on-diff"]
    assert main(base + ["--reward-key", "acc"]) == 0
    assert main(base + ["--reward-key", "fmt"]) == 1
    assert main(base) == 1  # whole dicts differ


def test_needs_a_reward_function(dump_template: str, capsys) -> None:
    assert main(["--load-debug-rollout-data", dump_template]) == 2
    assert "--rm-type" in capsys.readouterr().err


def test_rewards_equal() -> None:
    assert rewards_equal(1.0, 1.0 + 1e-9, 1e-6) and not rewards_equal(1.0, 1.1, 1e-6)
    assert rewards_equal(float("nan"), float("nan"), 0) and not rewards_equal(None, 0.0, 1e-6)
    assert rewards_equal({"a": 1, "b": [1]}, {"a": 1.0, "b": [1]}, 0) and not rewards_equal({"a": 1}, {"b": 1}, 0)


def test_builtin_rm_type(tmp_path: Path, capsys, samples_factory) -> None:
    template = str(tmp_path / "d_{rollout_id}.pt")
    samples = samples_factory(1, 2)  # stored reward 1.0, label == response
    samples[1].label = "something else"
    save_rollout_dump(template.format(rollout_id=0), 0, samples)
    assert main(["--load-debug-rollout-data", template, "--rm-type", "addition", "--fail-on-diff"]) == 1
    out = capsys.readouterr().out
    assert "1 rewards differ" in out and "something else" in out


def test_a_dump_without_labels_names_what_to_do_not_a_flag_replay_reward_lacks(tmp_path: Path, samples_factory,
                                                                               capsys):
    template = str(tmp_path / "d_{rollout_id}.pt")
    samples = samples_factory(1, 2)
    samples[1].label = None  # a run that read no labels
    save_rollout_dump(template.format(rollout_id=0), 0, samples)
    assert main(["--load-debug-rollout-data", template, "--rm-type", "addition"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"sample \d+ has no label .*--custom-rm-path", err) and "set --label-key" not in err


GROUP_RM = """
CALLS = []

async def reward(args, samples):
    CALLS.append(len(samples))
    return [1.0 if s.response == "answer-2" else 0.0 for s in samples]
"""


def test_group_rm_replays_a_group_reward_model_over_each_group(dump_template, tmp_path, monkeypatch, capsys):
    rm = _rm_module(tmp_path, monkeypatch, GROUP_RM)
    argv = ["--load-debug-rollout-data", dump_template, "--rollout-id", "0", "--custom-rm-path", rm, "--group-rm"]
    assert main(argv) == 0
    import importlib

    calls = importlib.import_module(rm.split(".")[0]).CALLS
    out = capsys.readouterr().out
    assert sorted(calls) == [1, 2, 2]  # the train dump's two groups of two, the eval dump's one sample
    assert "3 rewards differ" in out  # every stored 1.0 but answer-2's differs from what the group model says


def test_a_reward_key_no_reward_has_is_an_error_not_a_pass(tmp_path: Path, monkeypatch, capsys, samples_factory):
    template = str(tmp_path / "d_{rollout_id}.pt")
    samples = samples_factory(1, 2)
    for s in samples:
        s.reward = {"acc": 1.0}
    save_rollout_dump(template.format(rollout_id=0), 0, samples)
    rm = _rm_module(tmp_path, monkeypatch, "def reward(args, sample):\n    return {'acc': 0.0}\n")
    argv = ["--load-debug-rollout-data", template, "--custom-rm-path", rm, "--fail-on-diff", "--reward-key"]
    assert main(argv + ["accuracy"]) == 2
    assert "--reward-key 'accuracy' is not in the reward dict (keys: ['acc'])" in capsys.readouterr().err
    assert main(argv + ["acc"]) == 1


def test_remote_rm_and_per_row_rm_types_replay_as_they_trained(tmp_path: Path, monkeypatch, capsys, samples_factory):
    """remote_rm needs no label (the reward model may not use one); rows that carry their rm_type need no
    --rm-type. The remote reward model is a fake (an in-process function): no server runs here."""
    import slime_lite.rollout.rewards as rewards

    async def fake_remote(args, sample):
        return 1.0

    monkeypatch.setattr(rewards, "remote_reward", fake_remote)
    template = str(tmp_path / "d_{rollout_id}.pt")
    samples = samples_factory(1, 2)
    for s in samples:
        s.label = None
    save_rollout_dump(template.format(rollout_id=0), 0, samples)
    base = ["--load-debug-rollout-data", template, "--fail-on-diff"]
    assert main(base + ["--rm-type", "remote_rm", "--rm-url", "http://127.0.0.1:1/score"]) == 0
    assert "all rewards are the same" in capsys.readouterr().out
    samples = samples_factory(1, 2)  # label == response, stored reward 1.0
    samples[1].label = "something else"
    for s in samples:
        s.metadata["rm_type"] = "addition"
    save_rollout_dump(template.format(rollout_id=1), 1, samples)
    assert main(base + ["--rollout-id", "1"]) == 1
    assert "1 rewards differ" in capsys.readouterr().out
    samples[0].metadata.pop("rm_type")  # a row without one, and no flag: named
    save_rollout_dump(template.format(rollout_id=2), 2, samples)
    assert main(base + ["--rollout-id", "2"]) == 2
    assert "has no rm_type field; replay-reward needs --rm-type" in capsys.readouterr().err
