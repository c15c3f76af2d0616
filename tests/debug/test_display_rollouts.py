from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from slime_lite.debug.display import main
from slime_lite.rollout.dumps import save_rollout_dump
from slime_lite.types import Sample


def test_shows_train_and_eval_dumps_samples_metrics_and_meta(dump_template: str, capsys) -> None:
    assert main(["--load-debug-rollout-data", dump_template]) == 0
    out = capsys.readouterr().out
    # every file, train and eval, in id order
    assert out.index("train rollout 0") < out.index("eval rollout 0") < out.index("train rollout 1")
    assert "rollout_eval_0.pt" in out
    for text in ("question-1", "answer-3", "truncated", "completed"):
        assert text in out
    # the metadata, each entry with its value
    assert "metadata.prompt_index" in out and "'sampling_seed': 103" in out.replace("\n", "")
    # recomputed metrics of rollout 0: 4 samples, one truncated
    assert "rollout/truncated_ratio" in out and "0.25" in out
    assert "rollout/raw_reward" in out and "rollout/response_len/mean" in out
    assert "rollout/rewards" not in out  # the estimator's normalisation is not in a dump
    assert "/models/tiny" in out  # meta


def test_rollout_id_and_max_samples_limit_the_output(dump_template: str, capsys) -> None:
    assert main(["--load-debug-rollout-data", dump_template, "--rollout-id", "0", "--max-samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "train rollout 1" not in out
    assert "answer-0" in out and "answer-1" not in out
    assert "3 more samples not shown" in out


def test_long_text_is_shortened_unless_full(tmp_path: Path, capsys) -> None:
    template = str(tmp_path / "d_{rollout_id}.pt")
    long = "head-" + "x" * 5000 + "-tail"
    save_rollout_dump(template.format(rollout_id=0), 0,
                      [Sample(index=0, prompt="p", tokens=[1, 2], response=long, response_length=1, reward=0.0)])
    main(["--load-debug-rollout-data", template])
    out = capsys.readouterr().out
    assert "chars ...]" in out and "x" * 1000 not in out and "-tail" in out
    main(["--load-debug-rollout-data", template, "--full"])
    out = capsys.readouterr().out
    assert out.replace("\n", "").replace("│", "").replace(" ", "").count("x") >= 5000


def test_slime_dump_without_meta(slime_dump: str, capsys) -> None:
    assert main(["--load-debug-rollout-data", slime_dump]) == 0
    out = capsys.readouterr().out
    assert "train rollout 5" in out and "slime-response" in out and "meta: none" in out


def test_no_matching_dump_is_a_clear_error(tmp_path: Path, capsys) -> None:
    assert main(["--load-debug-rollout-data", str(tmp_path / "nothing_{rollout_id}.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nothing_{rollout_id}.pt" in err and "no train or eval dump" in err
    assert "Traceback" not in err


def test_runs_as_module(dump_template: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "slime_lite.debug.display", "--load-debug-rollout-data",
                           dump_template, "--rollout-id", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "train rollout 1" in proc.stdout


def test_dict_rewards_without_reward_key_still_show_samples(tmp_path: Path, capsys, samples_factory) -> None:
    template = str(tmp_path / "d_{rollout_id}.pt")
    samples = samples_factory(1, 2)
    samples[0].reward, samples[1].reward = {"acc": 1.0}, {"acc": 0.0}
    save_rollout_dump(template.format(rollout_id=0), 0, samples)
    assert main(["--load-debug-rollout-data", template]) == 0
    out = capsys.readouterr().out
    assert "{'acc': 1.0}" in out and "rollout metrics not computed" in out and "--reward-key" in out
    assert main(["--load-debug-rollout-data", template, "--reward-key", "acc"]) == 0
    out = capsys.readouterr().out
    assert "rollout/raw_reward" in out and "0.5" in out


def test_a_single_file_path_works_too(dump_template: str, capsys) -> None:
    path = dump_template.format(rollout_id=1)
    assert main(["--load-debug-rollout-data", path]) == 0
    assert "rollout 1" in capsys.readouterr().out
    assert main(["--load-debug-rollout-data", path + ".missing"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_template_with_another_placeholder_is_a_clear_error(tmp_path: Path, capsys) -> None:
    """A train dump's template ({rank}) given to a rollout-dump tool: one line naming it (it was a KeyError)."""
    template = str(tmp_path / "train_{rollout_id}_{rank}.pt")
    assert main(["--load-debug-rollout-data", template]) == 2
    err = capsys.readouterr().err
    assert f"--load-debug-rollout-data '{template}' is not a valid template (KeyError: 'rank')" in err
    assert "Traceback" not in err


def test_a_rollout_id_past_999_is_found(tmp_path: Path, capsys) -> None:
    """A long run's dumps: --rollout-id 1500 is looked up (the search stopped at id 999: 'no dump found')."""
    template = str(tmp_path / "d_{rollout_id}.pt")
    save_rollout_dump(template.format(rollout_id=1500), 1500,
                      [Sample(index=0, prompt="p", tokens=[1, 2], response="late", response_length=1, reward=0.0)])
    assert main(["--load-debug-rollout-data", template, "--rollout-id", "1500"]) == 0
    assert "train rollout 1500" in capsys.readouterr().out
